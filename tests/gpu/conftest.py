"""Shared set-up of the GPU tests: float32 matmuls in IEEE precision.

The engine tests compare greedy tokens of float32 models with HF's on the same GPU. TF32
matmuls (10-bit mantissas) move logits by about 1e-2 and flip near-ties, so they stay off
for both sides, whatever an earlier import or the image's defaults chose. (An image's
``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` forces TF32 below these flags: the GPU script runs
pytest without it.)
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _ieee_float32_matmuls():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])
