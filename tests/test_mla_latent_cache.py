"""DeepSeek MLA's latent KV cache: one plane of ``kv_lora_rank + qk_rope_head_dim`` per token.

Engine level (tiny random float32 DeepSeek checkpoints of ``test_deepseek_models``, latent
16 + rope 8 = 24): each layer's cache is ``[blocks, 2, block_size, 1, 24]`` whose V plane is
its K plane (stride 0), the bytes per block count one plane, so a ``kv_cache_memory`` holds
``memory / (layers * 24 * 4)`` tokens; logits of a prefill, a decode and a chunk over the
cached prefix equal HF's on that cache with ``torch_paged`` and ``cpu_paged``; greedy tokens
through ``LLM`` equal HF's on both; a backend without ``supports_aliased_kv_planes`` gets two
planes and the same tokens; 8-bit K/V scales that differ make two planes.

Backend level: on MQA batches (one KV head, keys = values, prefill chunks over prefixes,
decodes, unwritten slots NaN) each backend's output over an aliased cache equals its output
over a two-plane cache holding the same vector twice, and both equal a dense reference:
``torch_paged``, ``cpu_paged`` with its compiled kernels (SIMD and scalar head dims, bf16
tiles) and without them, ``triton_paged`` under Triton's interpreter (a child process, as in
``test_triton_attention.py``) including the 576-wide heads whose query-head group is split
over programs. The wide-head kernel variant compiles for sm_90 within its shared memory.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import test_models_parity
import torch
from paged_attention_cases import PagedBatch, dense_attention, make_batch
from test_deepseek_models import write_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import check_parity
from triton_compile_check import (
    TARGETS,
    compile_attention_variant,
    in_interpreter,
    interpreter_parent,
    not_in_interpreter,
    run_kernel_tests,
)

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.cpu_paged import CpuPagedAttention
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core.attention import alias_kv_planes
from chassis.core.config import EngineConfig
from chassis.core.model_loader import build_model, load_hf_config

#: the tiny checkpoints' cache width: kv_lora_rank 16 + qk_rope_head_dim 8; 2 layers
LATENT, LAYERS = 24, 2
#: (cached prefix, query length): chunks over prefixes, whole prefills, decodes
MIXED = [(5, 7), (0, 20), (13, 1), (0, 1), (40, 6), (16, 16), (33, 1)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: write_checkpoint(v, tmp_path_factory.mktemp(f"mla_{v}")) for v in ("v2_lite", "v3")}


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def _llm(model_dir: Path, **engine: Any) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=256, **engine)


# -- engine level -------------------------------------------------------------------------


@not_in_interpreter
@pytest.mark.parametrize("backend", ["cpu_paged", "torch_paged"])
def test_the_cache_holds_one_latent_plane(model_dirs: dict[str, Path], backend: str) -> None:
    """The tokens a given memory holds are ``memory / (layers * 24 * 4 bytes)``; every
    layer's V plane is its K plane; wake-up's allocation keeps the layout; HF's tokens."""
    memory = 3 * 2**20
    llm = _llm(model_dirs["v3"], kv_cache_memory=memory, attention_backend=backend)
    runner = llm.engine.executor.worker.runner
    block_size = runner.block_size
    assert runner.kv_planes == 1
    assert runner.kv_cache_bytes_per_block() == LAYERS * block_size * LATENT * 4
    num_blocks = llm.engine.info.num_kv_blocks
    assert num_blocks == memory // (LAYERS * block_size * LATENT * 4)
    assert num_blocks * block_size == pytest.approx(memory / (LAYERS * LATENT * 4), abs=block_size)

    def check_layout() -> None:
        assert len(runner.kv_caches) == LAYERS
        for cache in runner.kv_caches:
            assert cache.shape == (num_blocks, 2, block_size, 1, LATENT)
            assert cache.stride(1) == 0
            assert cache[:, 1].data_ptr() == cache[:, 0].data_ptr()
        ptrs = {cache.data_ptr() for cache in runner.kv_caches}
        assert len(ptrs) == LAYERS  # one plane per layer, not one shared

    check_layout()
    runner.allocate_kv_cache(num_blocks)  # what sleep mode's wake-up calls
    check_layout()
    assert _greedy(llm) == hf_greedy(model_dirs["v3"], PROMPTS, MAX_TOKENS)
    # the written latents really are in the one plane
    assert any(cache[:, 0].abs().sum() > 0 for cache in runner.kv_caches)


@not_in_interpreter
def test_a_backend_without_the_flag_gets_two_planes(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Twice the bytes per block (half the blocks), contiguous caches, the same tokens, and
    the reason in the log."""
    monkeypatch.setattr(TorchPagedAttention, "supports_aliased_kv_planes", False)
    with caplog.at_level(logging.INFO, logger="chassis.core.model_runner"):
        llm = _llm(model_dirs["v2_lite"], num_kv_blocks=64, attention_backend="torch_paged")
    runner = llm.engine.executor.worker.runner
    assert runner.kv_planes == 2
    assert runner.kv_cache_bytes_per_block() == 2 * LAYERS * runner.block_size * LATENT * 4
    assert all(cache.is_contiguous() for cache in runner.kv_caches)
    assert "does not declare supports_aliased_kv_planes" in caplog.text
    assert _greedy(llm) == hf_greedy(model_dirs["v2_lite"], PROMPTS, MAX_TOKENS)


@not_in_interpreter
def test_an_fp8_cache_is_one_plane_unless_the_scales_differ(model_dirs: dict[str, Path]) -> None:
    """``--kv-cache-dtype fp8`` (torch_paged) keeps one plane while K and V scales are equal
    (1.0 unless set); a layer whose scales differ makes the runner choose two."""
    llm = _llm(model_dirs["v3"], num_kv_blocks=64, kv_cache_dtype="fp8")
    runner = llm.engine.executor.worker.runner
    assert runner.kv_planes == 1
    assert {(c.dtype, c.stride(1)) for c in runner.kv_caches} == {(torch.float8_e4m3fn, 0)}
    assert all(len(tokens) == MAX_TOKENS for tokens in _greedy(llm))
    runner.model.model.layers[1].self_attn.attn.backend.v_scale = 0.5
    assert runner._kv_cache_planes() == 2


class _LatentRunner(test_models_parity.Runner):
    """``Runner`` on the latent cache the engine allocates: one aliased plane per layer, of
    the model's ``hf_config`` (one KV head of 24), with :attr:`backend`."""

    backend: type = TorchPagedAttention

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.hf_config = load_hf_config(model_dir)
        config = EngineConfig(model=str(model_dir))
        self.model = build_model(config, self.hf_config, model_dir, self.backend, "cpu", dtype)
        num_blocks, block_size = test_models_parity.NUM_BLOCKS, test_models_parity.BLOCK_SIZE
        assert (self.model.hf_config.num_key_value_heads, self.model.hf_config.head_dim) == (
            1,
            LATENT,
        )
        shape = (num_blocks, 1, block_size, 1, LATENT)
        self.kv_caches = [alias_kv_planes(torch.zeros(shape, dtype=dtype)) for _ in range(LAYERS)]
        self.generator = torch.Generator().manual_seed(0)


@not_in_interpreter
@pytest.mark.parametrize(
    "backend", [TorchPagedAttention, CpuPagedAttention], ids=lambda b: b.__name__
)
@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_logits_on_the_latent_cache_match_transformers(
    model_dirs: dict[str, Path], variant: str, backend: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix: every row's float32 logits equal HF's (atol 1e-4)."""
    runner = type("Runner", (_LatentRunner,), {"backend": backend})
    monkeypatch.setattr(test_models_parity, "Runner", runner)
    check_parity(model_dirs[variant], TOKEN_PROMPTS, atol=1e-4)


# -- backend level ------------------------------------------------------------------------


def _mqa_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    unwritten_fill: float = float("nan"),
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    """One step of ``specs`` with one KV head whose values are its keys:
    ``(batch, two-plane cache, aliased cache)``, prefixes written to both, ``unwritten_fill``
    elsewhere (NaN: a kernel that multiplies a slot it must not read, even by 0, fails)."""
    batch = make_batch(
        specs,
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        block_size=4,
        dtype=dtype,
        num_pad_tokens=2,
        seed=seed,
        unwritten_fill=unwritten_fill,
    )
    contexts = [(p, q, k, k) for p, q, k, _ in batch.contexts]
    batch = dataclasses.replace(batch, value=batch.key, contexts=contexts)
    two_planes = batch.kv_cache.clone()
    two_planes[:, 1] = two_planes[:, 0]
    aliased = alias_kv_planes(batch.kv_cache[:, :1].clone())
    return batch, two_planes, aliased


def _compare_planes(backend: Any, batch: PagedBatch, two: torch.Tensor, one: torch.Tensor) -> None:
    """The backend's output on the aliased cache equals its output on two planes (and the
    dense reference); the aliased cache holds what the two-plane one's K plane holds."""
    n = batch.metadata.num_actual_tokens
    out_two = backend.forward(batch.query, batch.key, batch.value, two, batch.metadata)
    batch.metadata.derived.clear()  # (a backend's per-step memo is for one cache layout)
    out_one = backend.forward(batch.query, batch.key, batch.value, one, batch.metadata)
    torch.testing.assert_close(out_one[:n], out_two[:n], atol=1e-6, rtol=0)
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[batch.query.dtype]
    expected = dense_attention(batch, backend.scale)
    torch.testing.assert_close(out_one[:n].float(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(one[:, 0], two[:, 0], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(two[:, 1], two[:, 0], equal_nan=True, atol=0, rtol=0)


#: (head_dim, dtype): the compiled kernels' SIMD head dim in float32 and bfloat16 (tiled
#: prefills where the CPU has AVX512-BF16), a head dim they run scalar, DeepSeek's 576
CPU_SHAPES = [
    (64, torch.float32),
    (64, torch.bfloat16),
    (40, torch.float32),
    (576, torch.float32),
    (576, torch.bfloat16),
]


@not_in_interpreter
@pytest.mark.parametrize(("head_dim", "dtype"), CPU_SHAPES, ids=str)
@pytest.mark.parametrize("path", ["torch_paged", "cpu_paged", "cpu_paged_sdpa", "cpu_window"])
def test_cpu_backends_on_an_aliased_cache(head_dim: int, dtype: torch.dtype, path: str) -> None:
    """8 query heads on one KV head; ``cpu_paged_sdpa`` is ``cpu_paged`` without its
    compiled kernels, ``cpu_window`` a windowed layer (its own prefill path); a chunk over
    a prefix longer than the row kernel's limit goes to SDPA over cache rows."""
    specs = [*MIXED, (520, 3)] if head_dim == 64 else MIXED
    # (SDPA multiplies masked-out slots by 0: a large finite value there)
    fill = 1e4 if path in ("torch_paged", "cpu_paged_sdpa") else float("nan")
    batch, two, one = _mqa_batch(specs, 8, head_dim, dtype, unwritten_fill=fill)
    scale = head_dim**-0.5
    if path == "torch_paged":
        backend: Any = TorchPagedAttention(8, head_dim, 1, scale)
    elif path == "cpu_window":
        backend = CpuPagedAttention(8, head_dim, 1, scale, sliding_window=1000)
    else:
        backend = CpuPagedAttention(8, head_dim, 1, scale)
        if path == "cpu_paged_sdpa":
            backend.kernels = None
    _compare_planes(backend, batch, two, one)


@not_in_interpreter
def test_the_row_view_follows_the_strides() -> None:
    """``cpu_paged``'s rows of a contiguous cache and of an aliased one."""
    from chassis.builtin_plugins.attention.cpu_paged import cache_rows

    cache = torch.arange(3 * 2 * 4 * 2 * 5, dtype=torch.float32).view(3, 2, 4, 2, 5)
    rows, per_block, v_offset = cache_rows(cache)
    assert (per_block, v_offset, rows.shape[0]) == (8, 4, 24)
    assert torch.equal(rows[1 * 8 + 3], cache[1, 0, 3]) and torch.equal(
        rows[8 + 3 + 4], cache[1, 1, 3]
    )
    aliased = alias_kv_planes(cache[:, :1])
    rows, per_block, v_offset = cache_rows(aliased)
    assert (per_block, v_offset, rows.shape[0]) == (8, 0, 20)
    assert torch.equal(rows[2 * 8 + 1], cache[2, 0, 1])
    with pytest.raises(ValueError, match="dense"):
        cache_rows(cache.transpose(3, 4))


# -- triton_paged (under Triton's interpreter, in a child) ----------------------------------


@interpreter_parent
def test_triton_under_interpreter(request: pytest.FixtureRequest) -> None:
    """The ``in_interpreter`` tests, in the child shared with tests/test_triton_*.py."""
    output = run_kernel_tests(__file__, request)
    assert "skipped" in output, output[-2000:]  # the child skipped this file's CPU tests


@in_interpreter
@pytest.mark.parametrize(
    ("num_heads", "head_dim", "dtype"),
    [(8, 64, torch.float32), (8, 40, torch.bfloat16), (32, 576, torch.float32)],
    ids=str,
)
def test_triton_on_an_aliased_cache(num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """A head dim that is no power of two is padded and masked; at 576 a group of 32 query
    heads is split over two programs of 16."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels
    from chassis.builtin_plugins.attention.triton_paged import TritonPagedAttention

    specs = MIXED if head_dim < 256 else [(5, 7), (13, 1), (0, 3), (17, 1)]
    batch, two, one = _mqa_batch(specs, num_heads, head_dim, dtype)
    backend = TritonPagedAttention(num_heads, head_dim, 1, head_dim**-0.5)
    _compare_planes(backend, batch, two, one)
    config = kernels.choose_launch_config(
        num_heads=num_heads,
        num_kv_heads=1,
        head_dim=head_dim,
        num_tokens=8,
        num_reqs=4,
        max_query_len=1,
        max_seq_len=64,
        device=torch.device("cpu"),
    )
    expected_heads = 16 if head_dim > 256 else None
    assert config.heads_per_program == expected_heads


@in_interpreter
def test_triton_splits_a_group_over_programs_by_explicit_config() -> None:
    """Any divisor of the group as ``heads_per_program`` gives the dense answer (here 4 of a
    group of 8 heads, with and without the KV split); one that does not divide is refused."""
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    batch, _, one = _mqa_batch(MIXED, 8, 32, torch.float32, seed=3)
    kernels.write_kv_cache(batch.key, batch.value, one, batch.metadata.slot_mapping)
    n = batch.metadata.num_actual_tokens
    expected = dense_attention(batch, 0.2)
    for splits in (1, 3):
        config = kernels.LaunchConfig(32, 8, 16, splits, 4, 2, heads_per_program=4)
        out = torch.empty_like(batch.query)
        kernels.paged_attention(batch.query, one, out, config=config, **batch.kernel_args(0.2))
        torch.testing.assert_close(out[:n], expected, atol=2e-5, rtol=0)
    bad = kernels.LaunchConfig(32, 10, 16, 1, 4, 2, heads_per_program=3)
    with pytest.raises(ValueError, match="must divide the GQA group"):
        kernels.paged_attention(batch.query, one, out, config=bad, **batch.kernel_args(0.2))


@not_in_interpreter
def test_the_wide_head_variant_fits_hopper_shared_memory() -> None:
    """DeepSeek's decode and prefill variant (576 padded to 1024, 16 of 128 heads per
    program, 16-position tiles, 8 warps) compiles for sm_90 within 227 KB of shared memory
    (the whole group of 128 in one program would need ~512 KB)."""
    pytest.importorskip("triton")
    from chassis.builtin_plugins.attention import triton_paged_kernels as kernels

    config = kernels.choose_launch_config(
        num_heads=128,
        num_kv_heads=1,
        head_dim=576,
        num_tokens=64,
        num_reqs=1,
        max_query_len=64,
        max_seq_len=64,
        device=torch.device("cpu"),
    )
    assert (config.block_m, config.heads_per_program, config.tile_n) == (16, 16, 16)
    compiled = compile_attention_variant(
        TARGETS[0],
        group=128,
        head_dim=576,
        dim_pad=1024,
        block_m=config.block_m,
        tile_n=config.tile_n,
        num_warps=config.num_warps,
        heads_per_program=config.heads_per_program,
    )
    assert compiled.metadata.shared <= 227 * 1024
