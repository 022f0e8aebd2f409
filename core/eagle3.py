"""EAGLE-3 speculative decoding (``--speculative-config`` method ``eagle3``, e.g.
``{"method": "eagle3", "model": "path/to/eagle3-head", "num_speculative_tokens": 4}``).

An EAGLE-3 head (``builtin_plugins/models/llama_eagle3.py``) is an EAGLE head that reads the
hidden states of several target layers instead of the last one, and drafts over a
vocabulary of its own mapped to the target's ids. Everything else is EAGLE-1's
(:mod:`chassis.core.eagle`): the same positions, KV cache, draft rounds and verification.

- **Target.** At start-up the target is asked to keep the hidden state entering each target
  layer the head reads (``eagle_aux_hidden_state_layer_ids`` of the head's config, else the
  target's default, vLLM's ``(2, L // 2, L - 3)``) in every forward
  (:meth:`~chassis.core.model_interface.CausalLM.set_aux_hidden_state_layers`); a target
  that cannot, or ids outside its layers, are refused there. Decode graphs copy them into
  static buffers that the runner hands back to the target after each replay
  (:mod:`chassis.core.cuda_graphs`); without an EAGLE-3 head nothing is kept or tested
  per layer.
- **Drafts.** The step's first head forward reads ``fc(cat(aux states))`` of each position
  it runs over; the later draft steps read the head's own pre-norm output. The head's
  logits over its draft vocabulary are placed at their target ids (``d + d2t[d]``) with
  ``-inf`` elsewhere, so a greedy draft is the argmax over the draft vocabulary (found
  there and mapped through ``d2t``, without widening: :meth:`Eagle3Proposer.greedy_drafts`)
  and a random request's ``q`` (over the target's vocabulary, 0 outside the draft's) is what
  rejection sampling verifies: the target's distribution is kept exactly.

Limits: Llama-style heads of one decoder layer (the published layout; a ``layers.1.*`` is
refused); Llama-family targets
(those whose decoder is :class:`~chassis.builtin_plugins.models.llama.LlamaModel`'s
forward); ``--torch-compile`` is refused with it. Checkpoints: safetensors or
``pytorch_model.bin``, config in the HF or the speculators layout
(:mod:`chassis.core.head_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from chassis.core.eagle import EagleProposer

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend, ForwardContext
    from chassis.core.config import EngineConfig
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)

#: the registered architecture of EAGLE-3 Llama heads (the published heads' name)
HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"


def aux_layer_ids(head_config: object, target: CausalLM) -> tuple[int, ...]:
    """The target layers whose entering hidden states the head reads: its config's
    ``eagle_aux_hidden_state_layer_ids``, else the target's default."""
    ids = getattr(head_config, "eagle_aux_hidden_state_layer_ids", None)
    if ids:
        return tuple(int(i) for i in ids)
    return tuple(target.default_aux_hidden_state_layers())


def load_eagle3_head(
    config: EngineConfig,
    target: CausalLM,
    attention_backend_cls: type[AttentionBackend],
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Build and fill the EAGLE-3 head of ``config.speculative`` (method ``eagle3``) over
    ``target`` on ``device`` in ``dtype``, and make the target keep the head's layers'
    hidden states.

    ``ValueError`` (one line, naming what to change) when the head is not an EAGLE-3 head,
    its vocabulary or ``target_hidden_size`` differ from the target's, its draft vocabulary
    is smaller than the target's without a ``d2t``, its layer ids fall outside the target's
    layers, the target cannot expose its layers' hidden states, ``--torch-compile`` is on,
    or a parameter is left unfilled.
    """
    from chassis.core.head_checkpoint import (
        head_tensor_names,
        iterate_head_tensors,
        load_head_config,
    )
    from chassis.core.model_interface import ModelBuildContext
    from chassis.core.model_loader import _default_dtype, resolve_model_path
    from chassis.core.quantized_weights import check_quantization
    from chassis.plugins.registries import get_registries

    spec = config.speculative
    if spec is None or not spec.uses_eagle3 or spec.model is None:
        raise ValueError("load_eagle3_head needs --speculative-config method 'eagle3'")
    name = spec.model
    if config.torch_compile:
        raise ValueError(
            "--speculative-config method 'eagle3' cannot be combined with --torch-compile yet: "
            "the target keeps several layers' hidden states as a side output (drop one)"
        )
    path = resolve_model_path(name)
    hf_config = load_head_config(path, HEAD_ARCHITECTURE, name)  # HF or speculators layout
    names = head_tensor_names(path)  # safetensors or pytorch_model.bin
    if "fc.weight" not in names or not any(n.startswith(("midlayer.", "layers.0.")) for n in names):
        raise ValueError(
            f"the EAGLE-3 head {name!r} has no fc.weight and midlayer.* tensors: it is not an "
            "EAGLE-3 head (method 'eagle3' takes fc + one decoder layer over several target "
            "layers)"
        )
    extra = sorted(
        {n.split(".")[1] for n in names if n.startswith("layers.") and n.split(".")[1] != "0"}
    )
    if extra:
        raise ValueError(
            f"the EAGLE-3 head {name!r} has decoder layers {['0', *extra]}: heads of one "
            "decoder layer (midlayer) only are supported"
        )
    target_config = target.hf_config
    target_hidden = int(getattr(target_config, "hidden_size", -1))
    head_target_hidden = int(
        getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size
    )
    if head_target_hidden != target_hidden:
        raise ValueError(
            f"the EAGLE-3 head {name!r} reads target hidden states of size "
            f"{head_target_hidden} and the target's are {target_hidden}: pick the head "
            "trained for this target"
        )
    head_vocab, target_vocab = int(hf_config.vocab_size), int(target_config.vocab_size)
    if head_vocab != target_vocab:
        raise ValueError(
            f"the EAGLE-3 head {name!r} has a vocabulary of {head_vocab} tokens and the "
            f"target {target_vocab}: it must be made for the target's vocabulary"
        )
    draft_vocab = int(getattr(hf_config, "draft_vocab_size", None) or head_vocab)
    if draft_vocab > head_vocab:
        raise ValueError(
            f"the EAGLE-3 head {name!r} has draft_vocab_size {draft_vocab}, more than its "
            f"vocab_size {head_vocab}"
        )
    if draft_vocab < head_vocab and "d2t" not in names:
        raise ValueError(
            f"the EAGLE-3 head {name!r} drafts over {draft_vocab} of the target's "
            f"{head_vocab} tokens but ships no d2t tensor mapping its ids to the target's"
        )
    own_embedding = "embed_tokens.weight" in names
    if not own_embedding and int(hf_config.hidden_size) != target_hidden:
        raise ValueError(
            f"the EAGLE-3 head {name!r} has hidden size {hf_config.hidden_size}, not the "
            f"target's {target_hidden}, and no embed_tokens.weight of its own"
        )
    check_quantization(hf_config)
    layer_ids = aux_layer_ids(hf_config, target)
    try:
        target.set_aux_hidden_state_layers(layer_ids)
    except ValueError as error:
        raise ValueError(
            f"the EAGLE-3 head {name!r} cannot run over this target: {error}"
        ) from None
    hf_config.eagle_aux_hidden_state_layer_ids = list(layer_ids)  # sizes the head's fc
    head_cls = get_registries().models.get(HEAD_ARCHITECTURE)
    build_ctx = ModelBuildContext(
        attention_backend=attention_backend_cls, dtype=dtype, max_model_len=config.max_model_len
    )
    with _default_dtype(dtype), torch.device(device):
        head = head_cls(hf_config, build_ctx, target, own_embedding=own_embedding)
    head.eval()
    loaded = head.load_weights(iterate_head_tensors(path))
    missing = sorted(n for n, _ in head.named_parameters() if n not in loaded)
    if missing:
        raise ValueError(f"the EAGLE-3 head {name!r} lacks tensors for {missing}")
    logger.info(
        "EAGLE-3 head %s loaded: reads target layers %s, drafts over %d of %d tokens, %s "
        "embedding, %d drafts per step",
        name,
        list(layer_ids),
        draft_vocab,
        head_vocab,
        "its own" if own_embedding else "the target's",
        spec.num_speculative_tokens,
    )
    return head


class Eagle3Proposer(EagleProposer):
    """An EAGLE-3 head, its KV cache and each step's drafts (see the module docstring): an
    :class:`EagleProposer` whose head's first forward of a step reads ``fc`` over the
    target's kept layers' hidden states instead of the final ones."""

    def _profile_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The head's forward over the profile's tokens with zero auxiliary states (the
        target's profile forward kept some: dropped first)."""
        head: Any = self.model  # an Eagle3LlamaHead (llama_eagle3.py)
        head.target.take_aux_hidden_states()
        dtype = next(head.parameters()).dtype
        width = len(head.aux_layer_ids) * head.target_hidden_size
        aux = torch.zeros(len(input_ids), width, dtype=dtype, device=self.device)
        return head(input_ids, positions, ctx, head.fc(aux))

    def greedy_drafts(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's argmax over its draft vocabulary mapped to target ids
        (``Eagle3LlamaHead.greedy_draft_ids``): no ``[n, target vocab]`` float32 logits per
        draft step; equal to :meth:`DraftModelProposer.greedy_drafts`, the reference."""
        head: Any = self.model  # an Eagle3LlamaHead (llama_eagle3.py)
        return head.greedy_draft_ids(hidden)

    def _step_hidden(
        self, target_hidden: torch.Tensor
    ) -> Callable[[torch.Tensor | None], torch.Tensor]:
        """``fc(cat(aux states))`` of the step's token rows, from the states the target kept
        in this step's forward (taken here, so none outlive the step)."""
        head: Any = self.model  # an Eagle3LlamaHead (llama_eagle3.py)
        aux = head.target.take_aux_hidden_states()
        if len(aux) != len(head.aux_layer_ids):
            raise RuntimeError(
                f"the target kept {len(aux)} layers' hidden states in its last forward, the "
                f"EAGLE-3 head reads {len(head.aux_layer_ids)}"
            )

        def rows(index: torch.Tensor | None) -> torch.Tensor:
            picked = aux if index is None else [a.index_select(0, index) for a in aux]
            return head.combine_hidden_states(picked)

        return rows
