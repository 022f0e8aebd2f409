"""Peak host memory while a 4-bit AWQ checkpoint loads, packed and dequantized
(docs/models.md, "4-bit layers kept packed").

Not a test (tests/test_int4_packed.py runs :func:`measure` on a smaller model)::

    python tests/perf/int4_load_peak.py [LAYERS] [FOLDER]

writes (to ``FOLDER``, reused when it holds one already; default a temporary folder) a
random Llama (hidden 1024, MLP 2816, ``LAYERS`` decoder layers, default 8, vocabulary
4096) quantized to AWQ 4-bit in groups of 128, then builds the model in bfloat16 on the CPU
(``build_model``, no engine) in a fresh process per mode: ``--int4-weights dequantized`` and
``packed``. Each process resets its peak resident set size (``/proc/self/clear_refs``) just
before the build and prints the peak's rise over the resident size then (``VmHWM - VmRSS``:
the tensors the build allocates, plus the checkpoint file's pages it maps and reads, the same
in both modes), that rise less the file's size, and the bytes of the built model's tensors. glibc's mmap threshold is fixed
(``MALLOC_MMAP_THRESHOLD_``) so that freed weights go back to the system at once, as a GPU
allocator's would be reused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def write_checkpoint(
    directory: Path, layers: int, hidden: int = 1024, mlp: int = 2816, vocab: int = 4096
) -> Path:
    """A random Llama of ``layers`` layers in AWQ 4-bit (group size 128) in ``directory``;
    returns the quantized checkpoint's folder."""
    sys.path.insert(0, str(TESTS))
    from test_int4_checkpoints import Scheme, write_int_twins
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    source = directory / "source"
    LlamaForCausalLM(config).save_pretrained(source)
    quantized, twin, _ = write_int_twins(source, directory, Scheme("awq", group_size=128))
    for file in twin.glob("*.safetensors"):  # not needed: the dequantized twin
        file.unlink()
    return quantized


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _child(checkpoint: str, mode: str) -> None:
    """Build the model in this process and print the figures as JSON."""
    import gc

    from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
    from chassis.core.config import EngineConfig
    from chassis.core.layers.int4_linear import Int4Linear
    from chassis.core.model_loader import build_model, load_hf_config

    hf_config = load_hf_config(checkpoint)
    config = EngineConfig(model=checkpoint, int4_weights=mode)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    model = build_model(config, hf_config, checkpoint, TorchPagedAttention, "cpu", torch.bfloat16)
    peak = _status("VmHWM") - before
    tensors = list(model.parameters()) + list(model.buffers())
    file_bytes = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    print(
        json.dumps(
            {
                "mode": mode,
                "peak_rise": peak,
                # the file's pages are mapped and read whole in either mode
                "peak_less_file": peak - file_bytes,
                "file_bytes": file_bytes,
                "model_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "packed_layers": sum(isinstance(m, Int4Linear) for m in model.modules()),
            }
        )
    )


def measure(checkpoint: Path, mode: str) -> dict[str, int]:
    """Build ``checkpoint`` with ``--int4-weights mode`` in a fresh process; its figures."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, __file__, "--child", str(checkpoint), mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tmp)
        checkpoint = folder / "packed"
        if not (checkpoint / "config.json").exists():
            checkpoint = write_checkpoint(folder, layers)
        dense = measure(checkpoint, "dequantized")
        print(
            f"{layers} layers; checkpoint file {dense['file_bytes'] / MIB:.1f} MiB; "
            f"model with 16-bit weights {dense['model_bytes'] / MIB:.1f} MiB"
        )
        for figures in (dense, measure(checkpoint, "packed")):
            print(
                f"--int4-weights {figures['mode']:<11}: "
                f"peak rise {figures['peak_rise'] / MIB:6.1f} MiB "
                f"(less the file: {figures['peak_less_file'] / MIB:6.1f} MiB), "
                f"model {figures['model_bytes'] / MIB:6.1f} MiB, "
                f"{figures['packed_layers']} layers packed"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3])
    else:
        main()
