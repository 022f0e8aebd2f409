"""Qwen2-Audio's audio tower (transformers' ``Qwen2AudioEncoder``, Whisper's encoder with an
average pool) and its projector.

The input is one clip's log-mel features ``[mel_bins, 2 * max_source_positions]`` (3,000
frames, 30 s: what the feature extractor pads every clip to) and the number of frames that
hold the clip (the rest is padding). The tower:

1. ``conv1`` (kernel 3, padding 1) then GELU, ``conv2`` (kernel 3, stride 2, padding 1) then
   GELU: ``max_source_positions`` rows of ``d_model``; plus the learned position rows;
2. pre-norm transformer layers: LayerNorm, attention (q/v/out projections with biases, k
   without; queries scaled by ``head_dim**-0.5``) whose keys are only the clip's rows (the
   first ``(frames - 1) // 2 + 1``; the padding's rows are masked as keys, as HF's model
   masks them from ``feature_attention_mask``), residual; LayerNorm, ``fc1``, the config's
   activation, ``fc2``, residual;
3. an average pool of pairs of rows, then the final LayerNorm.

The projector (one ``Linear``, with bias) maps each pooled row to the language model's
width. Of the ``max_source_positions / 2`` rows only the first
``audio_token_count(frames)`` belong to the clip (HF's ``_get_feat_extract_output_lengths``);
they are the clip's rows for the language model. Parameter names are the checkpoint's
(``audio_tower.`` and ``multi_modal_projector.`` stripped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chassis.builtin_plugins.models.qwen2_vl_vision import activation


def audio_token_count(num_frames: int) -> int:
    """The language-model rows of a clip of ``num_frames`` mel frames (``Qwen2AudioProcessor``'s
    count: the stride-2 conv's output length, then the pool's)."""
    conv_rows = (num_frames - 1) // 2 + 1
    return (conv_rows - 2) // 2 + 1


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a sub-config that may be a config object or a plain dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class AudioTowerSpec:
    """The sizes of a ``Qwen2AudioEncoderConfig`` (``audio_config``), checked."""

    mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_source_positions: int
    activation: str

    @classmethod
    def from_config(cls, audio_config: Any) -> AudioTowerSpec:
        """``ValueError`` when ``audio_config`` is missing or inconsistent."""
        if audio_config is None:
            raise ValueError("the checkpoint's config has no audio_config: it cannot take audio")
        d_model = int(_get(audio_config, "d_model", 1280))
        heads = int(_get(audio_config, "encoder_attention_heads", 20))
        if d_model % heads:
            raise ValueError(
                f"audio_config: d_model {d_model} is not divisible by "
                f"encoder_attention_heads {heads}"
            )
        name = str(_get(audio_config, "activation_function", "gelu"))
        activation(name)  # (refuses an unknown one now, not on the first clip)
        return cls(
            mel_bins=int(_get(audio_config, "num_mel_bins", 128)),
            d_model=d_model,
            num_layers=int(_get(audio_config, "encoder_layers", 32)),
            num_heads=heads,
            ffn_dim=int(_get(audio_config, "encoder_ffn_dim", 5120)),
            max_source_positions=int(_get(audio_config, "max_source_positions", 1500)),
            activation=name,
        )

    @property
    def num_frames(self) -> int:
        """The mel frames every input holds (padded): twice the positions (conv2's stride)."""
        return 2 * self.max_source_positions


class _AudioAttention(nn.Module):
    def __init__(self, spec: AudioTowerSpec) -> None:
        super().__init__()
        dim = spec.d_model
        self.num_heads = spec.num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        # x: [B, S, D]; key_mask: [B, 1, 1, S] bool, True where a key may be attended
        b, s, d = x.shape
        shape = (b, s, self.num_heads, d // self.num_heads)
        q, k, v = (
            proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class _AudioLayer(nn.Module):
    def __init__(self, spec: AudioTowerSpec) -> None:
        super().__init__()
        self.self_attn = _AudioAttention(spec)
        self.self_attn_layer_norm = nn.LayerNorm(spec.d_model)
        self.fc1 = nn.Linear(spec.d_model, spec.ffn_dim)
        self.fc2 = nn.Linear(spec.ffn_dim, spec.d_model)
        self.final_layer_norm = nn.LayerNorm(spec.d_model)
        self.act = activation(spec.activation)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen2AudioTower(nn.Module):
    """The audio encoder (module docstring): features ``[B, mel_bins, frames]`` and each
    clip's frame count -> ``[B, max_source_positions // 2, d_model]`` pooled rows."""

    def __init__(self, spec: AudioTowerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.conv1 = nn.Conv1d(spec.mel_bins, spec.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(spec.d_model, spec.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(spec.max_source_positions, spec.d_model)
        self.layers = nn.ModuleList(_AudioLayer(spec) for _ in range(spec.num_layers))
        self.layer_norm = nn.LayerNorm(spec.d_model)

    def forward(self, features: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """``ValueError`` for features of another frame count or mel-bin count than the
        config's."""
        spec = self.spec
        if features.dim() != 3 or tuple(features.shape[1:]) != (spec.mel_bins, spec.num_frames):
            raise ValueError(
                f"audio input_features must be [clips, {spec.mel_bins}, {spec.num_frames}] "
                f"(mel bins, frames padded to 30 s); got {tuple(features.shape)}"
            )
        features = features.to(self.conv1.weight.dtype)
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, positions, D]
        # (HF's tower never applies its scale_embedding factor; neither does this one)
        x = x + self.embed_positions.weight
        # keys are the clip's own conv rows only, as HF masks them (the padding's rows are
        # computed as queries, and the pool's rows that use them are never returned)
        conv_rows = (num_frames.to(x.device).long() - 1) // 2 + 1
        positions = torch.arange(x.shape[1], device=x.device)
        key_mask = (positions[None, :] < conv_rows[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, key_mask)
        x = F.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)


class Qwen2AudioProjector(nn.Module):
    """``multi_modal_projector``: the tower's rows -> the language model's width."""

    def __init__(self, d_model: int, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_model, hidden_size)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear(rows)
