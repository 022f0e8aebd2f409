"""Shared fixtures: tiny random-weight checkpoints, the embedded SmolLM2 model, tokenizers."""

import os

# Tests run engine child processes beside the test process on 2 cores; OpenMP threads that
# spin while another process holds the other core make tiny-model steps ~30x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

# Session fixtures are registered here, once: a fixture imported into a test module is that
# module's own (pytest keeps one FixtureDef, and so one cached value, per module that defines
# it), so a session fixture imported into N modules ran N times (SmolLM2's tokenizer
# extraction ~15 s each). Test modules take these from here and import only helpers.
from fixtures_classify import tiny_llama_cls_dir, tiny_qwen2_cls_dir, tiny_qwen3_cls_dir  # noqa: F401
from fixtures_models import *  # noqa: F403
from fixtures_pooling_server import pooling_server  # noqa: F401  (one server for the run)
from fixtures_threads import *  # noqa: F403
from fixtures_tokenizer import *  # noqa: F403


@pytest.fixture(autouse=True)
def _restore_recursion_limit():
    """Each test starts at the interpreter's recursion limit as the run found it: an
    in-process ``torch.compile`` (Inductor) raises the limit to 2000 for good, which would
    change what a later test sees of anything that depends on it (the structured-output
    compilers no longer do: they count their own nesting, tests/test_structured_nesting.py)."""
    import sys

    limit = sys.getrecursionlimit()
    yield
    sys.setrecursionlimit(limit)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared Triton interpreter child in the background once the run's tests are
    known (tests/triton_compile_check.py, :func:`start_shared_child_early`)."""
    option = session.config.option
    if option.collectonly or option.setupplan or option.setuponly:
        return
    import triton_compile_check

    triton_compile_check.start_shared_child_early(session.items, session.config)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A background child no parent test read (the run stopped before one) is ended; one
    that another pytest-xdist worker may still read is waited for, unless the run was
    interrupted or stopped at a failure (``-x``)."""
    import triton_compile_check

    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or bool(
        session.shouldstop or session.shouldfail
    )
    triton_compile_check.stop_unused_children(interrupted)
