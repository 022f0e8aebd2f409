"""The model runner's prompts given as input embeddings (:mod:`chassis.core.prompt_embeds`).

A request that came with ``prompt_embeds`` keeps its rows here, on the device, from the step
that brings it to the runner until the step that computes the last of them (or until it
finishes or is preempted: it then comes back as new, rows and all, and its prompt is
computed again from them), so decode steps skip all this. A step that schedules any of its
prompt positions (a chunked prefill schedules a slice) runs on ``embed_input_ids(ids)`` with
those positions' rows replaced by the given ones (as the model's forward reads them:
``prompt_embeds_to_inputs``, Granite's scale); positions past the prompt (generated
tokens) keep the model's own embeddings. Nothing here runs for requests given as tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from chassis.core.model_interface import CausalLM
    from chassis.core.multimodal import MultiModalTensor


def prompt_embeds_refusal(model: CausalLM) -> str | None:
    """Why ``model`` cannot run prompts given as embeddings (``None`` when it can): it needs
    :meth:`~chassis.core.model_interface.CausalLM.embed_input_ids` and a forward taking
    ``inputs_embeds``, and its class must not declare a reason of its own
    (:attr:`~chassis.core.model_interface.CausalLM.prompt_embeds_refusal`)."""
    from chassis.core.model_interface import CausalLM

    name = type(model).__name__
    if type(model).embed_input_ids is CausalLM.embed_input_ids:
        return f"{name} does not implement embed_input_ids"
    if "inputs_embeds" not in inspect.signature(model.forward).parameters:
        return f"{name}'s forward takes no inputs_embeds"
    if model.prompt_embeds_refusal is not None:
        return f"{name}: {model.prompt_embeds_refusal}"
    return None


class PromptEmbedsRunner:
    """The prompt-embeddings side of a :class:`~chassis.core.model_runner.ModelRunner` (see
    the module docstring). ``model`` is the runner's model, ``device`` its device; a model
    that cannot take embeddings (:func:`prompt_embeds_refusal`) is a ``ValueError``."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        refusal = prompt_embeds_refusal(model)
        if refusal is not None:
            raise ValueError(
                f"--enable-prompt-embeds: {refusal}, so it cannot run prompts given as "
                "embeddings; start without the flag"
            )
        self.model = model
        self.device = device
        #: request id -> its prompt's rows ``[prompt_len, hidden]`` on the device, until the
        #: step that computes the last of them
        self._embeds: dict[str, torch.Tensor] = {}

    def __bool__(self) -> bool:
        """Whether any request in the runner has prompt rows still to compute."""
        return bool(self._embeds)

    def add(self, request_id: str, embeds: MultiModalTensor | None) -> None:
        """A request (new, or back after preemption: its rows are kept again from what the
        scheduler sent); nothing is kept for one given as tokens."""
        self._embeds.pop(request_id, None)
        if embeds is not None:
            self._embeds[request_id] = embeds.to_tensor().to(self.device)

    def remove(self, request_id: str) -> None:
        """The request finished or was preempted: drop its rows."""
        self._embeds.pop(request_id, None)

    def apply(
        self,
        request_ids: Sequence[str],
        starts: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The step's ``[N, hidden]`` input embeddings with the scheduled prompt positions of
        requests given as embeddings replaced by their rows; ``inputs_embeds`` (the
        multimodal runner's, or ``None``) as it is when the step schedules none. Request
        ``request_ids[i]`` computes positions ``starts[i] .. starts[i] + num_scheduled[i] -
        1``, flat tokens from ``query_start_loc[i]``; ``input_ids`` are the step's ids on the
        device."""
        pieces: list[tuple[int, torch.Tensor]] = []
        for i, request_id in enumerate(request_ids):
            rows = self._embeds.get(request_id)
            if rows is None:
                continue
            start = int(starts[i])
            end = min(start + int(num_scheduled[i]), rows.shape[0])
            if start < end:
                pieces.append((int(query_start_loc[i]), rows[start:end]))
            if end == rows.shape[0]:
                # the last rows are in this step: later steps decode on the model's own
                # embeddings, so they skip all this (a preempted request comes back with
                # its rows: add)
                del self._embeds[request_id]
        if not pieces:
            return inputs_embeds
        embeds = self.model.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        for target, piece in pieces:
            # (only the hidden-size columns: Qwen3-VL's rows carry zero deepstack columns
            # after them, which a text position keeps)
            rows = self.model.prompt_embeds_to_inputs(piece.to(embeds.dtype))
            embeds[target : target + len(piece), : piece.shape[1]] = rows
        return embeds
