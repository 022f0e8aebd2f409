"""Speculative decoding (vLLM's ``--speculative-config``): methods ``ngram``, ``draft_model``,
``eagle``, ``eagle3`` and ``mtp``.

A decoding request often repeats text it has seen: code being edited, a quoted document, a
list whose items share a pattern. Prompt lookup guesses the next tokens by finding the
request's last ``n`` tokens earlier in its prompt and output and proposing what followed
them there. One forward pass then computes the request's next token *and* the logits after
each proposed one; the proposals are kept as long as they equal what the model would have
written itself, plus one more token the model writes after them. The output is exactly what
plain decoding gives; a step just makes between 1 and ``num_speculative_tokens + 1`` tokens.

It pays where a step's cost barely grows with its token count: a decode step reads every
weight once whatever the rows, so on the CPU a forward over 8 tokens per request costs about
what one over 1 does (``chassis bench kernels``: the linear layers' time at 8 rows equals
their time at 1).

Verification samples a token after every position, as the request would sample there, and
keeps a draft only when the sampled token *is* the draft. Each token of the output is then
drawn from the model's distribution given the tokens actually output before it, so greedy
requests get exactly the plain output and random ones an output with exactly the plain
distribution. For n-gram drafts this *is* rejection sampling: the draft distribution q is
one-hot on the draft x, so rejection sampling accepts x with probability
min(1, p(x) / q(x)) = p(x) and otherwise draws from max(p - q, 0) normalized, which is p
without x: exactly "sample y from p, keep x if y == x, else output y". It accepts as many
drafts and needs no probabilities from the sampler, so any sampler plugin works (a draft
model's sampled drafts, with a q that is not one-hot, need them: see below). A request
with its own ``seed`` samples its verify rows from its own stream, one draw per row, and the
runner then rewinds the stream to one draw per token kept (:mod:`chassis.core.seeded_drafts`):
it gets exactly the tokens plain decoding gives it. Requests whose choice at a position
depends on more than that position's logits and the random stream get no drafts and decode
as usual in the same steps: logprobs, penalties, bias, ``min_tokens`` still blocking,
allowed ids, bad words, structured outputs. See docs/scheduling.md.

The scheduler proposes with an :class:`NgramIndex` per request, whose cost per step does
not grow with the context; :func:`propose_ngram` is the plain reference it equals.

With ``method: "draft_model"`` (``"model": PATH``) a small model sharing the target's
vocabulary proposes instead (:mod:`chassis.core.draft_model`): after each step the runner
lets it write ``num_speculative_tokens`` tokens per request, and the scheduler plans them as
the next step's drafts. For greedy requests they are its argmax, a one-hot q, so the same
exact-match verification keeps the output exact. For random requests without their own seed they are drawn from
the draft's own distribution q (``draft_sampling: "probabilistic"``, the default, when the
sampler provides probabilities), and the runner verifies them by rejection sampling against
the target's p (:mod:`chassis.core.rejection_sampling`), which accepts a draft the target
agrees with far more often. Either way a draft source only changes how many drafts are
accepted, never which tokens come out or with what probability.

With ``method: "eagle"`` (``"model": PATH`` of an EAGLE-1 head) the proposer is a head of one
or a few decoder layers that reads the target's own last hidden states
(:mod:`chassis.core.eagle`); it plans, drafts and verifies as a draft model does. With
``method: "eagle3"`` the head is an EAGLE-3 one, which reads several target layers' hidden
states and drafts over a vocabulary of its own (:mod:`chassis.core.eagle3`). With
``method: "mtp"`` (no ``"model"``) the head is the multi-token-prediction layer DeepSeek-V3
and GLM-4.5 checkpoints ship past their decoder layers (:mod:`chassis.core.mtp`), run as an
EAGLE-1 head; vLLM's older names ``deepseek_mtp`` and ``glm4_moe_mtp`` are read as ``mtp``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chassis.core.sampling_params import SamplingParams

#: the methods this engine implements
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
#: vLLM's older names of a method -> the method
METHOD_ALIASES = {"deepseek_mtp": "mtp", "glm4_moe_mtp": "mtp"}
#: methods that run a model in the runner to propose drafts (all but ``mtp`` need
#: ``"model"``; ``mtp`` reads the target's own checkpoint)
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
#: methods whose drafts come from an EAGLE head reading the target's hidden states
EAGLE_METHODS = ("eagle", "eagle3")
#: how a draft model chooses the drafts of random requests (``draft_sampling``)
DRAFT_SAMPLING = ("probabilistic", "greedy")
#: most draft tokens per step and request (the verify forward grows with them)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``--speculative-config`` (a JSON object, vLLM's keys) asks for.

    ``num_speculative_tokens``: most drafts per request and step; the n-gram to look up has
    ``prompt_lookup_max`` tokens down to ``prompt_lookup_min`` (the longest that occurs
    earlier wins). ``model``: the draft model's checkpoint (a folder or hub id) for method
    ``draft_model``, the EAGLE-1 head's for method ``eagle``, the EAGLE-3 head's for method
    ``eagle3`` (method ``mtp`` takes none: the target's checkpoint); a ``model`` without a
    ``method`` names it by its path as vLLM does (:func:`method_of_model_path`).
    ``draft_sampling`` (chassis's own key, the methods that run a model):
    ``"probabilistic"`` (the default) lets the draft sample each draft of a random
    request from its own distribution and the target verify by rejection sampling;
    ``"greedy"`` proposes the draft's argmax for every request and verifies by exact match.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    draft_sampling: str = "probabilistic"

    @property
    def uses_draft_model(self) -> bool:
        """Whether drafts come from a model the runner runs (a draft model or an EAGLE
        head): the runner proposes them and the scheduler reserves their slots."""
        return self.method in MODEL_METHODS

    @property
    def uses_eagle(self) -> bool:
        """Whether the drafts come from an EAGLE head, EAGLE-1 or EAGLE-3
        (:mod:`chassis.core.eagle`): it reads the target's hidden states."""
        return self.method in EAGLE_METHODS

    @property
    def uses_eagle3(self) -> bool:
        """Whether the drafts come from an EAGLE-3 head (:mod:`chassis.core.eagle3`): it reads
        auxiliary hidden states of several target layers."""
        return self.method == "eagle3"

    @property
    def uses_mtp(self) -> bool:
        """Whether the drafts come from the target checkpoint's multi-token-prediction
        layer (:mod:`chassis.core.mtp`), run as an EAGLE-1 head."""
        return self.method == "mtp"

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """From a dict of vLLM's keys (unknown keys are an error naming them), validated."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                "--speculative-config must be a JSON object such as "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\''
            )
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "model",
            "draft_sampling",
        }
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": method_of_model_path(str(value["model"]))}
        if value.get("method") in METHOD_ALIASES:
            value = {**value, "method": METHOD_ALIASES[value["method"]]}
        high = value.get("prompt_lookup_max")
        if (
            "prompt_lookup_min" not in value
            and isinstance(high, int)
            and high < cls.prompt_lookup_min
        ):
            # only a maximum below the default minimum: look up n-grams of that one length
            value = {**value, "prompt_lookup_min": high}
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        """``ValueError`` naming the key to change when a value is not allowed."""
        if self.method not in METHODS:
            raise ValueError(
                f"--speculative-config method {self.method!r} is not implemented; "
                f"known: {', '.join(METHODS)}"
            )
        if self.uses_mtp and self.model is not None:
            raise ValueError(
                "--speculative-config method 'mtp' takes no \"model\": it runs the "
                "multi-token-prediction layer of the target's own checkpoint (drop it)"
            )
        if self.uses_draft_model:
            if not self.uses_mtp and (not isinstance(self.model, str) or not self.model.strip()):
                what = {
                    "eagle": "the EAGLE-1 head's folder or hub id (trained for the target)",
                    "eagle3": "the EAGLE-3 head's folder or hub id (trained for the target)",
                }.get(
                    self.method,
                    "the draft model's folder or hub id (a small model with the target's "
                    "vocabulary)",
                )
                raise ValueError(
                    f'--speculative-config method {self.method!r} needs "model": {what}'
                )
            if self.draft_sampling not in DRAFT_SAMPLING:
                raise ValueError(
                    f"--speculative-config draft_sampling must be one of "
                    f"{', '.join(DRAFT_SAMPLING)}, got {self.draft_sampling!r}"
                )
        elif self.draft_sampling != "probabilistic":
            raise ValueError(
                "--speculative-config \"draft_sampling\" is for methods 'draft_model', "
                "'eagle', 'eagle3' and 'mtp' (n-gram drafts are always one-hot); drop it"
            )
        elif self.model is not None:
            raise ValueError(
                "--speculative-config \"model\" is for methods 'draft_model', 'eagle' and "
                f"'eagle3'; method {self.method!r} takes no model (drop one of them)"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        # (bool is an int subclass: JSON ``true`` would read as 1)
        integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high))
        if not (integers and 1 <= low <= high):
            raise ValueError(
                "--speculative-config needs integers 1 <= prompt_lookup_min <= "
                f"prompt_lookup_max, got {low!r} and {high!r}"
            )


def method_of_model_path(model: str) -> str:
    """The method of a ``--speculative-config`` that gives a ``model`` and no ``method``,
    by vLLM's rule on the path: ``"eagle-"`` in it (any case, as in
    ``yuhuili/EAGLE-LLaMA3-Instruct-8B``) is an EAGLE-1 head, ``"eagle3"`` an EAGLE-3 head
    (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``), anything else a draft model."""
    name = model.lower()
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    return "draft_model"


def can_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be drafted and verified: its choice at each
    position depends on that position's logits and the random stream only (a seeded
    request's own stream is kept at one draw per output token: :mod:`.seeded_drafts`)."""
    return (
        params.allow_drafts  # False: a logits processor that cannot verify drafts acts on it
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
        and num_output_tokens >= params.min_tokens
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and params.structured_outputs is None
    )


def propose_ngram(token_ids: list[int], max_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``max_drafts`` tokens that followed the latest earlier occurrence of the last
    ``n`` tokens of ``token_ids``, for the largest ``n`` in ``[min_n, max_n]`` that has one
    (``[]`` when none does).

    The latest occurrence followed by ``max_drafts`` tokens is preferred to a later one whose
    continuation runs into the end of the text: in text that repeats with a short period
    (one word over and over), the latest occurrence overlaps the suffix and would propose a
    single token, where an earlier one proposes the next ``max_drafts`` of the pattern.

    The reference: it scans the whole text, so its time grows with it; the scheduler uses
    :class:`NgramIndex`, which gives the same drafts."""
    length = len(token_ids)
    if max_drafts < 1 or length <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # windows starting at 0 .. length - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            full = matches[matches + n + max_drafts <= length]
            start = int(full[-1] if full.size else matches[-1]) + n
            return tokens[start : start + max_drafts].tolist()
    return []


class NgramIndex:
    """The drafts :func:`propose_ngram` gives for one growing token stream, at a per-step
    cost that does not grow with the stream.

    Feed it the request's tokens as they become known (:meth:`extend`, or
    :meth:`catch_up` from the request's prompt and output); only real tokens go in, never
    drafts, so rejected drafts need no undo. ``propose(k)`` then equals
    ``propose_ngram(tokens, k, min_n, max_n)`` for the tokens fed so far, exactly (same
    longest ``n``, same preference for the latest occurrence followed by ``k`` tokens).

    For each ``n`` in ``[min_n, max_n]`` it keeps the latest start of every n-gram that is
    followed by at least one token, and for each start the previous start of the same
    n-gram. A lookup is one dictionary hit per ``n``; the preferred occurrence is reached by
    stepping back over at most ``k - 1`` later ones (starts are distinct, and those too close
    to the end to be followed by ``k`` tokens lie in a window of ``k - 1``). Feeding a token
    costs one dictionary update per ``n``. The memory is linear in the tokens (about 75 bytes
    per token and ``n`` on random text; ``tests/perf/ngram_proposer_cost.py`` prints it), so
    drop the index with the request.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramIndex needs 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # per n, longest first: (n, n-gram -> its latest followed start, start -> previous
        # start of the same n-gram or -1)
        self._tables: list[tuple[int, dict[tuple[int, ...], int], array]] = [
            (n, {}, array("q")) for n in range(max_n, min_n - 1, -1)
        ]

    @property
    def num_tokens(self) -> int:
        """How many tokens have been fed."""
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` to the stream."""
        tokens = self._tokens
        old = len(tokens)
        tokens.extend(token_ids)
        new = len(tokens)
        for n, latest, previous in self._tables:
            # the n-grams starting at first .. stop - 1 are now followed by a token
            first, stop = max(old - n, 0), new - n
            if first >= stop:
                continue
            grams = zip(*(tokens[first + k : stop + k] for k in range(n)), strict=True)
            for start, gram in enumerate(grams, first):
                previous.append(latest.get(gram, -1))
                latest[gram] = start

    def catch_up(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Feed what is new of ``prompt_token_ids + output_token_ids`` (a request's tokens,
        which only grow) without building that list.

        ``ValueError`` when the index holds more tokens than that: it belongs to another
        stream (make a new index)."""
        seen, num_prompt = len(self._tokens), len(prompt_token_ids)
        if seen > num_prompt + len(output_token_ids):
            raise ValueError(
                f"NgramIndex holds {seen} tokens, more than the request's "
                f"{num_prompt + len(output_token_ids)}: it was fed another stream"
            )
        if seen < num_prompt:
            self.extend(prompt_token_ids[seen:])
            seen = num_prompt
        if seen - num_prompt < len(output_token_ids):
            self.extend(output_token_ids[seen - num_prompt :])

    def propose(self, max_drafts: int) -> list[int]:
        """``propose_ngram(tokens fed so far, max_drafts, min_n, max_n)``."""
        tokens = self._tokens
        length = len(tokens)
        if max_drafts < 1 or length <= self.min_n:
            return []
        for n, latest, previous in self._tables:
            if n > length - 1:
                continue  # no n-gram this long is followed by a token yet
            start = latest.get(tuple(tokens[length - n :]))
            if start is None:
                continue
            # the latest start followed by max_drafts tokens, else the latest one
            candidate = start
            while candidate >= 0 and candidate + n + max_drafts > length:
                candidate = previous[candidate]
            if candidate >= 0:
                start = candidate
            return tokens[start + n : start + n + max_drafts]
        return []


def accepted_tokens(verified: list[int], drafts: list[int]) -> list[int]:
    """The tokens a verify step yields: ``verified[m]`` is the model's choice after draft
    ``m`` (``verified[0]`` after the request's last token); drafts are kept while the model
    chose them, then the model's own next token follows."""
    out = []
    for m, token in enumerate(verified):
        out.append(token)
        if m >= len(drafts) or token != drafts[m]:
            break
    return out
