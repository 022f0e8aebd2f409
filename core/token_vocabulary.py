"""The bytes each token of a Hugging Face tokenizer adds to the output, for structured output.

:func:`vocabulary_from_tokenizer` reads a fast (``tokenizers``-backed) tokenizer's vocabulary
and converts each token string to bytes the way its decoder does. Which conversion applies is
read from the ``tokenizer.json`` decoder (then the pre-tokenizer, then the vocabulary itself):

- **byte-level BPE** (GPT-2's byte-to-unicode alphabet: SmolLM2, Llama 3, Qwen, ...; a
  ``ByteLevel`` decoder): a token whose characters all belong to the alphabet stands for the
  bytes they map to (``Ġ`` is a space); any other token (an added token such as
  ``"abc def"``) for its own UTF-8 text. Added tokens follow the same rule, because
  ``tokenizers`` decodes them through the decoder too (an added ``"Ġxyz"`` decodes to
  ``" xyz"``), and matching what ``decode`` prints is what matters;
- **SentencePiece style** (Llama 2, Mistral, ...; a ``Metaspace`` decoder, or a ``Replace``
  of ``▁`` by a space): ``▁`` is a space, and with byte fallback (a ``ByteFallback``
  decoder) ``<0xNN>`` is the single byte ``0xNN``. The decoder also strips one leading space
  at the very start of a text; a token keeps it here (it is the token's bytes in the middle
  of an output), so ``▁Hello`` is ``b" Hello"`` everywhere.

Special tokens (``all_special_ids`` and added tokens marked special) and ids the tokenizer
does not have (up to ``vocab_size``, the model's logits width) are ``None``: a grammar never
allows them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from chassis.core.structured_output import TokenVocabulary

__all__ = ["byte_level_alphabet", "check_tokenizer", "vocabulary_from_tokenizer"]

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "▁"


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte value."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:  # control bytes, space, ... are shifted past U+00FF
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def vocabulary_from_tokenizer(
    tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]
) -> TokenVocabulary:
    """The :class:`TokenVocabulary` of a fast Hugging Face ``tokenizer`` (see the module
    docstring), ``vocab_size`` entries long. Raises ``ValueError`` for a tokenizer that is
    not ``tokenizers``-backed or whose token-to-bytes mapping is not one of those above."""
    vocab, to_bytes = _vocab_and_decoder(tokenizer)
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    token_bytes: list[bytes | None] = [None] * vocab_size
    for text, token_id in vocab.items():
        if 0 <= token_id < vocab_size and token_id not in special:
            token_bytes[token_id] = to_bytes(text)
    return TokenVocabulary(
        token_bytes=token_bytes,
        eos_token_ids=frozenset(int(i) for i in eos_token_ids),
        tokenizer=tokenizer,
    )


def check_tokenizer(tokenizer: Any) -> None:
    """Raise the ``ValueError`` :func:`vocabulary_from_tokenizer` would raise for
    ``tokenizer``, without mapping its tokens (for a front-end's early 400)."""
    _vocab_and_decoder(tokenizer)


def _vocab_and_decoder(tokenizer: Any) -> tuple[dict[str, int], Callable[[str], bytes]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"structured output needs a fast (tokenizers-backed) tokenizer; "
            f"{type(tokenizer).__name__} is not one"
        )
    vocab = backend.get_vocab(with_added_tokens=True)
    return vocab, _token_decoder(json.loads(backend.to_str()), vocab)


def _components(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A decoder or pre-tokenizer and, for a ``Sequence``, everything in it."""
    if not spec:
        return []
    parts = [spec]
    for key in ("decoders", "pretokenizers"):
        for inner in spec.get(key) or ():
            parts.extend(_components(inner))
    return parts


def _token_decoder(spec: dict[str, Any], vocab: dict[str, int]) -> Callable[[str], bytes]:
    """How a token string becomes bytes for the tokenizer described by ``spec``."""
    decoders = _components(spec.get("decoder"))
    types = {part.get("type") for part in decoders}
    if "ByteLevel" in types:
        return _byte_level_bytes
    metaspace = [
        part.get("replacement", _METASPACE) for part in decoders if part.get("type") == "Metaspace"
    ] + [
        part.get("pattern", {}).get("String")
        for part in decoders
        if part.get("type") == "Replace" and part.get("content") == " "
    ]
    if any(metaspace):
        return _metaspace_decoder(next(m for m in metaspace if m), "ByteFallback" in types)
    if not decoders:  # no decoder: tell from the pre-tokenizer, then from the tokens
        pre = {part.get("type") for part in _components(spec.get("pre_tokenizer"))}
        alphabet = byte_level_alphabet()
        if "ByteLevel" in pre or (
            any("Ġ" in token for token in vocab)
            and sum(all(c in alphabet for c in token) for token in vocab) >= 0.95 * len(vocab)
        ):
            return _byte_level_bytes
        if "Metaspace" in pre or any(_METASPACE in token for token in vocab):
            byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
            return _metaspace_decoder(_METASPACE, byte_fallback)
    raise ValueError(
        "cannot tell how this tokenizer's tokens map to bytes (neither byte-level BPE nor "
        f"SentencePiece-style; decoder types {sorted(t for t in types if t)}), so structured "
        "output cannot constrain it"
    )


def _byte_level_bytes(token: str) -> bytes:
    alphabet = byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in token)
    except KeyError:  # not byte-level text (an added token): the decoder keeps it as is
        return token.encode("utf-8")


def _metaspace_decoder(replacement: str, byte_fallback: bool) -> Callable[[str], bytes]:
    def to_bytes(token: str) -> bytes:
        if byte_fallback and (m := _BYTE_FALLBACK.fullmatch(token)):
            return bytes([int(m.group(1), 16)])
        return token.replace(replacement, " ").encode("utf-8")

    return to_bytes
