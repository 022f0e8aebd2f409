"""Incremental detokenization of one completion, with stop strings.

Tokens arrive a few at a time; the text a client sees must grow by deltas whose concatenation
is exactly what decoding all tokens at once gives. Two things make that subtle:

* one character may span several tokens (UTF-8 bytes split by byte-level BPE or by
  sentencepiece byte fallback), and a token's leading space may depend on its neighbours;
* a stop string may be split across tokens, and must never be streamed partially.

``IncrementalDetokenizer`` handles both. Decoding uses ``tokenizers.decoders.DecodeStream``
when the tokenizer is Rust-backed, else the prefix/read-offset window algorithm
(``_OffsetDecoder``). Either way, at the end the text is reconciled with a full decode, so the
contract below holds even for a trailing incomplete character.

Contract (per completion, ``skip_special_tokens`` as given)::

    "".join(all deltas) == detok.output_text
        == tokenizer.decode(detok.decoded_token_ids, skip_special_tokens=...,
                            clean_up_tokenization_spaces=False)
           truncated at the stop string (kept if include_stop_str_in_output)

``decoded_token_ids`` is ``token_ids`` without a final stop token (EOS or a ``stop_token_ids``
entry) unless ``include_stop_str_in_output``: like vLLM, the stop token stays in the token ids
but its text is not part of the output.

One limit no incremental decoder can lift: sentencepiece byte fallback decodes a *run* of byte
tokens that turns out to be invalid UTF-8 as one U+FFFD per byte, changing text that looked
final. Models emit valid UTF-8 runs; byte-level BPE (GPT-2 style) has no such case.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from chassis.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: Tokens of context the offset decoder keeps before the first new token (as vLLM does).
_CONTEXT_TOKENS = 5


class _TokenDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """Append one token; return the text that became final (possibly "")."""


def _special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id ``decode(..., skip_special_tokens=True)`` drops: special and special-added."""
    ids = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, tok in added.items() if getattr(tok, "special", False))
    return frozenset(ids)


class _StreamDecoder:
    """Incremental decoding by the tokenizers library's own ``DecodeStream``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer._tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class _OffsetDecoder:
    """Decode a sliding window of tokens and emit what the newest ones add.

    ``prefix_offset..read_offset`` is text already emitted, kept as context so spacing rules
    (sentencepiece's leading ``▁``, byte-level merges) see the neighbours; text ending in
    U+FFFD is an incomplete character and waits for the next token.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool,
        context_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_ids = _special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        self._added_tokens = frozenset(tokenizer.get_added_vocab())
        self._is_fast = bool(getattr(tokenizer, "is_fast", False))
        self._tokens: list[str] = [
            tokenizer.convert_ids_to_tokens(i) for i in context_ids if i not in self._skip_ids
        ]
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)

    def _to_string(self, tokens: list[str]) -> str:
        if self._is_fast or not self._added_tokens.intersection(tokens):
            return self._tokenizer.convert_tokens_to_string(tokens)
        # Slow tokenizers cannot run added tokens through their model's decoder: decode the
        # runs between them separately and keep the added tokens verbatim.
        parts: list[str] = []
        run: list[str] = []
        for tok in tokens:
            if tok in self._added_tokens:
                if run:
                    parts.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(tok)
            else:
                run.append(tok)
        if run:
            parts.append(self._tokenizer.convert_tokens_to_string(run))
        return "".join(parts)

    def step(self, token_id: int) -> str:
        if token_id in self._skip_ids:
            return ""
        self._tokens.append(self._tokenizer.convert_ids_to_tokens(token_id))
        prefix_text = self._to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]


class IncrementalDetokenizer:
    """Turns one completion's token ids into text deltas, applying stop strings.

    Feed tokens with ``update``; it returns the text that may be streamed now. While the
    completion runs, up to ``max(len(stop)) - 1`` trailing characters are held back so that a
    stop string split across tokens is never streamed in part; they are released when the
    completion finishes for another reason. A stop string is searched only where it could
    newly occur (the new text plus the ``len(stop) - 1`` characters before it), and only once
    more than ``min_tokens`` tokens exist (vLLM's rule). The earliest-ending match wins.

    ``use_decode_stream``: ``None`` picks ``DecodeStream`` for Rust-backed tokenizers, the
    offset algorithm otherwise; ``False`` forces the offset algorithm.

    ``decode_at_finish``: decode nothing per token and the whole completion once when it
    finishes (``update`` returns ``""`` until then). For outputs read only at the end (the
    offline ``LLM``), where per-token decoding is work nobody reads. The text is then the
    tokenizer's full decode: the same as the incremental text for valid UTF-8, but a run of
    byte tokens that never completes a character comes out as replacement characters where
    the incremental decoders may have left it out. Not with stop strings, which need the text
    as it grows.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        use_decode_stream: bool | None = None,
        decode_at_finish: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        if decode_at_finish and stop:
            raise ValueError("stop strings need per-token decoding, not decode_at_finish")
        self._decode_at_finish = decode_at_finish
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        if use_decode_stream is None:
            use_decode_stream = _has_rust_backend(tokenizer)
        self._decoder: _TokenDecoder = (
            _StreamDecoder(tokenizer, skip_special_tokens)
            if use_decode_stream
            else _OffsetDecoder(tokenizer, skip_special_tokens)
        )
        #: every token accepted, a final stop token included
        self.token_ids: list[int] = []
        #: the tokens whose text is in ``output_text``
        self.decoded_token_ids: list[int] = []
        self._text = ""
        self._num_streamed = 0
        self.finished = False
        #: the stop string that ended the completion, if one did
        self.stop_reason: str | None = None

    @classmethod
    def from_sampling_params(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        *,
        read_at_finish_only: bool = False,
    ) -> IncrementalDetokenizer:
        """A detokenizer configured by a request's ``SamplingParams``.

        ``read_at_finish_only``: the caller reads the text only once the completion finished;
        it is then decoded once at the end unless stop strings need it per token.
        """
        return cls(
            tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            decode_at_finish=read_at_finish_only and not params.stop,
        )

    @property
    def output_text(self) -> str:
        """All text so far, held-back characters included (final once ``finished``)."""
        return self._text

    @property
    def streamed_text(self) -> str:
        """The text returned by ``update`` so far (``output_text`` minus what is held back)."""
        return self._text[: self._num_streamed]

    def update(
        self,
        new_token_ids: Sequence[int],
        *,
        finished: bool = False,
        stop_token_terminated: bool = False,
    ) -> str:
        """Accept new tokens and return the text delta that may be streamed now.

        ``finished``: the engine ended the completion after these tokens (for any reason);
        held-back text is released. ``stop_token_terminated``: the last of ``new_token_ids`` is
        a stop token (EOS or ``stop_token_ids``); its text is dropped unless
        ``include_stop_str_in_output``. When a stop string matches, ``finished`` and
        ``stop_reason`` are set and later tokens (in this call or after) are ignored: compare
        ``len(token_ids)`` before and after to learn how many were accepted.
        """
        last = len(new_token_ids) - 1
        for i, token_id in enumerate(new_token_ids):
            if self.finished:
                break
            self.token_ids.append(token_id)
            if i == last and stop_token_terminated and not self._include_stop:
                continue
            self.decoded_token_ids.append(token_id)
            if not self._decode_at_finish:
                self._append(self._decode_step(token_id))
        if finished and not self.finished:
            self._reconcile()
            self.finished = True
        return self._take_delta()

    # -- internals ------------------------------------------------------------------------

    def _decode_step(self, token_id: int) -> str:
        try:
            return self._decoder.step(token_id)
        except Exception as e:  # the Rust DecodeStream raises plain Exceptions
            if not isinstance(self._decoder, _StreamDecoder):
                raise
            # DecodeStream refuses some decoder pipelines mid-stream ("Invalid prefix
            # encountered"); continue with the offset algorithm from the same context.
            logger.warning("DecodeStream failed (%s); using offset detokenization", e)
            context = self.decoded_token_ids[-_CONTEXT_TOKENS - 1 : -1]
            self._decoder = _OffsetDecoder(self._tokenizer, self._skip_special_tokens, context)
            return self._decoder.step(token_id)

    def _append(self, delta: str) -> None:
        if not delta:
            return
        old_len = len(self._text)
        self._text += delta
        if self._stop and len(self.token_ids) > self._min_tokens:
            self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return
        end, start, stop = best
        # start >= old_len - holdback >= what was streamed, so no streamed text is retracted.
        self._text = self._text[: end if self._include_stop else start]
        self.stop_reason = stop
        self.finished = True

    def _reconcile(self) -> None:
        """Append whatever a full decode has beyond the incremental text (a trailing
        incomplete character the incremental decoders still wait on)."""
        full = self._tokenizer.decode(
            self.decoded_token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        if len(full) > len(self._text) and full.startswith(self._text):
            self._append(full[len(self._text) :])

    def _take_delta(self) -> str:
        if self.finished:
            limit = len(self._text)
        else:
            limit = max(self._num_streamed, len(self._text) - self._holdback)
        delta = self._text[self._num_streamed : limit]
        self._num_streamed = limit
        return delta


def _has_rust_backend(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` wraps a ``tokenizers.Tokenizer`` that ``DecodeStream`` accepts."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (added in tokenizers 0.21)
    except ImportError:
        return False
    return bool(getattr(tokenizer, "is_fast", False)) and isinstance(
        getattr(tokenizer, "_tokenizer", None), Tokenizer
    )
