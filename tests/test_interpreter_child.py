"""The shared ``TRITON_INTERPRET=1`` child of tests/triton_compile_check.py: each file's parent
test gets its own file's results, whatever else the child ran (tiny stand-in test files here,
no Triton kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import triton_compile_check
from triton_compile_check import UNATTRIBUTED, _run_child_with_report, file_result


def _write(directory: Path, name: str, source: str) -> str:
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_a_failure_counts_for_the_file_that_collected_it(tmp_path: Path) -> None:
    """A test function imported from a helper module is the importing file's test (the JUnit
    report's ``file`` names the helper, which no parent reads); a file that cannot be
    imported fails its own parent only."""
    _write(tmp_path, "shared_checks.py", "def test_imported():\n    assert False, 'boom'\n")
    first = _write(
        tmp_path, "test_first.py", "from shared_checks import test_imported\ndef test_ok(): pass\n"
    )
    second = _write(tmp_path, "test_second.py", "def test_ok(): pass\ndef test_ok_too(): pass\n")
    broken = _write(tmp_path, "test_broken.py", "import no_such_module_here\n")
    outcomes, output = _run_child_with_report([first, second, broken])
    with pytest.raises(AssertionError, match="boom"):
        file_result(outcomes, "test_first.py", output)
    assert file_result(outcomes, "test_second.py", output) == "2 passed"
    with pytest.raises(AssertionError, match="no_such_module_here"):
        file_result(outcomes, "test_broken.py", output)


def test_a_failure_no_file_can_be_named_for_fails_every_file() -> None:
    outcomes = {
        "test_a.py": {"passed": ["test_x"]},
        "test_b.py": {"passed": ["test_y"], "skipped": ["test_z"]},
    }
    assert file_result(outcomes, "test_b.py", "") == "1 passed, 1 skipped"
    outcomes[UNATTRIBUTED] = {"failed": ["somewhere: it broke"]}
    for name in ("test_a.py", "test_b.py"):
        with pytest.raises(AssertionError, match="somewhere: it broke"):
            file_result(outcomes, name, "")
    with pytest.raises(AssertionError, match="0 passed"):  # nothing passed is a failure too
        file_result({}, "test_a.py", "")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hung_child_names_the_test_it_hung_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hangs = _write(
        tmp_path,
        "test_hangs.py",
        "import time\ndef test_quick(): pass\ndef test_sleeps(): time.sleep(600)\n",
    )
    # (the child reaches test_sleeps ~2 s after its start on a quiet machine: a 5x margin,
    # without waiting out a longer hang guard for nothing)
    monkeypatch.setattr(triton_compile_check, "SHARED_CHILD_TIMEOUT", 10)
    monkeypatch.setattr(triton_compile_check, "_SHARED_RESULTS", {})
    request = SimpleNamespace(session=SimpleNamespace(items=[]))
    with pytest.raises(AssertionError, match=r"(?s)timed out after 10 seconds.*test_sleeps"):
        triton_compile_check._run_shared_child(hangs, request)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_test_past_its_timeout_fails_only_its_file(tmp_path: Path) -> None:
    """The project's pytest-timeout method, ``thread``, ends the whole run at a test's
    timeout (no report: every file's parent would fail); the child stops that test alone
    (the ``signal`` method) and the others' results stand. A hang the signal cannot reach
    (a C call) still ends at SHARED_CHILD_TIMEOUT."""
    _write(tmp_path, "pytest.ini", "[pytest]\ntimeout = 3\ntimeout_method = thread\n")
    hangs = _write(tmp_path, "test_hangs.py", "import time\ndef test_sleeps(): time.sleep(600)\n")
    fine = _write(tmp_path, "test_fine.py", "def test_ok(): pass\n")
    outcomes, output = _run_child_with_report([hangs, fine])
    with pytest.raises(AssertionError, match="Timeout"):
        file_result(outcomes, "test_hangs.py", output)
    assert file_result(outcomes, "test_fine.py", output) == "1 passed"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(120)
def test_a_background_child_dies_with_a_run_that_exits_at_once(tmp_path: Path) -> None:
    """A run that ends without its session-finish hook (pytest-timeout's thread method calls
    ``os._exit``; a killed run) takes its background child with it: no orphan keeps a core
    busy with interpreter work nobody reads."""
    sleeps = _write(tmp_path, "test_sleeps.py", "import time\ndef test_s(): time.sleep(600)\n")
    parent = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import triton_compile_check
        child = triton_compile_check._start_child([{sleeps!r}])
        print(child.proc.pid, flush=True)
        time.sleep(2)
        os._exit(1)
        """
    )
    run = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    pid = int(run.stdout.split()[0])

    def alive() -> bool:  # a zombie is dead, waiting for its new parent to reap it
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive():
        os.kill(pid, 9)
        pytest.fail("the background child outlived its run")


@pytest.mark.timeout(120)
def test_another_xdist_worker_reads_the_child_one_worker_started(tmp_path: Path) -> None:
    """Under pytest-xdist the worker that created the run's directory for the shared child
    starts it there (``start_shared_child_early``); another worker reads the same per-file
    results from that directory once the starting worker has published the exit status."""
    fine = _write(tmp_path, "test_fine.py", "def test_ok(): pass\ndef test_ok_too(): pass\n")
    failing = _write(tmp_path, "test_failing.py", "def test_no(): assert False, 'boom'\n")
    shared = tmp_path / "shared"
    shared.mkdir()
    child = triton_compile_check._start_child([fine, failing], workdir=shared)
    outcomes, output = triton_compile_check._wait_for_other_worker(shared, [fine, failing])
    assert file_result(outcomes, "test_fine.py", output) == "2 passed"
    with pytest.raises(AssertionError, match="boom"):
        file_result(outcomes, "test_failing.py", output)
    assert child.proc.returncode == 1
    child.published.join(timeout=10)
    child.cleanup()
    assert (shared / "report.xml").exists()  # kept: other workers read it


@pytest.mark.timeout(120)
def test_a_shared_child_that_dies_without_a_result_fails_the_other_workers_at_once(
    tmp_path: Path,
) -> None:
    """The child dies with the worker that started it (``_die_with_parent``): the other
    workers' parent tests fail at once rather than wait for the whole hang guard."""
    sleeps = _write(tmp_path, "test_sleeps.py", "import time\ndef test_s(): time.sleep(600)\n")
    shared = tmp_path / "shared"
    shared.mkdir()
    # the starting worker as it dies: the status it would publish never comes
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (shared / "pid").write_text(str(proc.pid))
    started = time.monotonic()
    proc.kill()
    proc.wait()
    with pytest.raises(AssertionError, match=rf"pid {proc.pid}\) ended without a result"):
        triton_compile_check._wait_for_other_worker(shared, [sleeps])
    assert time.monotonic() - started < 30
