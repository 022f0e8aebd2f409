"""Tiny random Whisper checkpoints and HF's answers for them.

:func:`save_tiny_whisper` writes ``WhisperForConditionalGeneration`` (float32, 2 encoder and 2
decoder layers, ``d_model`` 32, 80 mel bins, the released 1,500 encoder positions: 30 s
windows; 64 decoder positions), transformers' ``WhisperFeatureExtractor`` and a
``WhisperTokenizer`` configured as the hub's (:func:`whisper_tokenizer`: SmolLM2's BPE with
Whisper's special tokens added, ids from 49152, :data:`SPECIAL_TOKENS`); ``<|endoftext|>``
(id 0) is the end of text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL_TOKENS = (
    "<|startoftranscript|>",
    "<|en|>",
    "<|de|>",
    "<|fr|>",
    "<|transcribe|>",
    "<|translate|>",
    "<|notimestamps|>",
    "<|startofprev|>",
    "<|nocaptions|>",
)
SOT_ID = 49152
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
SAMPLING_RATE = 16000

CONFIG: dict[str, Any] = {
    "vocab_size": 49168,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "num_mel_bins": 80,
    "max_source_positions": 1500,
    "max_target_positions": 64,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "decoder_start_token_id": SOT_ID,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "init_std": 0.3,  # (at 0.02 every clip gives the same tokens)
}


def save_tiny_whisper(directory: Path, seed: int = 0) -> Path:
    """Write the tiny random checkpoint (module docstring) to ``directory``; biases, norms
    and position rows are randomized too."""
    import transformers as tf

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(**CONFIG)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            elif name.startswith("model.decoder.embed_"):
                param.copy_(0.5 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    whisper_tokenizer(Path(embedded_model_dir())).save_pretrained(directory)
    tf.WhisperFeatureExtractor(feature_size=80).save_pretrained(directory)
    return directory


def whisper_tokenizer(smol_dir: Path) -> Any:
    """A ``WhisperTokenizer`` set up as openai/whisper-tiny's ``tokenizer_config.json`` sets
    it (no language, no task, ``predict_timestamps`` false: its prefix tokens are
    ``<|startoftranscript|><|notimestamps|>``, added with ``<|endoftext|>`` when special
    tokens are), over SmolLM2's byte-level BPE vocabulary (``<|endoftext|>`` is id 0 there)
    with :data:`SPECIAL_TOKENS` added as special tokens; no chat template."""
    import json

    import transformers as tf

    model = json.loads((smol_dir / "tokenizer.json").read_text())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = tf.WhisperTokenizer(
        vocab=model["vocab"], merges=merges, language=None, task=None, predict_timestamps=False
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.set_prefix_tokens()  # (the prefix's ids exist only now)
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0]) == SOT_ID
    return tokenizer


def prompt_ids(*tokens: str) -> list[int]:
    """The ids of Whisper special tokens (:data:`SPECIAL_TOKENS`)."""
    return [SOT_ID + SPECIAL_TOKENS.index(t) for t in tokens]


def random_clip(seconds: float, seed: int = 0, rate: int = SAMPLING_RATE) -> np.ndarray:
    """A mono float32 clip of tones and noise, ``seconds`` long at ``rate``."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(
        0.2 * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(100, 3000, size=3)
    )
    return (tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.WhisperForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_features(model_dir: Path, clip: np.ndarray) -> torch.Tensor:
    """HF's ``input_features`` ``[1, 80, 3000]`` of a 16 kHz clip."""
    import transformers as tf

    extractor = tf.WhisperFeatureExtractor.from_pretrained(model_dir)
    out = extractor(clip, sampling_rate=SAMPLING_RATE, return_tensors="pt")
    return out["input_features"].to(torch.float32)


def hf_greedy(model: Any, features: torch.Tensor, decoder_ids: list[int], n: int) -> list[int]:
    """HF's greedy ``generate`` (GenerationMixin's, over the forced decoder prompt; EOS not
    stopping): the ``n`` new token ids."""
    from transformers.generation.utils import GenerationMixin

    with torch.no_grad():
        out = GenerationMixin.generate(
            model,
            input_features=features,
            decoder_input_ids=torch.tensor([decoder_ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(decoder_ids) :].tolist()
