"""``no_repeat_ngram``: never repeat an n-gram of the request's prompt and output (HF's
``no_repeat_ngram_size``), as a custom logits processor.

A request opts in with ``extra_args={"no_repeat_ngram_size": n}`` (the API's
``vllm_xargs``). At each step the tokens that would complete an n-gram already present in
its prompt and output (the last ``n - 1`` tokens followed by them) are banned (``-inf``),
exactly as transformers' ``NoRepeatNGramLogitsProcessor`` bans them.

Each request keeps an index ``(n - 1)-gram -> tokens that followed it``, fed only the
tokens that are new since its previous step, so a step costs one dictionary lookup per row
(plus the n-grams that run into its draft tokens, under speculative decoding) and one
host-to-device copy of the banned positions for the whole batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chassis.builtin_plugins.samplers.logit_edits import apply_min_tokens
from chassis.core.logits_processor import BatchUpdate, LogitsProcessor, LogitsRows
from chassis.core.sampling_params import is_integer

if TYPE_CHECKING:
    from chassis.core.config import EngineConfig
    from chassis.core.sampling_params import SamplingParams

#: the ``extra_args`` key a request sets
ARG = "no_repeat_ngram_size"


def ngram_size(params: SamplingParams) -> int:
    """The request's ``no_repeat_ngram_size`` (0: off)."""
    return int((params.extra_args or {}).get(ARG) or 0)


class _RequestNgrams:
    """The n-grams of one request's tokens (prompt, then output), fed as they grow."""

    def __init__(self, n: int, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        self.n = n
        self.prompt = prompt_token_ids
        self.output = output_token_ids  # the runner's list: it grows
        self.tokens: list[int] = []
        #: (n - 1)-gram -> the tokens that followed it somewhere in ``tokens``
        self.next_of: dict[tuple[int, ...], set[int]] = {}

    def catch_up(self) -> None:
        """Index the tokens appended since the last call."""
        seen, num_prompt = len(self.tokens), len(self.prompt)
        new = self.prompt[seen:] + self.output[max(seen - num_prompt, 0) :]
        if not new:
            return
        tokens, n = self.tokens, self.n
        old = len(tokens)
        tokens.extend(new)
        for end in range(max(old, n - 1), len(tokens)):  # the n-gram ending at ``end``
            self.next_of.setdefault(tuple(tokens[end - n + 1 : end]), set()).add(tokens[end])

    def banned(self, drafts: list[int]) -> set[int]:
        """The tokens that would repeat an n-gram after ``tokens + drafts``."""
        n, tokens = self.n, self.tokens
        if not drafts:
            if len(tokens) < n - 1:
                return set()
            return self.next_of.get(tuple(tokens[len(tokens) - n + 1 :]), set())
        full = tokens + drafts
        if len(full) < n - 1:
            return set()
        prefix = tuple(full[len(full) - n + 1 :])
        banned = set(self.next_of.get(prefix, ()))
        # n-grams that end on a draft are not in the index (drafts may be rejected)
        for end in range(max(len(tokens), n - 1), len(full)):
            if tuple(full[end - n + 1 : end]) == prefix:
                banned.add(full[end])
        return banned


class NoRepeatNGramLogitsProcessor(LogitsProcessor):
    """Bans the tokens that would repeat an n-gram of the request's prompt and output.

    Not argmax-invariant (it changes greedy choices); verifies speculative drafts (a row after
    drafts sees them as tokens); reads the generated tokens (under async scheduling a step
    with such a request waits for the previous step's tokens).
    """

    supports_drafts = True
    reads_output_tokens = True

    def __init__(self, config: EngineConfig, device: torch.device, pin_memory: bool) -> None:
        super().__init__(config, device, pin_memory)
        #: batch row -> its request's n-grams (only requests that set the argument)
        self._requests: dict[int, _RequestNgrams] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        value = (params.extra_args or {}).get(ARG)
        if value is not None and (not is_integer(value) or value < 0):
            raise ValueError(
                f"invalid sampling parameter extra_args: {ARG!r} (vllm_xargs in the API) must "
                f"be an integer >= 1 (0 = off), got {value!r}"
            )

    @classmethod
    def acts_on(cls, params: SamplingParams) -> bool:
        return ngram_size(params) > 0

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        requests = self._requests
        for row in update.removed:
            requests.pop(row, None)
        for move in update.moved:
            state = requests.pop(move.src, None)
            if state is None:
                requests.pop(move.dst, None)
            else:
                requests[move.dst] = state
        for added in update.added:
            n = ngram_size(added.params)
            if n > 0:
                requests[added.row] = _RequestNgrams(
                    n, added.prompt_token_ids, added.output_token_ids
                )
            else:
                requests.pop(added.row, None)

    def apply(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        if not self._requests:
            return logits
        vocab_size = logits.shape[-1]
        banned: list[set[int] | None] = [None] * rows.num_rows
        for i, batch_row in enumerate(rows.batch_rows.tolist()):
            state = self._requests.get(batch_row)
            if state is None:
                continue
            state.catch_up()
            banned[i] = {t for t in state.banned(rows.draft_prefix(i)) if t < vocab_size}
        # the sampler's blocking of min_tokens and bad words: one fill on the device
        return apply_min_tokens(logits, banned)
