"""A real ``chassis serve --runner pooling`` process on the tiny random Llama, shared by the
embedding and score route tests. A test module takes it with
``from fixtures_pooling_server import *  # noqa: F403`` (its ``server`` fixture).

One process serves every such module of a run: ``pooling_server``, which tests/conftest.py
registers, is session-scoped (a fixture in a conftest is one fixture for the whole run; the
same one imported into two test modules would be two). Its tests only send requests and wait
for the engine to be idle again, so none sees another's state. It is stopped (checked: a
clean SIGTERM exit) at the end of the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess, running_server

__all__ = ["server"]


@pytest.fixture(scope="session")
def pooling_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # a token budget below the longest input: it is computed over several steps
    extra = ["--runner", "pooling", "--max-num-batched-tokens", "32"]
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve"), extra_args=extra) as s:
        yield s


@pytest.fixture(scope="module")
def server(pooling_server: ServerProcess) -> ServerProcess:
    """The run's pooling server, idle (no request running or waiting, no KV block in use)."""
    pooling_server.wait_idle()
    return pooling_server
