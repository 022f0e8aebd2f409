"""Tiny random EmbeddingGemma and ModernBERT checkpoints written by transformers, for the
encoder tests.

:func:`write_embedding_gemma` saves a ``Gemma3TextModel`` with
``use_bidirectional_attention`` (4 layers: sliding, sliding, full, sliding; GQA 4 query / 2
KV heads; ``sliding_window`` 8 in ``config.json``, which transformers reads as 5: keys fewer
than 5 places away) and a ``<bos> text <eos>`` tokenizer; :func:`write_modernbert` a
``ModernBertModel`` / ``ModernBertForSequenceClassification`` (4 layers, global every 2nd,
``local_attention`` 8: 4 places each side) with a ``[CLS] a [SEP] b [SEP]`` tokenizer. Both
hidden 64, float32, every 1-D parameter randomized and the projections scaled to std
``1/sqrt(fan_in)``, so that a wrong norm, window or position would show. The tokenizers
(WordPiece over :data:`bert_checkpoints.WORDS`) are built offline with ``tokenizers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from bert_checkpoints import _vocab

#: the window of the tiny checkpoints' local layers, each side (tokens)
GEMMA_MAX_DISTANCE = 4
MODERNBERT_MAX_DISTANCE = 4


def _tokenizer(directory: Path, specials: list[str], single: str, pair: str, **names: str) -> int:
    """Save a WordPiece ``PreTrainedTokenizerFast`` with ``specials`` first (ids 0, 1, ...)
    and the given templates; return the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_vocab(specials))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=names["unk_token"]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    used = [t for t in specials if t in single or t in pair]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in used]
    )
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names).save_pretrained(directory)
    return len(vocab)


def _randomize(model: Any, seed: int, norm_base: float) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = norm_base if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            elif "embed" not in name:
                param.normal_(0.0, param.shape[1] ** -0.5)
                if "classifier" in name:
                    param.mul_(4.0)  # logits of a few units: sigmoids far from 0.5


def write_embedding_gemma(directory: Path, *, seed: int = 10) -> Path:
    """A bidirectional ``Gemma3TextModel`` checkpoint (EmbeddingGemma's layout) with its
    tokenizer."""
    from transformers import AutoModel, Gemma3TextConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = _tokenizer(
        directory,
        ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
        "<bos> $A <eos>",
        "<bos> $A <eos> $B <eos>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
        sliding_window=8,  # read back as 5: |q - k| < 5
        layer_types=[*["sliding_attention"] * 2, "full_attention", "sliding_attention"],
        use_bidirectional_attention=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        architectures=["Gemma3TextModel"],
    )
    assert config.sliding_window == GEMMA_MAX_DISTANCE + 1
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3TextModel"
    _randomize(model, seed, norm_base=0.0)  # Gemma's RMSNorm scales by 1 + weight
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_modernbert(
    directory: Path,
    *,
    num_labels: int | None = None,
    classifier_pooling: str = "cls",
    masked_lm: bool = False,
    seed: int = 20,
) -> Path:
    """A ``ModernBertModel`` checkpoint (``num_labels`` None), a
    ``ModernBertForSequenceClassification`` one, or with ``masked_lm`` a
    ``ModernBertForMaskedLM`` one (ModernBERT-base's layout), with its tokenizer."""
    from transformers import (
        AutoModel,
        AutoModelForMaskedLM,
        AutoModelForSequenceClassification,
        ModernBertConfig,
    )

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = _tokenizer(
        directory,
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        "[CLS] $A [SEP]",
        "[CLS] $A [SEP] $B [SEP]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        unk_token="[UNK]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    fields: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        global_attn_every_n_layers=2,
        local_attention=2 * MODERNBERT_MAX_DISTANCE,
        max_position_embeddings=128,
        global_rope_theta=160_000.0,
        local_rope_theta=10_000.0,
        pad_token_id=0,
        cls_token_id=2,
        bos_token_id=2,
        sep_token_id=3,
        eos_token_id=3,
        classifier_pooling=classifier_pooling,
    )
    torch.manual_seed(seed)
    if masked_lm:
        model = AutoModelForMaskedLM.from_config(ModernBertConfig(**fields), dtype=torch.float32)
    elif num_labels is None:
        model = AutoModel.from_config(ModernBertConfig(**fields), dtype=torch.float32)
    else:
        config = ModernBertConfig(**fields, num_labels=num_labels)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, seed, norm_base=1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
