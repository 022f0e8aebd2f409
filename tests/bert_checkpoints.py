"""Tiny random BERT-family checkpoints written by transformers, for the encoder tests.

:func:`write_bert` saves a ``BertModel`` / ``BertForSequenceClassification`` with a real
``BertTokenizer`` (a small WordPiece ``vocab.txt``: ``[SEP]`` is id 3, pairs get token
types 0 and 1); :func:`write_xlm_roberta` an ``XLMRobertaModel`` /
``XLMRobertaForSequenceClassification`` with a RoBERTa-style tokenizer (``<s>`` 0,
``<pad>`` 1, ``</s>`` 2; pairs ``<s> a </s></s> b </s>``), built offline with
``tokenizers``. Both: 2 layers, hidden 64, 4 heads, float32, every 1-D parameter
randomized (LayerNorm around 1, biases around 0), so that a wrong norm, bias, token type
or position would show.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

#: the words of the tiny vocabularies (anything else is spelled with letters and ##letters)
WORDS = [
    "the", "a", "cat", "sat", "on", "mat", "dog", "is", "was", "movie", "wonderful", "good",
    "bad", "query", "document", "paris", "capital", "of", "france", "what", "long", "and",
    "winding", "sentence", "hello", "world",
]  # fmt: skip
_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def _vocab(special: list[str]) -> list[str]:
    letters = list(string.ascii_lowercase)
    pieces = special + letters + ["##" + c for c in letters] + WORDS + list(string.punctuation)
    return list(dict.fromkeys(pieces))


def _randomize(model: Any, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "LayerNorm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            elif "embeddings" not in name:
                # HF's init (std 0.02) barely moves a 64-wide model: std ~ 1 / sqrt(64)
                param.mul_(6.0)
                if "classifier" in name or "out_proj" in name:
                    param.mul_(4.0)  # logits of a few units: sigmoids far from 0.5


def write_bert(
    directory: Path,
    *,
    num_labels: int | None = None,
    max_position_embeddings: int = 64,
    seed: int = 0,
) -> Path:
    """A ``BertModel`` checkpoint (``num_labels`` None) or a
    ``BertForSequenceClassification`` one, with its ``BertTokenizer``."""
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        BertConfig,
        BertTokenizer,
    )

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = _vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    vocab_file = directory / "vocab.txt"
    vocab_file.write_text("\n".join(vocab) + "\n", encoding="utf-8")
    BertTokenizer(str(vocab_file)).save_pretrained(directory)
    fields: dict[str, Any] = dict(
        _SHAPE, vocab_size=len(vocab), max_position_embeddings=max_position_embeddings
    )
    if num_labels is None:
        config = BertConfig(**fields)
        torch.manual_seed(seed)
        model = AutoModel.from_config(config, dtype=torch.float32)
    else:
        config = BertConfig(**fields, num_labels=num_labels)
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_xlm_roberta(
    directory: Path,
    *,
    num_labels: int | None = None,
    max_position_embeddings: int = 66,
    seed: int = 1,
) -> Path:
    """An ``XLMRobertaModel`` checkpoint (``num_labels`` None) or an
    ``XLMRobertaForSequenceClassification`` one, with a RoBERTa-style tokenizer (pad id 1:
    ``max_position_embeddings - 2`` usable positions)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import (
        AutoModel,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
        XLMRobertaConfig,
    )

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(_vocab(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
    ).save_pretrained(directory)
    fields: dict[str, Any] = dict(
        _SHAPE,
        vocab_size=len(vocab),
        max_position_embeddings=max_position_embeddings,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    if num_labels is None:
        config = XLMRobertaConfig(**fields)
        torch.manual_seed(seed)
        model = AutoModel.from_config(config, dtype=torch.float32)
    else:
        config = XLMRobertaConfig(**fields, num_labels=num_labels)
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_hidden_states(model_dir: Path, texts: list[str]) -> list[torch.Tensor]:
    """HF ``AutoModel``'s ``last_hidden_state`` of each text, alone (``[n, hidden]``)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    states = []
    with torch.inference_mode():
        for text in texts:
            encoded = tokenizer(text, return_tensors="pt")
            states.append(model(**encoded).last_hidden_state[0])
    return states
