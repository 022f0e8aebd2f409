"""The interface of a model: what a ``chassis_register_models`` plugin provides."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from chassis.core.attention import AttentionBackend, ForwardContext
from chassis.core.layers.int4_linear import Int4Linear
from chassis.core.multimodal import MultiModalFeature
from chassis.core.request_state_cache import RequestStateSpec


def is_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer LoRA adapters may wrap: an ``nn.Linear``, or an
    :class:`~chassis.core.layers.int4_linear.Int4Linear` (a 4-bit checkpoint's layer kept
    packed), which has the same ``in_features`` / ``out_features`` and ``x -> x W^T + b``."""
    return isinstance(module, nn.Linear | Int4Linear)


class LoRASlice(NamedTuple):
    """One checkpoint projection inside a linear layer, as LoRA adapters see it."""

    #: the projection's HF module name (what a PEFT adapter's tensors are named after)
    hf_module: str
    #: the rows of the layer's output that are this projection's (on this rank)
    first_row: int
    rows: int
    #: the projection's whole shape in the checkpoint (what an adapter is checked against;
    #: under tensor parallelism more than this rank's share)
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelBuildContext:
    """What a model's constructor gets besides the HF config."""

    #: the selected backend; each attention layer instantiates it once
    attention_backend: type[AttentionBackend]
    dtype: torch.dtype
    #: the longest sequence (prompt + output) the engine serves (``--max-model-len``); ``None``
    #: when not known, and models then assume their config's own maximum. Models may use it
    #: to skip a sliding window no sequence outgrows, or to pick RoPE scaling (LongRoPE).
    max_model_len: int | None = None
    #: the decoder layer whose KV cache is ``ctx.kv_caches[0]``: 0, or a pipeline stage's
    #: first layer (a stage's caches hold its own layers only), so that the attention of
    #: decoder layer ``i`` reads cache ``i - first_cache_layer``
    first_cache_layer: int = 0


class CausalLM(nn.Module, ABC):
    """A decoder-only language model written for paged attention.

    Constructed as ``Model(hf_config, build_ctx)`` on the target device and dtype (the loader
    sets the default device and dtype around the constructor), then filled by
    :meth:`load_weights`.
    """

    #: The model shards itself over a tensor-parallel group: built in every rank's process, it
    #: keeps this rank's share (:mod:`chassis.core.parallel_state`), loads only that share from
    #: the full checkpoint tensors, and returns the full (summed) hidden states and logits on
    #: every rank. Its attention layers hold ``num_key_value_heads / N`` KV heads each (the
    #: runner sizes the KV cache so). ``--tensor-parallel-size`` above 1 is refused for models
    #: that do not.
    supports_tensor_parallel: bool = False
    #: The model splits its decoder layers over pipeline stages (``--pipeline-parallel-size``,
    #: :mod:`chassis.core.pipeline_parallel`): built in every stage's process, it builds and
    #: loads only that stage's layers (``needs_checkpoint_tensor`` skips the others'), counts
    #: them as its ``num_attention_layers`` (its attention layers read caches ``0 ..``), and its
    #: ``compute_logits`` returns the last stage's logits on every stage. Refused otherwise.
    supports_pipeline_parallel: bool = False
    #: The model is a sequence classifier: its forward returns class logits per token (a
    #: ``score`` head, not an LM head), which only a pooling engine runs; ``--runner auto``
    #: picks ``"pooling"`` for it (:mod:`chassis.core.pooling_classify`).
    is_sequence_classifier: bool = False
    #: The model is an encoder (BERT, XLM-RoBERTa): each prompt's tokens attend to one
    #: another in both directions and nothing is cached (``num_attention_layers`` is 0), so
    #: every request's whole prompt must be computed in one step. Such a model has no LM
    #: head: ``--runner auto`` picks ``"pooling"`` and ``"generate"`` is refused; the engine
    #: turns chunked prefill and prefix caching off and keeps ``--max-model-len`` within
    #: ``--max-num-batched-tokens`` (:mod:`chassis.core.encoder_only`). Its forward reads
    #: each request's boundaries from ``ctx.attn_metadata`` (``query_start_loc_cpu``).
    is_encoder_only: bool = False
    #: The model has no LM head but is not an encoder: a decoder saved as HF's bare
    #: ``*Model`` class (e5-mistral's ``MistralModel``, bge-multilingual-gemma2's
    #: ``Gemma2Model``), whose forward returns hidden states for a pooling engine to pool.
    #: ``--runner auto`` picks ``"pooling"`` and ``"generate"`` is refused
    #: (:func:`~chassis.core.pooling_classify.resolve_runner`); prompts are computed as a
    #: decoder's (chunked, prefix-cached).
    is_pooling_only: bool = False
    #: The pooling a pooling engine of this model uses when neither ``pooler_config`` nor
    #: the checkpoint's sentence-transformers files name one (vLLM's default for the
    #: architecture): the last token for decoders, the first (``"CLS"``) for BERT-like
    #: encoders.
    default_pooling_type: str = "LAST"
    #: Checkpoint projections the model merges: the last part of a checkpoint module's name
    #: -> the module of this model it loads into (Llama: ``q_proj``, ``k_proj`` and
    #: ``v_proj`` -> ``qkv_proj``); a projection not listed loads into the module of its own
    #: name, so a model that merges nothing declares ``{}``. ``None`` (the default): not
    #: declared. The loader asks it where a checkpoint tensor belongs without loading it (the
    #: zero biases of packed AWQ/GPTQ checkpoints,
    #: :func:`~chassis.core.packed_int_weights.without_phantom_biases`), and refuses what it
    #: cannot place when it is ``None`` rather than guess.
    merged_projections: Mapping[str, str] | None = None

    #: The modalities (:data:`chassis.core.multimodal.MODALITIES`) the model's requests may
    #: carry besides text; empty for a text-only model (a request with an image is then
    #: refused by the front-end). A model that takes some implements
    #: :meth:`multimodal_processor`, :meth:`embed_input_ids` and :meth:`embed_multimodal`,
    #: and its forward takes ``inputs_embeds``.
    supported_modalities: frozenset[str] = frozenset()
    #: The model's rotary embedding takes three position components per token (Qwen2-VL's
    #: M-RoPE: temporal, height, width): the runner asks :meth:`mrope_positions` for each
    #: prompt and passes ``positions`` as ``[3, num_tokens]`` when a step holds a token
    #: whose components differ; otherwise ``[num_tokens]`` (the three equal).
    uses_mrope: bool = False
    #: The tokens of each multimodal item (the placeholder range of each feature) attend to
    #: one another both ways, as Gemma 3's image tokens do (HF's ``token_type_ids``); other
    #: tokens stay causal. The runner then sets ``AttentionMetadata.attend_limit`` on the
    #: steps that schedule such tokens, the model must refuse a backend without
    #: ``supports_attend_limit`` when built, and the scheduler never ends a prefill chunk
    #: strictly inside an item (``Request.bidirectional_blocks``; docs/multimodal.md).
    bidirectional_image_blocks: bool = False
    #: Every attention layer of the model always passes the same tensor as key and value
    #: (DeepSeek's MLA caches one latent vector per token, which is both): a KV cache whose V
    #: plane aliases its K plane is then correct, and the runner allocates one plane instead
    #: of two where the attention backend supports it
    #: (``AttentionBackend.supports_aliased_kv_planes``; ``core.attention.alias_kv_planes``).
    kv_cache_values_are_keys: bool = False
    #: The model carries a fixed-size state per request from step to step (state-space
    #: layers: Mamba2), declared by :meth:`request_state_specs`. The engine then turns prefix
    #: caching off and refuses speculative decoding
    #: (:func:`~chassis.core.request_state_cache.apply_recurrent_state_settings`), and the
    #: runner passes each request's slot in ``ctx.state_slots``.
    has_recurrent_state: bool = False
    #: What the recurrent state holds, for the log line that turns prefix caching off.
    recurrent_state_label: str = "state-space layers"
    #: The model is an encoder-decoder (Whisper): a request's multimodal item feeds the
    #: encoder and takes no decoder prompt position; in the step that computes the
    #: request's first decoder tokens (position 0) the runner passes the item's tensors to
    #: the forward as ``encoder_inputs`` (one entry per request of the step, ``None`` for
    #: the others; :meth:`~chassis.core.multimodal_runner.MultiModalRunner.encoder_inputs`).
    #: The front-end sends its every request through the model's processor (which may
    #: refuse one without its item) and tokenizes text prompts without special tokens
    #: (:meth:`~chassis.core.multimodal_inputs.MultiModalInputs.is_encoder_decoder`).
    is_encoder_decoder: bool = False
    #: Why the model cannot run prompts given as input embeddings
    #: (``--enable-prompt-embeds``) although it implements :meth:`embed_input_ids` and its
    #: forward takes ``inputs_embeds`` (its decoder embeds the tokens itself: OPT's,
    #: GPT-2's); ``None`` (the default): it can. The flag is refused at start with this reason
    #: (:func:`~chassis.core.prompt_embeds_runner.prompt_embeds_refusal`).
    prompt_embeds_refusal: str | None = None

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__()
        self.hf_config = hf_config

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder over a flattened batch.

        :param input_ids: ``[num_tokens]`` int64
        :param positions: ``[num_tokens]`` int64, position of each token in its sequence
            (the rotary position; ``[3, num_tokens]`` for a :attr:`uses_mrope` model when
            the components differ)
        :param ctx: attention metadata and the per-layer KV caches
        :param inputs_embeds: ``[num_tokens, hidden_size]`` input embeddings to use instead of
            embedding ``input_ids`` (a multimodal step: :meth:`embed_input_ids` with the
            image placeholders' rows replaced by :meth:`embed_multimodal`'s); only models
            with :attr:`supported_modalities` are passed one
        :return: final hidden states ``[num_tokens, hidden_size]`` (after the last norm)
        """

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's processor of this model's multimodal inputs (a
        :class:`chassis.core.multimodal_processing.MultiModalProcessor`), built from the
        checkpoint folder (its ``preprocessor_config.json``); ``None`` (the default) for a
        text-only model."""
        return None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, hidden_size]`` input embeddings (what :meth:`forward`
        computes first when not given ``inputs_embeds``).

        A model whose multimodal rows carry more than an input embedding may return wider
        rows here and from :meth:`embed_multimodal`, the same width from both, when its
        forward takes ``inputs_embeds`` of that width: Qwen3-VL puts its deepstack inputs
        beside the embedding (zero for text tokens). The runner only moves whole rows."""
        raise NotImplementedError(f"{type(self).__name__} does not take multimodal inputs")

    def prompt_embeds_to_inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """Prompt rows given as embeddings -> the rows :meth:`forward` reads as
        ``inputs_embeds`` (:meth:`embed_input_ids`' kind), in the model's dtype.

        Given rows are HF's ``inputs_embeds``: what the checkpoint's input embedding layer
        returns (``model.get_input_embeddings()(ids)``). The default keeps them: the model
        scales nothing, or scales inside that layer (Gemma's ``sqrt(hidden_size)``). A model
        whose HF forward scales ``inputs_embeds`` after that layer, given ones too
        (Granite's ``embedding_multiplier``), applies its scale here."""
        return rows

    def embed_multimodal(self, modality: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One multimodal item's embeddings: ``inputs`` are its processed tensors
        (:meth:`chassis.core.multimodal.MultiModalFeature.tensors`, on the model's device);
        returns ``[length, hidden_size]`` in the model's dtype, one row per placeholder token
        of the item, in order (or rows as wide as :meth:`embed_input_ids`' where that
        returns wider ones)."""
        raise NotImplementedError(f"{type(self).__name__} does not take {modality} inputs")

    def mrope_positions(
        self, prompt_token_ids: Sequence[int], features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray, int]:
        """For a :attr:`uses_mrope` model: the prompt's rotary positions ``[3, len(prompt)]``
        (int64) and the delta of the tokens after it: the token at sequence index ``p`` past
        the prompt has all three components ``p + delta``."""
        raise NotImplementedError(f"{type(self).__name__} does not use M-RoPE")

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` logits."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the module; return what it filled.

        The returned names are the module's own parameter names (as in
        ``named_parameters()``), each included once it is completely filled (a merged
        parameter only when all its shards arrived). Unknown names raise ``ValueError``; the
        loader checks every parameter is among the returned names.
        """

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Whether the loader should read checkpoint tensor ``name`` (HF name) and pass it to
        :meth:`load_weights`. The default reads everything; a model whose rank holds only
        some tensors whole (the experts it holds under expert parallelism) says no to the
        others, so that they are never read from disk."""
        return True

    def graph_capture_blocker(self) -> str | None:
        """Why this model's forward cannot be captured as a device graph, or ``None``.

        Asked once the weights are on the device, before decode graphs are captured; a
        reason makes decode steps run eager (and is logged). The default asks every
        submodule that has a ``graph_capture_blocker()`` method of its own (a layer whose
        implementation on this platform reads device values on the host, such as a
        mixture-of-experts layer without a fused kernel) and returns the first reason.
        """
        for module in self.modules():
            if module is self:
                continue
            ask = getattr(module, "graph_capture_blocker", None)
            reason = ask() if callable(ask) else None
            if reason is not None:
                return reason
        return None

    # -- auxiliary hidden states (EAGLE-3 heads read several layers: core/eagle3.py) ----------

    def default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The layers whose hidden states an EAGLE-3 head reads when its config names none:
        vLLM's ``(2, num_layers // 2, num_layers - 3)``."""
        num_layers = int(self.hf_config.num_hidden_layers)
        return (2, num_layers // 2, num_layers - 3)

    def set_aux_hidden_state_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Keep, from now on, the hidden state entering each decoder layer of ``layer_ids``
        (the residual stream before that layer: HF's ``hidden_states[i]``) in every forward,
        for :meth:`take_aux_hidden_states`; ``()`` turns it off. A model that can sets this
        and costs nothing while it is off; the default refuses (``ValueError`` naming the
        model), as does a model given an id outside ``0 .. num_layers - 1``. Decode graphs
        copy the kept states into static buffers and hand them back after each replay
        (:meth:`aux_hidden_state_layers`, :meth:`put_aux_hidden_states`)."""
        raise ValueError(
            f"{type(self).__name__} does not expose auxiliary hidden states of its layers, "
            "which an EAGLE-3 head reads (supported: Llama-family targets)"
        )

    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The layers whose hidden states the forward keeps now (``()``: none, the default)."""
        return ()

    def put_aux_hidden_states(self, states: list[torch.Tensor]) -> None:
        """Make ``states`` what the next :meth:`take_aux_hidden_states` returns: the kept
        states of a forward that ran as a replayed graph (no Python ran to keep them), read
        from the graph's static buffers. Default: refused, as :meth:`take_aux_hidden_states`."""
        raise ValueError(f"{type(self).__name__} does not expose auxiliary hidden states")

    def take_aux_hidden_states(self) -> list[torch.Tensor]:
        """The hidden states the last forward kept (:meth:`set_aux_hidden_state_layers`),
        ``[num_tokens, hidden_size]`` each in ``layer_ids`` order, and forget them."""
        raise ValueError(f"{type(self).__name__} does not expose auxiliary hidden states")

    def lora_slices(self, module_name: str, module: nn.Module) -> list[LoRASlice]:
        """The HF projections the linear layer ``module_name`` holds, for LoRA adapters (one
        :class:`LoRASlice` each); empty when adapters may not change the layer.

        PEFT adapters name the checkpoint's modules, so a layer that merges several HF
        projections (Q/K/V in one matmul) returns one slice per projection. The default: an
        ``nn.Linear`` other than ``lm_head`` is one projection under its own name, whole
        (right for a model whose module names are the checkpoint's and that does not shard
        itself); anything else is not adaptable. A layer kept as packed 4-bit codes
        (:class:`~chassis.core.layers.int4_linear.Int4Linear`) counts as a linear layer: the
        adapters' deltas are added to its output as to any other.
        """
        if not is_linear(module) or module_name.split(".")[-1] == "lm_head":
            return []
        rows = int(module.out_features)
        return [LoRASlice(module_name, 0, rows, int(module.in_features), rows)]

    def lora_module_aliases(self, hf_module: str) -> tuple[str, ...]:
        """Other names adapters may give the projection :meth:`lora_slices` calls
        ``hf_module`` (none by default). A multimodal checkpoint's language model is
        ``model.layers.*`` in hub files and ``model.language_model.layers.*`` to
        transformers 5, and PEFT adapters trained on either name it so."""
        return ()

    def lora_shard(
        self, hf_module: str, lora_a: torch.Tensor, lora_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's ``A [r, in]`` and ``B [out, r]`` for the HF
        projection ``hf_module`` (whole shapes, as in the adapter file). A model that shards
        itself over a tensor-parallel group cuts them as it cuts that projection's weight
        (the rows of B for a column-parallel one, the columns of A for a row-parallel one,
        whose partial outputs the all-reduce then sums with the adapter's); the default
        returns them whole."""
        return lora_a, lora_b

    @classmethod
    def class_for_config(cls, hf_config: Any) -> type[CausalLM]:
        """The class that builds ``hf_config``'s model: this one by default. A class
        registered for checkpoints whose decoder varies (LLaVA-style multimodal checkpoints
        over any text model) returns the class for the config's; the registry lookups
        (:func:`~chassis.core.model_loader.model_class`) go through here."""
        return cls

    @classmethod
    def check_tensor_parallel(cls, hf_config: Any, size: int) -> None:
        """Raise ``ValueError`` when ``hf_config``'s model cannot be split over ``size``
        tensor-parallel ranks in ways the engine does not check itself (it checks
        ``num_attention_heads`` and the KV heads); called before any rank starts. Nothing by
        default (state-space models check their mixers' heads and groups)."""

    @classmethod
    def context_length(cls, hf_config: Any) -> int | None:
        """The longest sequence the model can run when its config's length keys
        (``max_position_embeddings``, ...) overstate it, else ``None`` (those keys decide).
        RoBERTa's position table starts at ``pad_token_id + 1``: two of its 514 rows are
        never used."""
        return None

    def request_state_specs(self) -> list[RequestStateSpec]:
        """The tensors each request carries across steps (:attr:`has_recurrent_state`), in
        the order ``ctx.request_states`` holds their pools; none by default. Declare them in
        the model's dtype; a spec's ``kind`` (``"conv"``, ``"ssm"``) lets
        ``--mamba-cache-dtype`` / ``--mamba-ssm-cache-dtype`` store it in another, so a
        layer must read its pools in whatever dtype they have."""
        return []

    @property
    def num_attention_layers(self) -> int:
        """How many KV caches the model needs (one per attention layer)."""
        return int(self.hf_config.num_hidden_layers)
