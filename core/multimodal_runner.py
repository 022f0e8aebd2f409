"""The model runner's multimodal inputs: encoder outputs and M-RoPE positions per request.

A request with images (:class:`~chassis.core.multimodal.MultiModalFeature`, one per image)
is kept here from the step that brings it to the runner until it finishes or is preempted
(then it comes back as new, features and all). Each step, for the scheduled tokens of such
requests:

* **inputs_embeds**: a step that schedules any placeholder token of an image needs the
  image's encoder output (``model.embed_multimodal``). It is computed whole, once per request
  and image, in the first step that schedules any of its tokens (a chunked prefill may cut
  an image's tokens across steps; a prefix-cache hit may skip some or all of them), and kept
  in a small cache until the request's computed tokens pass the image's end. The step's
  input embeddings are ``model.embed_input_ids(input_ids)`` with the scheduled placeholder
  rows replaced by the matching encoder rows.
* **rotary positions** (a :attr:`~chassis.core.model_interface.CausalLM.uses_mrope` model):
  the model's ``mrope_positions(prompt, features)``, computed once on the host when the
  request arrives, give the rotary position of each prompt token (three components); a
  token at sequence index ``p`` past the prompt turns by ``p + delta``. The sequence index
  itself still places the token's K/V (slot mapping) and bounds its attention.

Nothing here runs for text: the runner asks only when some request in it has features
(:meth:`MultiModalRunner.__bool__`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from chassis.core.multimodal_embeds import embeds_key
from chassis.core.placeholder_runs import PLACEHOLDER_IDS_KEY

if TYPE_CHECKING:
    from chassis.core.model_interface import CausalLM
    from chassis.core.multimodal import MultiModalFeature


@dataclass
class _RequestInputs:
    """What the runner keeps for one request with features."""

    features: list[MultiModalFeature]
    prompt_len: int
    #: ``[3, prompt_len]`` int64 rotary positions of the prompt; None: not an M-RoPE model
    mrope_positions: np.ndarray | None
    #: the rotary position of sequence index ``p >= prompt_len`` is ``p + mrope_delta``
    mrope_delta: int
    #: feature index -> its encoder output ``[length, hidden]`` on the device
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)


class MultiModalRunner:
    """The multimodal side of a :class:`~chassis.core.model_runner.ModelRunner` (see the
    module docstring). ``model`` is the runner's model, ``device`` its device."""

    def __init__(self, model: CausalLM, device: torch.device) -> None:
        self.model = model
        self.device = device
        self._requests: dict[str, _RequestInputs] = {}
        #: encoder forwards run so far (tests read it: each image once per request)
        self.num_encoder_runs = 0

    def __bool__(self) -> bool:
        """Whether any request in the runner has features (else a step asks nothing)."""
        return bool(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_cached_outputs(self) -> int:
        """Encoder outputs held now, over all requests."""
        return sum(len(state.encoded) for state in self._requests.values())

    # -- requests -------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        features: Sequence[MultiModalFeature],
    ) -> None:
        """A request (new, or back after preemption: anything kept of it before is dropped);
        nothing is kept for one without features."""
        self._requests.pop(request_id, None)
        if not features:
            return
        supported = self.model.supported_modalities
        for feature in features:
            if feature.modality not in supported:
                raise ValueError(
                    f"request {request_id!r} has {feature.modality} input, which "
                    f"{type(self.model).__name__} does not take (it takes: "
                    f"{', '.join(sorted(supported)) or 'text only'})"
                )
        mrope, delta = None, 0
        if self.model.uses_mrope:
            table, delta = self.model.mrope_positions(prompt_token_ids, features)
            mrope = np.ascontiguousarray(table, dtype=np.int64)
            if mrope.shape != (3, len(prompt_token_ids)):
                raise ValueError(
                    f"{type(self.model).__name__}.mrope_positions returned shape "
                    f"{mrope.shape}; expected (3, {len(prompt_token_ids)})"
                )
        self._requests[request_id] = _RequestInputs(
            features=list(features),
            prompt_len=len(prompt_token_ids),
            mrope_positions=mrope,
            mrope_delta=int(delta),
        )

    def remove(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept of it."""
        self._requests.pop(request_id, None)

    # -- one step -------------------------------------------------------------------------

    def rotary_positions(
        self, request_ids: Sequence[str], query_start_loc: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """The step's rotary positions from its sequence positions (``[N]`` int64; request
        ``request_ids[i]``'s tokens are ``query_start_loc[i] .. query_start_loc[i + 1]``):
        ``positions`` itself when nothing changes (no M-RoPE, or no request with features
        scheduled), ``[N]`` when every token's three components are equal, else ``[3, N]``."""
        rows = [
            (i, state)
            for i, request_id in enumerate(request_ids)
            if (state := self._requests.get(request_id)) is not None
            and state.mrope_positions is not None
        ]
        if not rows:
            return positions
        rotary = np.broadcast_to(positions, (3, len(positions))).copy()
        for i, state in rows:
            assert state.mrope_positions is not None  # (rows keeps only these)
            lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
            seq = positions[lo:hi]
            in_prompt = seq < state.prompt_len
            rotary[:, lo:hi] = seq + state.mrope_delta  # past the prompt: p + delta
            if in_prompt.any():
                rotary[:, lo:hi][:, in_prompt] = state.mrope_positions[:, seq[in_prompt]]
        if (rotary[0] == rotary[1]).all() and (rotary[0] == rotary[2]).all():
            return rotary[0].copy()
        return rotary

    def attend_limits(
        self, request_ids: Sequence[str], query_start_loc: np.ndarray, positions: np.ndarray
    ) -> np.ndarray | None:
        """For a model with ``bidirectional_image_blocks``: the step's
        ``AttentionMetadata.attend_limit`` (``[N]`` int32: each token's sequence position,
        or for a token inside an item's placeholder range the range's last position), or
        ``None`` when no scheduled token is inside one (plain causal). Arguments as
        :meth:`rotary_positions`."""
        limits: np.ndarray | None = None
        for i, request_id in enumerate(request_ids):
            state = self._requests.get(request_id)
            if state is None:
                continue
            lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
            seq = positions[lo:hi]
            for feature in state.features:
                inside = (seq >= feature.offset) & (seq < feature.end)
                if not inside.any():
                    continue
                if limits is None:
                    limits = positions.astype(np.int32)
                limits[lo:hi][inside] = feature.end - 1
        return limits

    def inputs_embeds(
        self,
        request_ids: Sequence[str],
        starts: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        input_ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """The step's ``[N, hidden]`` input embeddings when it schedules any placeholder
        token of an image, else ``None`` (the model embeds the ids itself). Request
        ``request_ids[i]`` computes sequence positions ``starts[i] ..`` ``starts[i] +
        num_scheduled[i] - 1``, flat tokens from ``query_start_loc[i]``; ``input_ids`` are
        the step's ids on the device. Encodes the images whose tokens are scheduled and not
        encoded yet. Not for an encoder-decoder model, whose items feed its encoder
        (:meth:`encoder_inputs`)."""
        targets: list[int] = []  # first flat row of each piece
        pieces: list[torch.Tensor] = []
        for i, request_id in enumerate(request_ids):
            state = self._requests.get(request_id)
            if state is None:
                continue
            start = int(starts[i])
            end = start + int(num_scheduled[i])
            for index, feature in enumerate(state.features):
                lo, hi = max(start, feature.offset), min(end, feature.end)
                if lo >= hi:
                    continue
                encoded = state.encoded.get(index)
                if encoded is None:
                    encoded = state.encoded[index] = self._encode(feature)
                targets.append(int(query_start_loc[i]) + lo - start)
                pieces.append(encoded[lo - feature.offset : hi - feature.offset])
        if not pieces:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        for target, piece in zip(targets, pieces, strict=True):
            embeds[target : target + len(piece)] = piece.to(embeds.dtype)
        return embeds

    def encoder_inputs(
        self, request_ids: Sequence[str], starts: np.ndarray
    ) -> list[dict[str, torch.Tensor] | None] | None:
        """For an encoder-decoder model (``CausalLM.is_encoder_decoder``): per request of the
        step, its first item's tensors on the device when the step computes its first
        decoder tokens (``starts[i] == 0``), else ``None``; ``None`` when no request needs
        its encoder this step."""
        found = False
        inputs: list[dict[str, torch.Tensor] | None] = []
        for request_id, start in zip(request_ids, starts, strict=True):
            state = self._requests.get(request_id)
            if state is None or int(start) != 0:
                inputs.append(None)
                continue
            inputs.append({n: t.to(self.device) for n, t in state.features[0].tensors().items()})
            self.num_encoder_runs += 1
            found = True
        return inputs if found else None

    def finish_step(self, request_ids: Sequence[str], num_computed_tokens: np.ndarray) -> None:
        """After a step: drop the encoder outputs of images whose every placeholder token is
        now computed (``num_computed_tokens[i]`` of request ``request_ids[i]``)."""
        for request_id, computed in zip(request_ids, num_computed_tokens, strict=True):
            state = self._requests.get(request_id)
            if state is None or not state.encoded:
                continue
            for index in [j for j in state.encoded if state.features[j].end <= computed]:
                del state.encoded[index]

    def _encode(self, feature: MultiModalFeature) -> torch.Tensor:
        """``feature``'s encoder output ``[length, hidden]``, checked against its length:
        the rows the caller gave (image or audio embeddings,
        :mod:`chassis.core.multimodal_embeds`; the front-end checked their width) through the
        model's ``prompt_embeds_to_inputs``, else the
        model's ``embed_multimodal`` (which splices given rows into their item's token run
        when the processor wrote one)."""
        inputs = {name: t.to(self.device) for name, t in feature.tensors().items()}
        given = embeds_key(feature.modality)
        if given in inputs and PLACEHOLDER_IDS_KEY not in inputs:
            # given rows are HF's (the projector's output): scaled as the decoder scales the
            # inputs_embeds it is given (Granite's multiplier; the others keep them)
            encoded = self.model.prompt_embeds_to_inputs(inputs[given])
        else:
            # (rows with a token run: the model splices them into the run, tower skipped)
            encoded = self.model.embed_multimodal(feature.modality, inputs)
            self.num_encoder_runs += given not in inputs
        if encoded.dim() != 2 or encoded.shape[0] != feature.length:
            raise ValueError(
                f"{type(self.model).__name__}.embed_multimodal returned shape "
                f"{tuple(encoded.shape)} for a {feature.modality} of {feature.length} "
                "placeholder tokens (one row per placeholder token expected)"
            )
        return encoded
