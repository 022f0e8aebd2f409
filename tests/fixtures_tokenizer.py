"""Shared tokenizer fixtures: the real SmolLM2 tokenizer and a tiny sentencepiece-style one.

``tests/conftest.py`` registers the fixtures, so the tokenizer is read once per run; importing
one into a test module would make that module's own copy, read again.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with SmolLM2's tokenizer files as transformers saves them: the embedded
    model's conversion's (the GGUF's tokenizer with the file's special tokens and the
    repaired decoder), re-saved with transformers' default ``model_max_length``.

    Read from the converted model, which a run converts once anyway (and caches), instead of
    from the GGUF: reading the GGUF's tokenizer and config again took 13-17 s a run (the
    setup of its first user in CI's ``--durations`` of 2026-12-01). The files equal that
    extraction's but for the conversion's ``model_max_length`` (checked 2026-12-01,
    transformers 5.24), which is reset here."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    from chassis.core.gguf_checkpoint import embedded_model_dir
    from chassis.core.tokenizer import repair_byte_level_decoder

    try:
        converted = embedded_model_dir()
    except ValueError as missing:  # neither converted nor installed
        pytest.skip(str(missing))
    tokenizer = AutoTokenizer.from_pretrained(converted)
    repair_byte_level_decoder(tokenizer)  # the conversion did; a no-op unless it did not
    tokenizer.model_max_length = VERY_LARGE_INTEGER  # transformers' "no limit"
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def smol_tokenizer(smol_tokenizer_dir: Path):
    """The real SmolLM2 tokenizer (byte-level BPE, ``<|im_start|>`` chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_tokenizer_dir)


def make_sentencepiece_style_tokenizer():
    """A tiny Llama-style tokenizer: ``▁`` word prefixes and byte fallback for unknown
    characters (so CJK text becomes ``<0xE4>``-style byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁Hello", "▁world", "▁the", "▁caf", "é", "▁na", "ï", "ve", "!", ",", "."]
    words += list("abcdefghijklmnopqrstuvwxyzHW")
    vocab = [(p, 0.0) for p in pieces] + [(w, -float(i + 1)) for i, w in enumerate(words)]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="session")
def sp_tokenizer():
    """See ``make_sentencepiece_style_tokenizer``."""
    return make_sentencepiece_style_tokenizer()
