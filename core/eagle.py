"""EAGLE-1 speculative decoding (``--speculative-config`` method ``eagle``, e.g.
``{"method": "eagle", "model": "path/to/eagle-head", "num_speculative_tokens": 4}``).

An EAGLE head (``builtin_plugins/models/llama_eagle.py``) is a draft model of one or a few
decoder layers that reads the target's own last hidden states instead of starting from the
tokens alone. The proposer is a :class:`~chassis.core.draft_model.DraftModelProposer` with
another forward; the rest is shared: the head's KV cache uses the target's block ids
(a block costs the head's layers too), drafts are the head's argmax or, for unseeded random
requests, draws from its ``q`` verified by rejection sampling, and the scheduler plans and
verifies them as a draft model's.

- **Inputs.** The head at position ``p`` reads the token at ``p + 1`` and the target's hidden
  state at ``p`` (after the target's final norm). After each step the runner hands the
  step's hidden states to :meth:`EagleProposer.propose`, which runs the head over exactly
  the positions the step computed and kept, ``starts .. num_computed_tokens - 1``: the token
  after the last of them is known (the step's newest token, or the next prompt token of a
  chunked prefill). So the head's K/V are valid wherever the target's are, as for a draft
  model; the head's output at the last kept position of a request that sampled gives draft 1.
- **Drafts.** Draft ``j`` then goes in at position ``q - 1 + j`` (``q``: the newest token's
  position) with the head's own previous output as the hidden state, for draft ``j + 1``:
  the head writes K/V at ``q - 1 .. q + k - 2``, inside the slots the scheduler reserves.
- **Cost when off.** The runner only passes the hidden states it already holds; nothing
  is copied or kept unless EAGLE is on.

Limits: EAGLE-1 Llama-style heads here (EAGLE-3 heads, which read several target layers:
:mod:`chassis.core.eagle3`, method ``eagle3``; one given as method ``eagle`` is named); the
head's hidden size must be the target's; the head reads the target's
embedding table unscaled (a Gemma target scales it in its own forward only); a prefix-cache
hit reuses the head's K/V at a cached block's last position, computed with the token that
followed it in the request that wrote it (only the acceptance rate can change, never the
output).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from chassis.core.draft_model import DraftModelProposer

if TYPE_CHECKING:
    from chassis.core.attention import AttentionBackend, ForwardContext
    from chassis.core.config import EngineConfig
    from chassis.core.input_batch import InputBatch
    from chassis.core.model_interface import CausalLM

logger = logging.getLogger(__name__)

#: the registered architecture of EAGLE-1 Llama-style heads (vLLM's name)
HEAD_ARCHITECTURE = "EagleLlamaForCausalLM"


def load_eagle_head(
    config: EngineConfig,
    target: CausalLM,
    attention_backend_cls: type[AttentionBackend],
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Build and fill the EAGLE-1 head of ``config.speculative`` (method ``eagle``) over
    ``target`` on ``device`` in ``dtype``.

    ``ValueError`` when the head's hidden size or vocabulary differs from the target's, when
    its checkpoint holds tensors an EAGLE-1 Llama head has not (an EAGLE-3 head, a whole
    model), leaves a parameter unfilled, or cannot be read.
    """
    from chassis.core.head_checkpoint import (
        head_tensor_names,
        is_speculators_config,
        iterate_head_tensors,
    )
    from chassis.core.model_interface import ModelBuildContext
    from chassis.core.model_loader import _default_dtype, load_hf_config, resolve_model_path
    from chassis.core.quantized_weights import check_quantization
    from chassis.plugins.registries import get_registries

    spec = config.speculative
    if spec is None or spec.method != "eagle" or spec.model is None:
        raise ValueError("load_eagle_head needs --speculative-config method 'eagle'")
    path = resolve_model_path(spec.model)
    if is_speculators_config(path):
        raise ValueError(
            f"the EAGLE head {spec.model!r} has a speculators-layout config.json: that layout "
            "is read for EAGLE-3 heads only (pass method 'eagle3' for one)"
        )
    hf_config = load_hf_config(path)
    target_config = target.hf_config
    head_hidden = int(hf_config.hidden_size)
    target_hidden = int(getattr(target_config, "hidden_size", -1))
    if head_hidden != target_hidden:
        raise ValueError(
            f"the EAGLE head {spec.model!r} has hidden size {head_hidden} and the target "
            f"{target_hidden}: an EAGLE head reads the target's hidden states, so it must be "
            "trained for this target (pick the head made for it)"
        )
    head_vocab, target_vocab = int(hf_config.vocab_size), int(target_config.vocab_size)
    if head_vocab != target_vocab:
        raise ValueError(
            f"the EAGLE head {spec.model!r} has a vocabulary of {head_vocab} tokens and the "
            f"target {target_vocab}: it must share the target's vocabulary"
        )
    check_quantization(hf_config)
    names = head_tensor_names(path)  # safetensors or pytorch_model.bin
    if "d2t" in names or any(n.startswith("midlayer.") for n in names):
        raise ValueError(
            f"the EAGLE head {spec.model!r} is an EAGLE-3 head (it has midlayer.* or d2t "
            "tensors): pass --speculative-config method 'eagle3'"
        )
    if "fc.weight" not in names:
        raise ValueError(
            f"the EAGLE head {spec.model!r} has no fc.weight: it is not an EAGLE-1 head "
            "(method 'eagle' takes a head of fc + decoder layers)"
        )
    own_embedding, own_lm_head = "embed_tokens.weight" in names, "lm_head.weight" in names
    head_cls = get_registries().models.get(HEAD_ARCHITECTURE)
    build_ctx = ModelBuildContext(
        attention_backend=attention_backend_cls, dtype=dtype, max_model_len=config.max_model_len
    )
    with _default_dtype(dtype), torch.device(device):
        head = head_cls(
            hf_config,
            build_ctx,
            target,
            own_embedding=own_embedding,
            own_lm_head=own_lm_head,
        )
    head.eval()
    loaded = head.load_weights(iterate_head_tensors(path))
    missing = sorted(name for name, _ in head.named_parameters() if name not in loaded)
    if missing:
        raise ValueError(f"the EAGLE head {spec.model!r} lacks tensors for {missing}")
    logger.info(
        "EAGLE head %s loaded: %d layers, %s embedding, %s LM head, %d drafts per step",
        spec.model,
        head.num_attention_layers,
        "its own" if own_embedding else "the target's",
        "its own" if own_lm_head else "the target's",
        spec.num_speculative_tokens,
    )
    return head


class EagleProposer(DraftModelProposer):
    """An EAGLE-1 head, its KV cache and each step's drafts (see the module docstring).

    :meth:`propose` reads the target's hidden states of the step as well; everything else
    (KV cache, sampler, verification by rejection sampling) is the draft model's.
    """

    def __init__(self, config: EngineConfig, model: CausalLM, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model, *args, **kwargs)
        self.hidden_size = int(model.hf_config.hidden_size)

    def _profile_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """The head's forward over the profile's tokens with zero target hidden states."""
        dtype = next(self.model.parameters()).dtype
        target_hidden = torch.zeros(
            len(input_ids), self.hidden_size, dtype=dtype, device=self.device
        )
        return self.model(input_ids, positions, ctx, self._step_hidden(target_hidden)(None))

    def _step_hidden(
        self, target_hidden: torch.Tensor
    ) -> Callable[[torch.Tensor | None], torch.Tensor]:
        """What the head's first forward of a step reads, from the step's final hidden
        states ``target_hidden``: a function of the step's token rows to read (``None``:
        all) giving ``[rows, hidden]``. An EAGLE-1 head reads the rows themselves; called
        once per step, before anything else (:class:`~chassis.core.eagle3.Eagle3Proposer`
        collects the target's other layers here)."""

        def rows(index: torch.Tensor | None) -> torch.Tensor:
            return target_hidden if index is None else target_hidden.index_select(0, index)

        return rows

    @torch.inference_mode()
    def propose(
        self,
        batch: InputBatch,
        rows: np.ndarray,
        starts: np.ndarray,
        sampled: np.ndarray,
        target_hidden: torch.Tensor | None = None,
        query_start_loc: np.ndarray | None = None,
    ) -> dict[str, list[int]]:
        """Run the head over the step just executed and propose the next step's drafts.

        As :meth:`DraftModelProposer.propose`; ``target_hidden`` and ``query_start_loc``
        are required."""
        if target_hidden is None or query_start_loc is None:
            raise ValueError("an EAGLE head proposes from the step's target hidden states")
        step_hidden = self._step_hidden(target_hidden)
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        room = self._room(batch, rows, computed, sampled)
        self._drop_stale_probs(batch)
        for r in rows[sampled]:  # their last drafts are verified: proposed anew below
            self._draft_probs.pop(batch.request_ids[r], None)
        # The positions the step computed and kept; the head reads the token after each.
        query_lens = computed - starts
        ran = query_lens > 0
        if not ran.any():
            return {}
        rows_r, starts_r, lens_r = rows[ran], starts[ran], query_lens[ran]
        positions, token_rows, ctx = self._step_context(batch, rows_r, starts_r, lens_r)
        first = np.asarray(query_start_loc[:-1], dtype=np.int64)[ran]
        flat = np.repeat(first - starts_r, lens_r) + positions  # their rows in target_hidden
        hidden = self.model(
            self._to_device(batch.token_ids[token_rows, positions + 1]),
            self._to_device(positions),
            ctx,
            step_hidden(self._to_device(flat)),
        )
        drafting = (room > 0)[ran]
        if not drafting.any():
            return {}
        index = np.nonzero(drafting)[0]  # the drafting requests, by position in rows_r
        newest_position = computed[ran][index] - 1  # where draft 1's input goes, minus 1

        def forward(
            j: int, alive: np.ndarray, keep: np.ndarray, tokens: np.ndarray, last: torch.Tensor
        ) -> torch.Tensor:
            previous = last[self._to_device(np.nonzero(keep)[0])]  # the head's own output
            ones = np.ones(len(alive), dtype=np.int64)
            positions_j, _, ctx_j = self._step_context(
                batch, rows_r[index[alive]], newest_position[alive] + j, ones
            )
            return self.model(
                self._to_device(tokens), self._to_device(positions_j), ctx_j, previous
            )

        return self._draft_rounds(
            [batch.states[r] for r in rows_r[index]],
            room[ran][index],
            hidden[self._to_device(np.cumsum(lens_r)[index] - 1)],
            forward,
        )
