"""``one_torch_thread``: run a test module's tiny models on one intra-op thread."""

from __future__ import annotations

import pytest
import torch

__all__ = ["one_torch_thread"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and OpenMP threads that spin-wait for a busy
    second core make them ~30x slower on the shared 2-core test machine. Restores the
    previous count afterwards (``OMP_NUM_THREADS``, set in conftest, may be overridden)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)
