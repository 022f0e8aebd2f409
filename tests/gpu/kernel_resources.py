"""Registers, spills and shared memory of the ``triton_paged`` kernel variants on Hopper.

Not a test, and no GPU needed: each variant is compiled for sm_90 as a launch at model
shapes compiles it (``tests/triton_compile_check.py``, pointers and strides divisible by
16 unless marked unaligned), and ``cuobjdump`` from Triton's wheel reads the cubin's
resource usage. Registers per thread bound how many programs a multiprocessor holds
(65,536 registers per SM), which matters for the memory-bound decode. Run from the
repository root::

    python tests/gpu/kernel_resources.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers

from triton_compile_check import compile_attention_variant

#: (name, group, head_dim, block_m, tile_n, split, warps, aligned, fused): Qwen3-0.6B's GQA
#: group; ``fused``: the K/V write (and, split, the merge) in the kernel
#: (CHASSIS_FUSED_DECODE_ATTENTION=1)
VARIANTS = [
    ("decode", 2, 128, 16, 32, False, 4, True, False),
    ("decode, split KV", 2, 128, 16, 32, True, 4, True, False),
    ("decode, fused", 2, 128, 16, 32, False, 4, True, True),
    ("decode, split, fused", 2, 128, 16, 32, True, 4, True, True),
    ("decode, tile 64", 2, 128, 16, 64, False, 4, True, False),
    ("decode, 8 warps", 2, 128, 16, 32, False, 8, True, False),
    ("decode, unaligned", 2, 128, 16, 32, False, 4, False, False),
    ("prefill", 2, 128, 64, 64, False, 8, True, False),
]


def resource_usage(compiled) -> str:
    """cuobjdump's ``REG:... SHARED:...`` line of a compiled kernel's cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    return " ".join(line.strip() for line in out.splitlines() if "REG:" in line)


def main() -> None:
    print("variant                 dynamic shared  cuobjdump -res-usage")
    for name, group, head_dim, block_m, tile_n, split, warps, aligned, fused in VARIANTS:
        compiled = compile_attention_variant(
            ("cuda", 90, 32),
            group=group,
            head_dim=head_dim,
            block_m=block_m,
            tile_n=tile_n,
            split=split,
            num_warps=warps,
            aligned=aligned,
            fused_write=fused,
            fused_combine=fused and split,
        )
        shared = compiled.metadata.shared
        print(f"{name:22s}  {shared:>8d} B      {resource_usage(compiled)}")


if __name__ == "__main__":
    main()
