"""Audio items as callers give them -> mono float32 waveforms at the model's sampling rate.

An audio item (vLLM's ``multi_modal_data={"audio": ...}``) is ``(waveform, sample_rate)``,
``waveform`` a 1-D array of float samples (``[-1, 1]``) and ``sample_rate`` in Hz, or a bare
1-D array, taken to be at the model's rate already (as vLLM takes it). Another rate is
resampled by :func:`resample`: band-limited (windowed-sinc) interpolation, the method of
torchaudio's ``resample`` that transformers' audio pipelines call (a Hann-windowed sinc
lowpass at ``0.99`` of the lower Nyquist frequency, 6 zero crossings a side), computed with
torch as a strided convolution, one output phase per filter. Neither scipy nor librosa is
needed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: the lowpass' cutoff as a fraction of the lower of the two Nyquist frequencies
ROLLOFF = 0.99
#: the filter's zero crossings on each side of its centre
ZERO_CROSSINGS = 6


def audio_waveform(item: Any, target_rate: int) -> np.ndarray:
    """The mono float32 waveform of an audio item (module docstring) at ``target_rate``;
    ``ValueError`` for anything else (a multi-channel or empty array, a bad rate)."""
    rate: Any = target_rate
    if isinstance(item, tuple | list) and len(item) == 2:
        item, rate = item
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().numpy()
    if not isinstance(item, np.ndarray):
        raise ValueError(
            "an audio item must be a (waveform, sample_rate) tuple or a 1-D numpy array of "
            f"samples; got {type(item).__name__}"
        )
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.integer) or rate <= 0:
        raise ValueError(f"an audio item's sample rate must be a number of Hz > 0; got {rate!r}")
    if item.ndim != 1:
        raise ValueError(
            f"an audio waveform must be 1-D (mono samples); got an array of shape {item.shape}"
        )
    if item.size == 0:
        raise ValueError("an audio waveform is empty")
    if not np.issubdtype(item.dtype, np.floating) and not np.issubdtype(item.dtype, np.integer):
        raise ValueError(f"an audio waveform must hold numbers; got dtype {item.dtype}")
    waveform = np.asarray(item, dtype=np.float32)
    if not np.isfinite(waveform).all():
        raise ValueError("an audio waveform holds NaN or infinite samples")
    if float(rate) != float(int(rate)):
        raise ValueError(f"an audio item's sample rate must be a whole number of Hz; got {rate}")
    return resample(waveform, int(rate), target_rate)


def resample(waveform: np.ndarray, orig_rate: int, new_rate: int) -> np.ndarray:
    """``waveform`` (1-D float) at ``new_rate``: ``ceil(len * new / orig)`` samples, band
    limited (module docstring); the same array when the rates are equal."""
    if orig_rate == new_rate:
        return waveform
    gcd = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // gcd, new_rate // gcd
    kernels, width = _sinc_kernels(orig, new)
    x = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float64))
    # output sample n*new + i sits at input time (n*orig + i*orig/new) / orig: phase i's filter
    # is centred there, so one strided convolution gives every output sample of the phase
    padded = F.pad(x[None, None], (width, width + orig))
    phases = F.conv1d(padded, kernels[:, None, :], stride=orig)  # [1, new, frames]
    out = phases[0].t().reshape(-1)
    length = -(-len(waveform) * new // orig)
    return out[:length].numpy().astype(np.float32)


def _sinc_kernels(orig: int, new: int) -> tuple[torch.Tensor, int]:
    """One filter per output phase ``[new, 2 * width + orig]`` (float64), and ``width``, the
    filter's reach in input samples on each side."""
    cutoff = min(orig, new) * ROLLOFF  # in units of the reduced rates
    width = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = torch.arange(-width, width + orig, dtype=torch.float64) / orig
    offsets = -torch.arange(new, dtype=torch.float64)[:, None] / new
    t = ((taps[None, :] + offsets) * cutoff).clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(math.pi * t) / (math.pi * t))
    return sinc * window * (cutoff / orig), width
