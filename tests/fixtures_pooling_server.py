"""A real ``chassis serve --runner pooling`` process on the tiny random Llama, shared by the
embedding and score route tests. A test module takes it with
``from fixtures_pooling_server import *  # noqa: F403``; it is module-scoped, so each
module starts one server and stops it (checked) after its last test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess, running_server

__all__ = ["server"]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # a token budget below the longest input: it is computed over several steps
    extra = ["--runner", "pooling", "--max-num-batched-tokens", "32"]
    with running_server(tiny_llama_dir, tmp_path_factory.mktemp("serve"), extra_args=extra) as s:
        yield s
