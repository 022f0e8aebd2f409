"""Compile Triton kernels for GPU targets on a machine without a GPU (test helper).

Triton's interpreter accepts code its compiler rejects (and the reverse); compiling the real
kernels all the way to machine code (cubin for Hopper with the ``ptxas`` bundled in Triton's
wheel, hsaco for MI300) catches that without a GPU. Used by tests/test_triton_*.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: (backend, arch, warp size)
TARGETS = [("cuda", 90, 32), ("hip", "gfx942", 64)]


def compile_kernel(
    kernel: Any,
    target: tuple[str, Any, int],
    constexprs: dict[str, Any],
    *,
    pointer_types: dict[str, str] | None = None,
    float_args: tuple[str, ...] = (),
    num_warps: int = 4,
    aligned: bool = True,
) -> Any:
    """Compile ``kernel`` (a ``@triton.jit`` function) for ``target`` and return the result.

    Pointer args (names ending in ``_ptr``) are ``*bf16`` unless ``pointer_types`` says
    otherwise; ``float_args`` are fp32; every other runtime arg is i32.

    ``aligned``: compile what a launch compiles when every pointer and every specialized
    integer argument is divisible by 16, as model shapes make them: Triton then vectorizes
    loads and pipelines them through shared memory, a different code path from the
    unaligned one (``aligned=False``: scalar loads) that a launch with odd strides takes.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(kernel, "arg_names") or type(kernel).__name__ == "InterpretedFunction":
        pytest.skip("kernels are interpreted in this process (TRITON_INTERPRET=1)")
    pointer_types = pointer_types or {}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in float_args else "i32"
    attrs = {}
    if aligned:
        not_specialized = set(getattr(kernel, "do_not_specialize", ()))
        for index, name in enumerate(kernel.arg_names):
            if signature[name] not in ("constexpr", "fp32") and name not in not_specialized:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        source, target=GPUTarget(*target), options={"num_warps": num_warps, "num_stages": 2}
    )


#: pointer types of the ``triton_paged`` attention kernel that are not the model dtype
_ATTENTION_POINTERS = {
    **{n: "*fp32" for n in ("part_acc_ptr", "part_max_ptr", "part_sum_ptr")},
    **{
        n: "*i32"
        for n in (
            "block_table_ptr",
            "seq_lens_ptr",
            "query_start_loc_ptr",
            "attend_limit_ptr",
            "counter_ptr",
        )
    },
    "slot_mapping_ptr": "*i64",
}
#: float (not integer) runtime arguments of the ``triton_paged`` attention kernel
ATTENTION_FLOAT_ARGS = ("scale_log2", "cap_in_log2", "cap_out_log2", "k_scale", "v_scale")


def compile_attention_variant(
    target: tuple[str, Any, int],
    *,
    group: int,
    head_dim: int,
    block_m: int,
    tile_n: int,
    split: bool = False,
    fp32: bool = False,
    num_warps: int = 4,
    aligned: bool = True,
    sliding_window: bool = False,
    soft_cap: bool = False,
    sinks: bool = False,
    attend_limit: bool = False,
    heads_per_program: int | None = None,
    dim_pad: int | None = None,
    chunked: bool = False,
    fused_write: bool = False,
    fused_combine: bool = False,
    kv_cache_type: str | None = None,
) -> Any:
    """Compile one ``_paged_attention_kernel`` variant, 8 kv heads of ``group`` query heads,
    as ``paged_attention`` launches it (16-row tiles are the decode variants: one query block
    per request). ``fp32``: a float32 model; otherwise bfloat16. ``sliding_window`` /
    ``soft_cap`` / ``sinks``: the variants of layers with a window / a logit soft cap /
    attention sinks; ``attend_limit``: the variant of steps with bidirectional image blocks.
    ``heads_per_program`` (default: the group) splits a group over
    programs; ``dim_pad`` (default: ``head_dim``) pads a head dim that is no power of two.
    ``chunked``: the variant of chunked local attention (Llama 4).
    ``fused_write`` / ``fused_combine``: the fused decode variants (the step's K/V written by
    the kernel; the KV splits merged by the last split to finish, with ``split``);
    ``kv_cache_type`` (default: the model dtype): the cache pointers' type, e.g.
    ``"*fp8e4nv"`` for an 8-bit cache."""
    heads = heads_per_program or group
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    model_io = {
        n: "*fp32"
        for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr")
    }
    cache = (
        {}
        if kv_cache_type is None
        else dict.fromkeys(("k_cache_ptr", "v_cache_ptr"), kv_cache_type)
    )
    return compile_kernel(
        kernels._paged_attention_kernel,
        target,
        dict(
            NUM_HEADS=8 * group,
            GROUP=group,
            HEADS_PER_PROGRAM=heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad or head_dim,
            BLOCK_SIZE=16,
            BLOCK_Q=block_m // heads,
            BLOCK_M=block_m,
            TILE_N=tile_n,
            SPLIT_KV=split,
            DOT_FP32=fp32,
            ONE_BLOCK_PER_REQ=block_m == 16,
            SLIDING_WINDOW=sliding_window,
            SOFT_CAP=soft_cap,
            HAS_SINKS=sinks,
            HAS_LIMIT=attend_limit,
            CHUNKED=chunked,
            FUSED_WRITE=fused_write,
            FUSED_COMBINE=fused_combine,
        ),
        pointer_types={**_ATTENTION_POINTERS, **(model_io if fp32 else {}), **cache},
        float_args=ATTENTION_FLOAT_ARGS,
        num_warps=num_warps,
        aligned=aligned,
    )


def run_under_interpreter(test_file: str, timeout: float = 500, request: Any = None) -> str:
    """Run the tests of ``test_file`` in a child pytest with ``TRITON_INTERPRET=1`` (set
    before Triton is first imported, which the parent process has done) and return its
    output; fails the calling test when the child fails or passes nothing, and skips it where
    the installed Triton's interpreter cannot run the file's kernels (:func:`interpreter_runs`).

    With the calling test's ``request``, a file of :data:`SHARED_CHILD_FILES` runs in one
    child together with the other such files of this session (see
    :func:`_run_shared_child`), and the returned text is that file's part of the result.
    """
    if not interpreter_runs(test_file):
        import triton

        oldest = ".".join(map(str, _OLDEST_INTERPRETER[Path(test_file).name]))
        pytest.skip(
            f"Triton {triton.__version__}'s interpreter cannot run these kernels (< {oldest})"
        )
    if request is not None and Path(test_file).name in SHARED_CHILD_FILES:
        return _run_shared_child(test_file, request)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-x", "-p", "no:cacheprovider"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


#: Test files whose interpreter tests share one child pytest: each child imports torch, Triton
#: and the package again, several seconds on a 2-core machine, so a whole-suite run starts
#: one instead of one per file.
SHARED_CHILD_FILES = (
    "test_attend_limit.py",
    "test_fp8_kv_cache.py",
    "test_mla_latent_cache.py",
    "test_triton_attention.py",
    "test_triton_gemv.py",
    "test_triton_int4.py",
    "test_triton_moe.py",
    "test_triton_moe_bias.py",
    "test_triton_ops.py",
)
#: the oldest Triton (major, minor) whose interpreter runs a file's kernels, where it is not
#: every version: Triton 3.6's interpreter (the H200 image's) holds a runtime scalar, a
#: kernel argument or a loaded value, as a 1-element array, and a loop over ``range()`` of
#: one fails ("only 0-dimensional arrays can be converted to Python scalars"), as in the
#: attention kernel and the fused-MoE kernels (their loops over the hidden and intermediate
#: dims). 3.7.1, 3.8.0 and 3.9.0 run the attention kernel (checked 2026-11-30), 3.9.0 the
#: MoE kernels. Compiled for a GPU, 3.6 builds every kernel (the compile tests; checked
#: 2026-12-01 with torch 2.11, docs/gpu.md). The GEMV's split-K loop is a ``range()`` over
#: bounds computed from the program id (not run under 3.6; assumed to fail the same way).
_OLDEST_INTERPRETER = {
    "test_attend_limit.py": (3, 7),
    "test_fp8_kv_cache.py": (3, 7),
    "test_triton_attention.py": (3, 7),
    "test_triton_gemv.py": (3, 7),
    "test_triton_moe.py": (3, 7),
    "test_triton_moe_bias.py": (3, 7),
}
#: shared children started ahead of their first parent test (:func:`start_shared_child_early`)
_STARTED: dict[tuple[str, ...], _Child] = {}
#: shared children that another pytest-xdist worker of the run started: where it publishes
#: their results (:func:`_wait_for_other_worker`)
_OTHER_WORKERS: dict[tuple[str, ...], Path] = {}
#: the threads that publish those children's exit status (:func:`_publish_returncode`)
_PUBLISHING: list[threading.Thread] = []
#: the shared child's results, keyed by the tuple of files it ran
_SHARED_RESULTS: dict[tuple[str, ...], tuple[dict[str, dict[str, list[str]]], str]] = {}
#: a hang guard for the shared child (the parent test's own timeout mark must exceed it)
SHARED_CHILD_TIMEOUT = 1500
#: the key of a shared child's results that no one file can be named for (every file's
#: parent test fails on a failure there)
UNATTRIBUTED = ""

#: whether this process is the ``TRITON_INTERPRET=1`` child that runs the kernel tests
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: marks a kernel test: it runs only in the child that its file's parent test (marked
#: :func:`interpreter_parent`) starts
in_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of its file's parent test"
)
#: marks a test of the parent process only (a parent test, a compile test, a check of the
#: compiled path): the child runs the kernel tests
not_in_interpreter = pytest.mark.skipif(
    INTERPRETED, reason="the TRITON_INTERPRET=1 child runs the kernel tests only"
)


def interpreter_parent(test: Any) -> Any:
    """Marks a file's parent test (a ``test_*_under_interpreter``, whose body is
    :func:`run_kernel_tests`): not run in the child, and a hang guard past the shared
    child's :data:`SHARED_CHILD_TIMEOUT`."""
    return not_in_interpreter(pytest.mark.timeout(SHARED_CHILD_TIMEOUT + 60)(test))


def run_kernel_tests(test_file: str, request: Any) -> str:
    """The body of ``test_file``'s parent test: skips without Triton, else runs the file's
    :data:`in_interpreter` tests with :func:`run_under_interpreter` (``request``: the parent
    test's) and returns what it returns."""
    pytest.importorskip("triton")
    return run_under_interpreter(test_file, request=request)


def interpreter_runs(test_file: str) -> bool:
    """Whether the installed Triton's interpreter runs the kernels of ``test_file``."""
    import triton

    oldest = _OLDEST_INTERPRETER.get(Path(test_file).name, (0, 0))
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= oldest


def _shared_key(here: Path, items: Any) -> tuple[str, ...]:
    """The files one shared child runs for the parent test of ``here``: ``here`` and every
    other :data:`SHARED_CHILD_FILES` file beside it among the run's ``items``, those whose
    kernels the interpreter runs."""
    collected = {Path(item.path).resolve() for item in items}
    files = {here} | {
        path for path in collected if path.name in SHARED_CHILD_FILES and path.parent == here.parent
    }
    return tuple(sorted(str(path) for path in files if interpreter_runs(str(path))))


def start_shared_child_early(items: Any, config: Any = None) -> None:
    """Start the shared child now, in the background, when ``items`` (a run's collected
    tests) hold a parent test of a :data:`SHARED_CHILD_FILES` file; its first parent test
    then waits for its results instead of starting it.

    The child is single-threaded interpreter work (~100 s on the 2-core CI machine) while
    the tests before its first parent mostly keep one core busy, so the two overlap. Called
    by tests/conftest.py once collection is done (``config``: the run's, whose pytest-xdist
    workers then share one child: :func:`_xdist_shared_dir`); :func:`stop_unused_children`
    ends a child no parent test read (a run stopped early)."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # the child itself
        return
    parents = [
        Path(item.path).resolve()
        for item in items
        if Path(item.path).name in SHARED_CHILD_FILES and item.name.endswith("_under_interpreter")
    ]
    if not parents or importlib.util.find_spec("triton") is None:
        return
    key = _shared_key(parents[0], items)
    if not key or key in _STARTED or key in _SHARED_RESULTS or key in _OTHER_WORKERS:
        return
    # Under pytest-xdist every worker collects every test, so each would start the same
    # child (~70 s of interpreter work each, the parent tests spread over both workers):
    # the first worker to create the run's directory for it starts it, the others read
    # its results from there.
    shared = _xdist_shared_dir(config, key) if config is not None else None
    if shared is None:
        _STARTED[key] = _start_child(list(key))
        return
    try:
        shared.mkdir()
    except FileExistsError:
        _OTHER_WORKERS[key] = shared
        return
    _STARTED[key] = _start_child(list(key), workdir=shared)


def _xdist_shared_dir(config: Any, key: tuple[str, ...]) -> Path | None:
    """Under pytest-xdist, the directory of this run where the worker that starts the shared
    child of ``key`` leaves its output for the others: beside the workers' own temporary
    directories, in the run's ``--basetemp`` (pytest's retention of old runs removes it).
    ``None`` outside xdist (or without a base temporary directory)."""
    basetemp = config.getoption("basetemp", None)
    if not os.environ.get("PYTEST_XDIST_WORKER") or not basetemp:
        return None
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    return Path(basetemp).parent / f"triton-interpreter-{digest}"


def stop_unused_children(interrupted: bool = False) -> None:
    """Kill the children :func:`start_shared_child_early` started that no parent test read.

    A child whose results other xdist workers read (:data:`_OTHER_WORKERS` there) is waited
    for instead, unless the run was ``interrupted``: this worker can finish its share of the
    run before another worker reaches a parent test, and the child dies with this process."""
    while _STARTED:
        _, started = _STARTED.popitem()
        if started.published and not interrupted:
            with contextlib.suppress(subprocess.TimeoutExpired):
                started.proc.wait(timeout=max(0.0, started.deadline - time.monotonic()))
        if started.proc.poll() is None:
            started.proc.kill()
            started.proc.wait()
        started.cleanup()
    for thread in _PUBLISHING:  # (a child read here: its status may still be on its way)
        thread.join(timeout=10)


def _run_shared_child(test_file: str, request: Any) -> str:
    """One child pytest for every :data:`SHARED_CHILD_FILES` file this session collected
    (and whose kernels the interpreter runs), started when collection ended
    (:func:`start_shared_child_early`) or else by the first of their parent tests;
    ``test_file``'s tests must have passed there (at least one) and failed nowhere.

    Returns ``"N passed, M skipped"`` for ``test_file`` (pytest's words: no skip count when
    none was skipped)."""
    here = Path(test_file).resolve()
    key = _shared_key(here, request.session.items)
    if key not in _SHARED_RESULTS:
        try:
            if key in _OTHER_WORKERS:
                _SHARED_RESULTS[key] = _wait_for_other_worker(_OTHER_WORKERS[key], list(key))
            else:
                started = _STARTED.pop(key, None) or _start_child(list(key))
                _SHARED_RESULTS[key] = _finish_child(started)
        except subprocess.TimeoutExpired as hung:
            # what it printed so far (-v: the test it hung in is the last one named)
            partial = hung.stdout or ""
            if isinstance(partial, bytes):
                partial = partial.decode(errors="replace")
            _SHARED_RESULTS[key] = ({}, f"the shared interpreter child broke: {hung}\n{partial}")
        except AssertionError as broken:
            # kept, so that the other files' parent tests fail at once instead of rerunning it
            _SHARED_RESULTS[key] = ({}, f"the shared interpreter child broke: {broken}")
    outcomes, output = _SHARED_RESULTS[key]
    return file_result(outcomes, here.name, output)


def file_result(outcomes: dict[str, dict[str, list[str]]], name: str, output: str) -> str:
    """``"N passed, M skipped"`` for the file ``name`` of a shared child's ``outcomes``
    (:func:`_run_child_with_report`); an ``AssertionError`` with the failures and the end of
    ``output`` when a test of that file failed, a failure no file could be named for
    (:data:`UNATTRIBUTED`) was reported, or the file passed nothing."""
    mine = outcomes.get(name, {})
    passed, failed, skipped = (mine.get(kind, []) for kind in ("passed", "failed", "skipped"))
    failed = [*failed, *outcomes.get(UNATTRIBUTED, {}).get("failed", [])]
    summary = f"{len(passed)} passed" + (f", {len(skipped)} skipped" if skipped else "")
    assert not failed and passed, "\n\n".join([summary, *failed, output[-4000:]])
    return summary


def _run_child_with_report(files: list[str]) -> tuple[dict[str, dict[str, list[str]]], str]:
    """Run ``files`` in one ``TRITON_INTERPRET=1`` child pytest; returns each file's test
    names by outcome (``failed`` holds the failure texts) and the child's output.

    A test belongs to the file its node id names (the report's ``classname``), not the one
    that defines its function (the report's ``file``: a test imported from a helper module
    would be another file's). A result no file of ``files`` can be named for is kept under
    :data:`UNATTRIBUTED`, which every file's result includes (:func:`file_result`)."""
    return _finish_child(_start_child(files))


#: files of a shared child's directory: its JUnit report, its output, its pid, and its exit
#: status once it has ended (written by the worker that started it, for the others)
_REPORT, _OUTPUT, _PID, _RETURNCODE = "report.xml", "output.txt", "pid", "returncode"


@dataclass
class _Child:
    """A started child pytest (:func:`_start_child`): its output goes to a file, not a pipe,
    so that a child nobody reads yet never blocks on a full pipe."""

    proc: subprocess.Popen
    files: list[str]
    workdir: Path
    deadline: float
    #: removes ``workdir`` (nothing for a directory other xdist workers read)
    cleanup: Callable[[], None]
    #: the thread that writes the exit status for other xdist workers, if they read it
    published: threading.Thread | None = None

    @property
    def report(self) -> Path:
        return self.workdir / _REPORT

    @property
    def output(self) -> str:
        return (self.workdir / _OUTPUT).read_text(errors="replace")


def _die_with_parent() -> Any:
    """A ``preexec_fn`` that has the child killed when the run that started it ends without
    :func:`stop_unused_children` (pytest-timeout's thread method ends a hung run with
    ``os._exit``; a background child nobody reads would go on for minutes). ``None`` off
    Linux. libc is loaded here, before the fork: the forked child only makes the call."""
    if sys.platform != "linux":
        return None
    import ctypes
    import signal

    prctl, pr_set_pdeathsig = ctypes.CDLL(None, use_errno=True).prctl, 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)


def _start_child(files: list[str], workdir: Path | None = None) -> _Child:
    """Start the ``TRITON_INTERPRET=1`` child pytest of ``files`` (see
    :func:`_run_child_with_report`); :func:`_finish_child` waits for it. With ``workdir``
    (a directory other xdist workers read: :func:`_wait_for_other_worker`) the child writes
    there and its pid and, once it ends, its exit status are published there; otherwise in a
    temporary directory removed once it has been read."""
    if workdir is None:
        temporary = tempfile.TemporaryDirectory()
        workdir, cleanup = Path(temporary.name), temporary.cleanup
    else:
        cleanup = _keep
    command = [
        *(sys.executable, "-m", "pytest", *files, "-v", "-p", "no:cacheprovider"),
        *(f"--junitxml={workdir / _REPORT}", "-o", "junit_family=xunit1"),
        # a file that cannot be imported fails its own parent, not the others
        "--continue-on-collection-errors",
        # a test past its timeout fails alone (the project's thread method would end the
        # run, every parent failing); a C call the signal cannot stop still ends at
        # SHARED_CHILD_TIMEOUT
        *("-o", "timeout_method=signal"),
    ]
    with open(workdir / _OUTPUT, "w") as output:
        proc = subprocess.Popen(
            command,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            cwd=Path(__file__).resolve().parents[1],
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent(),
        )
    child = _Child(proc, files, workdir, time.monotonic() + SHARED_CHILD_TIMEOUT, cleanup)
    if cleanup is _keep:
        _write_atomically(workdir / _PID, str(proc.pid))
        child.published = threading.Thread(
            target=_publish_returncode, args=(proc, workdir), daemon=True
        )
        child.published.start()
        _PUBLISHING.append(child.published)
    return child


def _keep() -> None:
    """The ``cleanup`` of a directory other xdist workers read: it stays (pytest's
    retention of old base temporary directories removes it)."""


def _write_atomically(path: Path, text: str) -> None:
    """Write ``path`` so that another process sees it whole or not at all."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _publish_returncode(proc: subprocess.Popen, workdir: Path) -> None:
    """(A thread of the worker that started a shared child) Write its exit status to
    ``workdir`` once it ends, after its report, for the other workers."""
    _write_atomically(workdir / _RETURNCODE, str(proc.wait()))


def _wait_for_other_worker(workdir: Path, files: list[str]) -> tuple[dict[str, Any], str]:
    """The results of the shared child of ``files`` that another xdist worker started with
    ``workdir``, as :func:`_finish_child` returns them, once it has ended: waits until its
    exit status is there (``subprocess.TimeoutExpired`` with its output after
    :data:`SHARED_CHILD_TIMEOUT`, the child then killed), failing at once if it died without
    one (its worker died, taking it along: :func:`_die_with_parent`)."""
    deadline = time.monotonic() + SHARED_CHILD_TIMEOUT
    returncode = workdir / _RETURNCODE

    def output() -> str:
        path = workdir / _OUTPUT
        return path.read_text(errors="replace") if path.exists() else ""

    while not returncode.exists():
        pid = int((workdir / _PID).read_text()) if (workdir / _PID).exists() else None
        if pid is None and time.monotonic() > deadline - SHARED_CHILD_TIMEOUT + 120:
            # (its worker writes the pid right after creating the directory)
            raise AssertionError(f"no shared child started in {workdir}")
        if pid is not None and not _alive(pid):
            time.sleep(2)  # its worker writes the status right after reaping it
            if returncode.exists():
                break
            raise AssertionError(f"the shared child (pid {pid}) ended without a result\n{output()}")
        if time.monotonic() > deadline:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired("shared child", SHARED_CHILD_TIMEOUT, output=output())
        time.sleep(0.5)
    return _read_report(workdir, files, int(returncode.read_text()), output())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie too: its parent reaps it at once)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _finish_child(started: _Child) -> tuple[dict[str, dict[str, list[str]]], str]:
    """Wait for ``started`` (until :data:`SHARED_CHILD_TIMEOUT` after it started: then it is
    killed and ``subprocess.TimeoutExpired`` carries what it printed) and read its report,
    as :func:`_run_child_with_report` returns it."""
    try:
        try:
            started.proc.wait(timeout=max(0.0, started.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            started.proc.kill()
            started.proc.wait()
            raise subprocess.TimeoutExpired(
                started.proc.args, SHARED_CHILD_TIMEOUT, output=started.output
            ) from None
        return _read_report(started.workdir, started.files, started.proc.returncode, started.output)
    finally:
        started.cleanup()


def _read_report(
    workdir: Path, files: list[str], returncode: int, output: str
) -> tuple[dict[str, dict[str, list[str]]], str]:
    """A finished child's results (:func:`_finish_child`) from its report in ``workdir``."""
    import xml.etree.ElementTree as ET

    report = workdir / _REPORT
    # 0: all passed; 1: some failed (reported per file below); else the run itself broke
    assert returncode in (0, 1) and report.exists(), output[-6000:]
    stems = {Path(file).stem: Path(file).name for file in files}
    outcomes: dict[str, dict[str, list[str]]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        # "tests.test_triton_moe[.Class]" for a test; "" (name: the module) for a
        # collection error
        module_parts = (case.get("classname") or name).split(".")
        owners = [stems[part] for part in module_parts if part in stems]
        by_kind = outcomes.setdefault(owners[0] if len(owners) == 1 else UNATTRIBUTED, {})
        problems = [child for child in case if child.tag in ("failure", "error")]
        if problems:
            texts = [
                f"{name}: {child.get('message', '')}\n{child.text or ''}" for child in problems
            ]
            by_kind.setdefault("failed", []).extend(texts)
        elif any(child.tag == "skipped" for child in case):
            by_kind.setdefault("skipped", []).append(name)
        else:
            by_kind.setdefault("passed", []).append(name)
    return outcomes, output
