"""Which tokens an automaton state allows, for the whole vocabulary at once.

A token is allowed in a state when walking its bytes from that state never reaches
:data:`~chassis.builtin_plugins.structured_output.automaton.DEAD` (every other state can
still complete the output). :func:`allowed_tokens` walks every token in lockstep, one byte
position at a time, with numpy gathers on the DFA's transition table; rows that are still
unknown are filled for the states that occur, then the gather is repeated. Tokens are kept
sorted by length, longest first, so the tokens still walking at position ``j`` are always a
prefix of that order and each byte column stores only the tokens that long (no padding).

EOS ids are allowed exactly in accepting states; ``None`` and empty tokens never are.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from chassis.builtin_plugins.structured_output.automaton import DEAD, Automaton
from chassis.core.structured_output import TokenVocabulary

__all__ = ["TokenMasks", "TokenTable", "allowed_tokens"]


class TokenTable:
    """The vocabulary's tokens as byte columns, ready for :func:`allowed_tokens`.

    - ``ids``: the token ids with at least one byte (EOS ids excluded: they are handled by
      the accepting rule), longest token first;
    - ``columns[j]``: ``uint8`` byte ``j`` of the first ``counts[j]`` tokens of ``ids``
      (those longer than ``j``); ``counts`` has one extra trailing ``0``;
    - ``eos_ids``: the EOS ids below ``vocab_size``.
    """

    def __init__(self, vocabulary: TokenVocabulary) -> None:
        self.vocab_size = vocabulary.vocab_size
        eos = vocabulary.eos_token_ids
        self.eos_ids = np.array(sorted(i for i in eos if 0 <= i < self.vocab_size), np.int64)
        pairs = [
            (token, i)
            for i, token in enumerate(vocabulary.token_bytes)
            if token and i not in eos  # None and b"" are never allowed
        ]
        pairs.sort(key=lambda pair: -len(pair[0]))  # stable: equal lengths keep id order
        self.ids = np.array([i for _, i in pairs], dtype=np.int64)
        lengths = np.array([len(token) for token, _ in pairs], dtype=np.int64)
        flat = np.frombuffer(b"".join(token for token, _ in pairs), dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(pairs) else lengths
        max_len = int(lengths[0]) if len(pairs) else 0
        # lengths descend, so the tokens longer than j are the first counts[j]
        self.counts = [int(np.count_nonzero(lengths > j)) for j in range(max_len)] + [0]
        self.columns = [flat[starts[: self.counts[j]] + j] for j in range(max_len)]

    @property
    def max_len(self) -> int:
        return len(self.columns)


def allowed_tokens(automaton: Automaton, tokens: TokenTable, state: int) -> np.ndarray:
    """A new ``bool [vocab_size]`` array: the tokens that may follow in ``state``."""
    mask = np.zeros(tokens.vocab_size, dtype=bool)
    if state == DEAD:
        return mask
    if automaton.is_accepting(state):
        mask[tokens.eos_ids] = True
    if not tokens.max_len:
        return mask
    ok = np.zeros(len(tokens.ids), dtype=bool)  # per token, in the table's order
    cur = automaton.row(state)[tokens.columns[0]]
    pos = np.arange(len(cur))  # which tokens are still walking (ascending)
    for j in range(tokens.max_len):
        # the tokens of length j + 1 end here: a suffix of pos, as lengths descend
        k = int(np.searchsorted(pos, tokens.counts[j + 1]))
        ok[pos[k:]] = cur[k:] != DEAD
        pos, cur = pos[:k], cur[:k]
        live = cur != DEAD
        if not live.all():
            pos, cur = pos[live], cur[live]
        if not len(pos):
            break
        index = (cur.astype(np.int64) << 8) | tokens.columns[j + 1][pos]
        nxt = automaton.table.reshape(-1)[index]
        unknown = nxt < 0
        if unknown.any():
            automaton.fill_rows(cur[unknown])
            nxt = automaton.table.reshape(-1)[index]
        cur = nxt
    mask[tokens.ids] |= ok
    return mask


class TokenMasks:
    """:func:`allowed_tokens` of one automaton, cached per state (least recently used first
    out, at most ``max_bytes`` of masks). The arrays returned are shared and read-only."""

    def __init__(
        self, automaton: Automaton, tokens: TokenTable, *, max_bytes: int = 64 << 20
    ) -> None:
        self.automaton = automaton
        self.tokens = tokens
        self._max_entries = max(16, max_bytes // max(1, tokens.vocab_size))
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def allowed(self, state: int) -> np.ndarray:
        """The read-only ``bool [vocab_size]`` mask of ``state``."""
        mask = self._cache.get(state)
        if mask is not None:
            self._cache.move_to_end(state)
            return mask
        mask = allowed_tokens(self.automaton, self.tokens, state)
        mask.flags.writeable = False
        self._cache[state] = mask
        if len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return mask
