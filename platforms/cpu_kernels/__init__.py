"""Fused C++ kernels for the CPU platform, compiled on first use and cached.

``kernels.cpp`` defines torch ops under ``torch.ops.chassis_cpu`` (RMSNorm with the residual
add, SiLU-and-mul, rotate-half RoPE in place, paged attention over single query rows, tiled
causal attention of prefill chunks, both with an optional sliding window, logit soft cap
and attention sinks, K/V stores into the paged cache), and
``bf16_linear.cpp`` a bfloat16 linear layer on AVX512-BF16 dot products. :func:`load`
compiles them once per (sources, torch version, compiler, CPU) with the system C++ compiler
against the installed torch (one compiler process per file, ~15 s on two cores), caches the
shared library under ``$CHASSIS_CACHE_DIR/cpu_kernels`` (default ``~/.cache/chassis``), and
loads it; later processes load the cached library in milliseconds.

Every op has a torch reference that the layers use when the kernels are unavailable (no
compiler, a failed build, or ``CHASSIS_CPU_KERNELS=0``); tests compare the two.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: compiled together into one library (one op namespace, ``chassis_cpu``)
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
#: set to 0 to run the torch reference ops instead of the compiled kernels
ENV_SWITCH = "CHASSIS_CPU_KERNELS"
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``CHASSIS_CPU_KERNELS`` allows the compiled kernels (default: yes)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in {"0", "false", "no", "off"}


def _cache_dir() -> Path:
    root = os.environ.get("CHASSIS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "chassis"
    )
    return Path(root) / "cpu_kernels"


def _cpu_fingerprint() -> str:
    """The CPU's feature flags: ``-march=native`` code must not move to another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    for part in (torch.__version__.encode(), compiler.encode()):
        digest.update(part)
    digest.update(" ".join(_FLAGS).encode())
    digest.update(_cpu_fingerprint().encode())
    return digest.hexdigest()[:16]


def _run(cmd: list[str], compiler: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        errors = [ln for ln in result.stderr.splitlines() if "error" in ln][:5]
        raise RuntimeError(f"{compiler} exited with {result.returncode}: {errors}")


def _compile(compiler: str, target: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename the library into place: concurrent processes
    # (an engine core and its parent, parallel tests) may build at once; each rename is
    # atomic and the results are equal.
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [Path(work) / f"{source.stem}.o" for source in SOURCES]
        compile_cmds = [
            [
                compiler,
                *_FLAGS,
                "-c",
                "-std=c++20",
                f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                *(f"-I{p}" for p in include_paths()),
                str(source),
                "-o",
                str(obj),
            ]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        # one compiler per source file, side by side (the torch headers dominate each one)
        with ThreadPoolExecutor(max_workers=len(compile_cmds)) as pool:
            for done in [pool.submit(_run, cmd, compiler) for cmd in compile_cmds]:
                done.result()
        library = Path(work) / "lib.so"
        _run(
            [
                compiler,
                *_FLAGS,
                *(str(obj) for obj in objects),
                "-o",
                str(library),
                f"-L{torch_lib}",
                "-lc10",
                "-ltorch_cpu",
                f"-Wl,-rpath,{torch_lib}",
            ],
            compiler,
        )
        os.replace(library, target)


def _remove_other_builds(keep: Path) -> None:
    """Delete libraries of other sources/versions (a process that loaded one keeps its
    mapping; a later load of that version rebuilds it)."""
    for path in keep.parent.glob("chassis_cpu_*.so"):
        if path != keep:
            with contextlib.suppress(OSError):
                path.unlink()


@cache
def load() -> Any | None:
    """Compile (once) and load the kernels; return ``torch.ops.chassis_cpu`` or ``None``.

    ``None`` (with one warning saying why) when ``CHASSIS_CPU_KERNELS=0``, no C++ compiler is
    found, or the build fails; callers then use their torch reference path.
    """
    if not enabled():
        return None
    with _lock:
        compiler = _compiler()
        if compiler is None:
            logger.warning("no C++ compiler found: CPU kernels disabled (torch reference ops)")
            return None
        target = _cache_dir() / f"chassis_cpu_{_build_key(compiler)}.so"
        try:
            if not target.exists():
                logger.info("compiling the CPU kernels (once; cached in %s)", target.parent)
                _compile(compiler, target)
                _remove_other_builds(target)
            torch.ops.load_library(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("CPU kernels unavailable, using torch reference ops: %s", exc)
            return None
        return torch.ops.chassis_cpu
