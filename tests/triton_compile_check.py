"""Compile Triton kernels for GPU targets on a machine without a GPU (test helper).

Triton's interpreter accepts code its compiler rejects (and the reverse); compiling the real
kernels all the way to machine code (cubin for Hopper with the ``ptxas`` bundled in Triton's
wheel, hsaco for MI300) catches that without a GPU. Used by tests/test_triton_*.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
    **{n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr")},
}


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
) -> Any:
    """Compile one ``_paged_attention_kernel`` variant, 8 kv heads of ``group`` query heads,
    as ``paged_attention`` launches it (16-row tiles are the decode variants: one query block
    per request). ``fp32``: a float32 model; otherwise bfloat16. ``sliding_window`` /
    ``soft_cap`` / ``sinks``: the variants of layers with a window / a logit soft cap /
    attention sinks."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    model_io = {n: "*fp32" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    return compile_kernel(
        kernels._paged_attention_kernel,
        target,
        dict(
            NUM_HEADS=8 * group,
            GROUP=group,
            HEAD_DIM=head_dim,
            DIM_PAD=head_dim,
            BLOCK_SIZE=16,
            BLOCK_Q=block_m // group,
            BLOCK_M=block_m,
            TILE_N=tile_n,
            SPLIT_KV=split,
            DOT_FP32=fp32,
            ONE_BLOCK_PER_REQ=block_m == 16,
            SLIDING_WINDOW=sliding_window,
            SOFT_CAP=soft_cap,
            HAS_SINKS=sinks,
        ),
        pointer_types={**_ATTENTION_POINTERS, **(model_io if fp32 else {})},
        float_args=("scale_log2", "cap_in_log2", "cap_out_log2"),
        num_warps=num_warps,
        aligned=aligned,
    )


def run_under_interpreter(test_file: str, timeout: float = 500) -> str:
    """Run the tests of ``test_file`` in a child pytest with ``TRITON_INTERPRET=1`` (set
    before Triton is first imported, which the parent process has done) and return its
    output; fails the calling test when the child fails or passes nothing."""
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
