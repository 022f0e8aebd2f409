"""Tiny random Qwen2-Audio checkpoints that take audio, and HF's answers for them.

:func:`save_tiny_qwen2_audio` writes a checkpoint folder as the hub ships Qwen2-Audio's:
``config.json`` and ``model.safetensors`` in the hub's tensor names (``language_model.model.*``,
``language_model.lm_head.*``, ``audio_tower.*``, ``multi_modal_projector.*``; ``layout=
"saved"`` keeps what transformers 5 saves), a Qwen2 text model of 2 layers and hidden 64
(untied), and an audio tower of 2 layers, ``d_model`` 32, 128 mel bins and the released
1,500 positions (30 s clips). The tokenizer is SmolLM2's with ``<|AUDIO|>``,
``<|audio_bos|>`` and ``<|audio_eos|>`` added (ids 49152..49154) and Qwen2-Audio's chat
template (``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>`` per audio part, ChatML);
``preprocessor_config.json`` is transformers' ``WhisperFeatureExtractor`` with 128 mel bins.

:func:`hf_inputs` runs transformers' ``Qwen2AudioProcessor`` over the checkpoint.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

AUDIO_TOKENS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
AUDIO_TOKEN_ID = 49152
SAMPLING_RATE = 16000

# Qwen2-Audio-7B-Instruct's template, trimmed to what the tests use (its system line kept)
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 49160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
AUDIO_CONFIG: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "max_source_positions": 1500,
}


def tiny_config() -> Any:
    """The ``Qwen2AudioConfig`` of the tiny model."""
    import transformers as tf

    return tf.Qwen2AudioConfig(
        audio_config=AUDIO_CONFIG,
        text_config=TEXT_CONFIG,
        audio_token_index=AUDIO_TOKEN_ID,
        tie_word_embeddings=False,
    )


def save_tiny_qwen2_audio(directory: Path, seed: int = 0, layout: str = "hub") -> Path:
    """Write the tiny random float32 checkpoint (module docstring) to ``directory``; 1-D
    parameters (biases, norms) and the position rows are randomized too."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from chassis.core.gguf_checkpoint import embedded_model_dir

    directory = Path(directory)
    torch.manual_seed(seed)
    model = tf.Qwen2AudioForConditionalGeneration(tiny_config()).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.1 * torch.randn_like(param))
            elif "embed_positions" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    if layout == "hub":
        tensors = {_hub_name(name): tensor for name, tensor in tensors.items()}
    else:
        tensors = {_saved_name(name): tensor for name, tensor in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt"})
    tokenizer = tf.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer.add_tokens(list(AUDIO_TOKENS), special_tokens=True)
    assert tokenizer.convert_tokens_to_ids(AUDIO_TOKENS[0]) == AUDIO_TOKEN_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    feature_extractor().save_pretrained(directory)
    return directory


def _hub_name(name: str) -> str:
    """Qwen2-Audio-7B's file names (whatever transformers 5 saved)."""
    name = _saved_name(name)
    for ours, hub in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.audio_tower.", "audio_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(ours):
            return hub + name[len(ours) :]
    return name


def _saved_name(name: str) -> str:
    """transformers 5's in-memory names (whatever it saved)."""
    for hub, ours in (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("audio_tower.", "model.audio_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ):
        if name.startswith(hub):
            return ours + name[len(hub) :]
    return name


def feature_extractor() -> Any:
    """transformers' feature extractor of the tiny checkpoints (Qwen2-Audio's settings)."""
    import transformers as tf

    return tf.WhisperFeatureExtractor(feature_size=128, return_attention_mask=True)


def random_clip(seconds: float, seed: int = 0, rate: int = SAMPLING_RATE) -> np.ndarray:
    """A mono float32 clip of tones and noise, ``seconds`` long at ``rate``."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(
        0.2 * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(100, 3000, size=3)
    )
    return (tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def wav_bytes(clip: np.ndarray, rate: int = SAMPLING_RATE, channels: int = 1) -> bytes:
    """``clip`` as a 16-bit PCM wav file (the same samples on every channel)."""
    pcm = np.clip(np.round(clip * 32767), -32768, 32767).astype(np.int16)
    frames = np.repeat(pcm[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(frames.tobytes())
    return out.getvalue()


def hf_processor(model_dir: Path) -> Any:
    import transformers as tf

    return tf.Qwen2AudioProcessor(
        feature_extractor=tf.WhisperFeatureExtractor.from_pretrained(model_dir),
        tokenizer=tf.AutoTokenizer.from_pretrained(model_dir),
    )


def hf_inputs(model_dir: Path, prompt: str, clips: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """HF's model inputs for ``prompt`` (one ``<|AUDIO|>`` per clip) and 16 kHz ``clips``."""
    processor = hf_processor(model_dir)
    out = processor(
        text=prompt, audio=clips or None, sampling_rate=SAMPLING_RATE, return_tensors="pt"
    )
    return {name: value for name, value in out.items() if name != "attention_mask"}


def hf_model(model_dir: Path) -> Any:
    import transformers as tf

    return tf.Qwen2AudioForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()


def mp3_bytes(clip: np.ndarray, rate: int = SAMPLING_RATE) -> bytes:
    """``clip`` encoded as an mp3 file by PyAV (libmp3lame)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp3") as container:
        stream = container.add_stream("libmp3lame", rate=rate, layout="mono")
        frame_size = 1152
        for start in range(0, len(clip), frame_size):
            chunk = clip[start : start + frame_size][None, :].astype(np.float32)
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()
