"""Whisper (``WhisperForConditionalGeneration``): an encoder-decoder speech recognizer.

As transformers' ``modeling_whisper.py`` defines it:

- the **encoder** is Qwen2-Audio's audio tower without its pool
  (:class:`~chassis.builtin_plugins.models.qwen2_audio_encoder.Qwen2AudioTower`'s modules):
  two GELU convolutions over a 30 s clip's log-mel features ``[mel_bins, 3000]``, the
  position rows, pre-norm layers attending over all ``max_source_positions`` rows (HF masks
  nothing), a final LayerNorm;
- the **decoder**: token embeddings (not scaled) plus learned positions
  (``max_target_positions`` rows), pre-norm layers of causal self-attention (the paged KV
  cache), cross-attention to the encoder's rows and a GELU MLP, a final LayerNorm; the LM
  head (``proj_out``) is the token embedding, tied.

How it runs in the engine (:attr:`~chassis.core.model_interface.CausalLM.is_encoder_decoder`):
a request's clip is one ``"audio"`` multimodal item that occupies no decoder prompt position
(:mod:`.whisper_processing`); the model runner hands the model the clip's tensors in the step
that computes the request's first decoder tokens (position 0: its first step, or its first
again after a preemption, which restarts it from 0). That step runs the encoder and writes
each decoder layer's cross-attention keys and values ``[2, heads, max_source_positions,
head_dim]`` into the request's state slot (:mod:`chassis.core.request_state_cache`); every
later step reads them from there. The slot makes the engine turn prefix caching off and
refuse speculative decoding (:attr:`has_recurrent_state`). Not tensor parallel; decode steps
run eager (no device graphs: the cross-attention reads per-request slots).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.qwen2_audio_encoder import AudioTowerSpec, Qwen2AudioTower
from chassis.builtin_plugins.models.qwen2_vl_vision import activation
from chassis.core.attention import ForwardContext
from chassis.core.layers.attention import Attention
from chassis.core.model_interface import CausalLM, ModelBuildContext
from chassis.core.request_state_cache import RequestStateSpec


class WhisperEncoder(Qwen2AudioTower):
    """Whisper's encoder: ``[clips, mel_bins, 2 * max_source_positions]`` features ->
    ``[clips, max_source_positions, d_model]`` (the tower's modules, no pool, no key mask)."""

    def forward(
        self, features: torch.Tensor, num_frames: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``ValueError`` for features of another shape than the config's."""
        spec = self.spec
        if features.dim() != 3 or tuple(features.shape[1:]) != (spec.mel_bins, spec.num_frames):
            raise ValueError(
                f"Whisper input_features must be [clips, {spec.mel_bins}, {spec.num_frames}] "
                f"(mel bins, frames of a 30 s window); got {tuple(features.shape)}"
            )
        x = features.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)
        x = x + self.embed_positions.weight
        everything = torch.ones(1, 1, 1, x.shape[1], dtype=torch.bool, device=x.device)
        for layer in self.layers:
            x = layer(x, everything)
        return self.layer_norm(x)


class _Projections(nn.Module):
    """Whisper's attention projections (k without bias), by their checkpoint names."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)


class _DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, layer_idx: int, build_ctx: ModelBuildContext) -> None:
        super().__init__()
        dim = int(hf_config.d_model)
        self.num_heads = int(hf_config.decoder_attention_heads)
        self.head_dim = dim // self.num_heads
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.self_attn = _Projections(dim)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_heads,
            self.scale,
            layer_idx,
            build_ctx.attention_backend,
        )
        self.encoder_attn = _Projections(dim)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, int(hf_config.decoder_ffn_dim))
        self.fc2 = nn.Linear(int(hf_config.decoder_ffn_dim), dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.act = activation(str(getattr(hf_config, "activation_function", "gelu")))

    def cross_kv(self, encoded: torch.Tensor) -> torch.Tensor:
        """``[clips, S, d_model]`` encoder rows -> ``[clips, 2, heads, S, head_dim]`` (heads
        before rows: the layout attention reads, no transpose per step)."""
        clips, rows, _ = encoded.shape
        shape = (clips, rows, self.num_heads, self.head_dim)
        k = self.encoder_attn.k_proj(encoded).view(shape)
        v = self.encoder_attn.v_proj(encoded).view(shape)
        return torch.stack((k, v), dim=1).transpose(2, 3)

    def forward(
        self,
        h: torch.Tensor,
        ctx: ForwardContext,
        cross: torch.Tensor,
        bounds: Sequence[int],
    ) -> torch.Tensor:
        """``h [T, d_model]``; ``cross[i]`` request ``i``'s ``[2, heads, S, head_dim]``,
        its tokens ``bounds[i] .. bounds[i + 1]``."""
        x = self.self_attn_layer_norm(h)
        sa = self.self_attn
        out = self.attn(sa.q_proj(x), sa.k_proj(x), sa.v_proj(x), ctx)
        h = h + sa.out_proj(out)
        h = h + self.encoder_attn.out_proj(
            self._cross_attention(self.encoder_attn_layer_norm(h), cross, bounds)
        )
        return h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))

    def _cross_attention(
        self, x: torch.Tensor, cross: torch.Tensor, bounds: Sequence[int]
    ) -> torch.Tensor:
        """``cross [R, 2, H, S, D]``: the step's requests' keys and values, in order."""
        q = self.encoder_attn.q_proj(x).view(-1, self.num_heads, self.head_dim)
        if len(bounds) - 1 == q.shape[0]:
            # decode: one query per request, all requests in one call
            out = F.scaled_dot_product_attention(
                q[:, :, None], cross[:, 0], cross[:, 1], scale=self.scale
            )
            return out.reshape(q.shape[0], -1)
        pieces = []
        for i, kv in enumerate(cross):
            qi = q[bounds[i] : bounds[i + 1]].transpose(0, 1)  # [H, n, D]
            out = F.scaled_dot_product_attention(qi, kv[0], kv[1], scale=self.scale)
            pieces.append(out.transpose(0, 1).reshape(qi.shape[1], -1))
        return torch.cat(pieces)


class _Decoder(nn.Module):
    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__()
        dim = int(hf_config.d_model)
        self.embed_tokens = nn.Embedding(int(hf_config.vocab_size), dim)
        self.embed_positions = nn.Embedding(int(hf_config.max_target_positions), dim)
        self.layers = nn.ModuleList(
            _DecoderLayer(hf_config, i, build_ctx) for i in range(int(hf_config.decoder_layers))
        )
        self.layer_norm = nn.LayerNorm(dim)


class _Body(nn.Module):
    """``model.*``: the encoder and the decoder, by their checkpoint names."""

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(AudioTowerSpec.from_config(hf_config))
        self.decoder = _Decoder(hf_config, build_ctx)


class WhisperForConditionalGeneration(CausalLM):
    """``WhisperForConditionalGeneration`` checkpoints (module docstring)."""

    supported_modalities = frozenset({"audio"})
    is_encoder_decoder = True
    has_recurrent_state = True
    recurrent_state_label = "cross-attention keys and values of its audio"

    def __init__(self, hf_config: Any, build_ctx: ModelBuildContext) -> None:
        super().__init__(hf_config, build_ctx)
        heads = int(hf_config.decoder_attention_heads)
        if int(hf_config.d_model) % heads:
            raise ValueError(
                f"Whisper d_model {hf_config.d_model} is not divisible by "
                f"decoder_attention_heads {heads}"
            )
        if int(hf_config.encoder_attention_heads) != heads:
            # (the runner shapes the KV cache from num_attention_heads, which transformers
            # maps to the encoder's heads)
            raise ValueError(
                f"Whisper checkpoints with encoder_attention_heads "
                f"{hf_config.encoder_attention_heads} != decoder_attention_heads {heads} are "
                "not supported"
            )
        max_len = build_ctx.max_model_len
        positions = int(hf_config.max_target_positions)
        if max_len is not None and max_len > positions:
            raise ValueError(
                f"max_model_len {max_len} exceeds Whisper's {positions} decoder positions "
                "(max_target_positions)"
            )
        self.dtype = build_ctx.dtype
        self.model = _Body(hf_config, build_ctx)
        self.num_heads = heads
        self.head_dim = int(hf_config.d_model) // heads
        self.encoder_len = int(hf_config.max_source_positions)

    @property
    def num_attention_layers(self) -> int:
        return int(self.hf_config.decoder_layers)

    @classmethod
    def multimodal_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The front-end's clip processor (:class:`~.whisper_processing.WhisperInputs`)."""
        from chassis.builtin_plugins.models.whisper_processing import WhisperInputs

        return WhisperInputs.from_pretrained(model_dir, hf_config)

    def request_state_specs(self) -> list[RequestStateSpec]:
        """Per decoder layer, the cross-attention K and V of the request's clip ``[2, heads,
        max_source_positions, head_dim]`` in the model's dtype (no dtype flag changes
        them)."""
        shape = (2, self.num_heads, self.encoder_len, self.head_dim)
        return [
            RequestStateSpec(f"layers.{i}.cross_kv", shape, self.dtype)
            for i in range(self.num_attention_layers)
        ]

    def graph_capture_blocker(self) -> str | None:
        return "Whisper's cross-attention reads per-request encoder keys and values"

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_tokens(input_ids)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """``[clips, mel_bins, frames]`` log-mel features -> every decoder layer's cross K/V
        ``[layers, clips, 2, heads, S, head_dim]``."""
        encoded = self.model.encoder(features)
        return torch.stack([layer.cross_kv(encoded) for layer in self.model.decoder.layers])

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
        encoder_inputs: Sequence[Mapping[str, torch.Tensor] | None] | None = None,
    ) -> torch.Tensor:
        """The decoder over the step's tokens (:meth:`CausalLM.forward`).
        ``encoder_inputs[i]``: the tensors of request ``i``'s clip (``input_features``) when
        this step computes its first decoder tokens, else ``None``; those requests' cross
        K/V are computed and stored in their slots first."""
        bounds = ctx.attn_metadata.query_start_loc_cpu.tolist()
        num_reqs = len(bounds) - 1
        layers = self.model.decoder.layers
        pools: Sequence[torch.Tensor]
        if ctx.request_states is None or ctx.state_slots is None:
            # memory profiling: zero keys and values, nothing kept (one [R, ...] tensor: what
            # a layer's gather below allocates)
            shape = (num_reqs, *self.request_state_specs()[0].shape)
            zeros = torch.zeros(shape, dtype=self.dtype, device=input_ids.device)
            pools, slots_t = [zeros] * len(layers), None
        else:
            pools, slots_t = ctx.request_states, ctx.state_slots
            fresh = [i for i, item in enumerate(encoder_inputs or ()) if item is not None]
            if fresh:
                assert encoder_inputs is not None
                slots = slots_t.tolist()  # (a sync only in steps that encode)
                features = torch.cat([_clip_features(encoder_inputs[i]) for i in fresh]).to(
                    input_ids.device
                )
                kv = self.encode(features)
                for n, i in enumerate(fresh):
                    for layer, pool in enumerate(pools):
                        pool[slots[i]].copy_(kv[layer, n])
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        h = h + self.model.decoder.embed_positions(positions)
        for layer, pool in zip(layers, pools, strict=True):
            # the step's requests' K/V [R, 2, heads, S, head_dim]: one gather per layer, made
            # when the layer runs (one layer's at a time); the slot tensor stays on the
            # device (no sync)
            cross = pool if slots_t is None else pool.index_select(0, slots_t)
            h = layer(h, ctx, cross, bounds)
        return self.model.decoder.layer_norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # proj_out is tied to the decoder's token embedding
        return hidden_states @ self.model.decoder.embed_tokens.weight.t()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names are the module's (``model.encoder.*``, ``model.decoder.*``);
        ``proj_out.weight`` (the tied head: the decoder's ``embed_tokens``) is skipped;
        the decoder's self-attention projections load as named."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "proj_out.weight":
                continue  # tied: the decoder's embed_tokens
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no counterpart in Whisper")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; Whisper's "
                    f"parameter has {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        return loaded


def _clip_features(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One clip's ``input_features`` as ``[1, mel_bins, frames]``; ``ValueError`` without."""
    features = inputs.get("input_features")
    if features is None:
        raise ValueError(f"Whisper audio inputs need input_features (got {sorted(inputs)})")
    return features[None] if features.dim() == 2 else features
