"""Compile Triton kernels for GPU targets on a machine without a GPU (test helper).

Triton's interpreter accepts code its compiler rejects (and the reverse); compiling the real
kernels all the way to machine code (cubin for Hopper with the ``ptxas`` bundled in Triton's
wheel, hsaco for MI300) catches that without a GPU. Used by tests/test_triton_*.py.
"""

from __future__ import annotations

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
