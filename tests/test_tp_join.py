"""The watched start-up barrier of a tensor-parallel group (``chassis.core.tp_join``), without
rank processes: the rank processes' side is in ``tests/test_tensor_parallel.py``."""

from __future__ import annotations

import pytest

from chassis.core.tp_join import arrival_path, wait_for_every_rank


def _never_called() -> None:
    raise AssertionError("watch called although every rank had arrived")


def test_the_last_rank_to_arrive_returns_at_once(tmp_path) -> None:
    (tmp_path / "arrived-0").touch()
    wait_for_every_rank(str(tmp_path), 1, 2, _never_called)
    assert (tmp_path / "arrived-1").exists()
    assert arrival_path(str(tmp_path), 1) == str(tmp_path / "arrived-1")


def test_what_the_watch_raises_ends_the_wait(tmp_path) -> None:
    calls = []

    def rank_1_exited() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("tensor-parallel rank 1 exited with code 1 during 'init'")

    with pytest.raises(RuntimeError, match="rank 1 exited with code 1"):
        wait_for_every_rank(str(tmp_path), 0, 2, rank_1_exited)
    assert len(calls) == 3
    assert (tmp_path / "arrived-0").exists()  # rank 0 had arrived


def test_ranks_that_never_arrive_time_out_by_name(tmp_path) -> None:
    (tmp_path / "arrived-1").touch()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2, 3\] did not arrive"):
        wait_for_every_rank(str(tmp_path), 0, 4, lambda: None, timeout_s=0)
