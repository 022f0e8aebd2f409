"""The per-request recurrent-state pool in production: its dtypes (``--mamba-cache-dtype`` /
``--mamba-ssm-cache-dtype``, the model's dtype by default as in vLLM and HF), a clear error
when it does not fit (a fixed budget, a model without attention layers, a failed
allocation), its size in the start-up log, sleep mode freeing it and waking it up zeroed,
and the runner asking the model (not its config) whether there is a KV cache to shape.
Tiny random-weight Mamba2 and Granite-4.0-H checkpoints (tests/test_mamba2_models.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fixtures_models import save_tiny_checkpoint
from state_space_helpers import StateRunner
from test_mamba2_models import mamba2_checkpoint, tiny_config

from chassis import LLM, SamplingParams
from chassis.core.config import MAMBA_CACHE_DTYPES, EngineConfig
from chassis.core.request_state_cache import (
    STATE_CACHE_DTYPES,
    RequestStatePool,
    RequestStateSpec,
    resolve_state_specs,
)
from chassis.serve.args import engine_config_from_args
from chassis.serve.cli import build_parser

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time there was", "1 2 3 4"]
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SMALL = {"max_model_len": 64, "num_kv_blocks": 32}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tests/test_mamba2_models.py's checkpoints (the same directories in one run)."""
    return {
        arch: mamba2_checkpoint(tmp_path_factory, arch) for arch in ("mamba2", "granite_moe_rope")
    }


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def pool_of(llm: LLM) -> RequestStatePool:
    pool = llm.engine.executor.worker.runner.request_states
    assert pool is not None
    return pool


# -- dtypes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cache", "ssm", "expected"),
    [
        ("auto", "auto", (BF16, BF16, F32)),
        ("float32", "auto", (F32, F32, F32)),
        ("auto", "float32", (BF16, F32, F32)),
        ("float16", "bfloat16", (F16, BF16, F32)),
        ("bfloat16", "auto", (BF16, BF16, F32)),
    ],
)
def test_the_flags_choose_the_dtypes_of_conv_and_ssm_states(
    cache: str, ssm: str, expected: tuple[torch.dtype, ...]
) -> None:
    """vLLM's semantics: ``auto`` keeps the declared (model) dtype, the SSM flag falls back
    on the cache flag; a spec without a kind keeps its dtype whatever the flags say."""
    specs = [
        RequestStateSpec("l0.conv", (4, 3), BF16, kind="conv"),
        RequestStateSpec("l0.ssm", (2, 4, 8), BF16, kind="ssm"),
        RequestStateSpec("l1.other", (5,), F32),  # (a spec written before kinds existed)
    ]
    resolved = resolve_state_specs(specs, cache, ssm)
    assert tuple(spec.dtype for spec in resolved) == expected
    assert [(s.name, s.shape, s.kind) for s in resolved] == [
        (s.name, s.shape, s.kind) for s in specs
    ]


def test_bad_dtype_values_are_refused() -> None:
    assert tuple(STATE_CACHE_DTYPES) == MAMBA_CACHE_DTYPES
    with pytest.raises(ValueError, match="--mamba-ssm-cache-dtype must be one of auto"):
        resolve_state_specs([], "auto", "fp8")
    with pytest.raises(ValueError, match="--mamba-cache-dtype must be one of"):
        EngineConfig(model="m", mamba_cache_dtype="float64")
    with pytest.raises(ValueError, match="kind must be one of conv, ssm"):
        RequestStateSpec("x", (1,), F32, kind="state")
    args = build_parser().parse_args(
        ["serve", "m", "--mamba-cache-dtype", "bfloat16", "--mamba-ssm-cache-dtype", "float32"]
    )
    config = engine_config_from_args(args)
    assert (config.mamba_cache_dtype, config.mamba_ssm_cache_dtype) == ("bfloat16", "float32")
    assert EngineConfig(model="m").mamba_ssm_cache_dtype == "auto"


def test_a_bfloat16_model_keeps_its_states_in_bfloat16_unless_told(
    model_dirs: dict[str, Path],
) -> None:
    """By default both states are bfloat16 (HF's and vLLM's default), half the bytes of
    float32 ones; ``--mamba-ssm-cache-dtype float32`` keeps the SSM state in float32, and
    ``--mamba-cache-dtype float32`` both. Every setting generates; the first token (from a
    prefill that starts at zero states, computed in float32) is the same in all."""
    settings = {
        "auto": ({}, [BF16, BF16]),
        "ssm-f32": ({"mamba_ssm_cache_dtype": "float32"}, [BF16, F32]),
        "all-f32": ({"mamba_cache_dtype": "float32"}, [F32, F32]),
    }
    per_slot, tokens = {}, {}
    for label, (flags, dtypes) in settings.items():
        llm = LLM(str(model_dirs["mamba2"]), dtype="bfloat16", **SMALL, **flags)
        pool = pool_of(llm)
        # three Mamba2 layers: conv then SSM state each
        assert [t.dtype for t in pool.tensors] == dtypes * 3
        per_slot[label] = pool.bytes_per_slot
        tokens[label] = greedy(llm)
        llm.shutdown()
    assert per_slot["all-f32"] == 2 * per_slot["auto"] > per_slot["ssm-f32"] > per_slot["auto"]
    for got in tokens.values():
        assert [len(t) for t in got] == [6] * len(PROMPTS)
        assert [t[0] for t in got] == [t[0] for t in tokens["auto"]]


# -- a pool that does not fit -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["mamba2", "granite_moe_rope"])
def test_a_pool_over_a_fixed_budget_is_refused_by_name(
    model_dirs: dict[str, Path], arch: str
) -> None:
    """``--kv-cache-memory`` smaller than the pool: an error naming the pool's size and the
    settings that shrink it, also for Mamba2, whose KV blocks cost nothing (before, its
    budget was not looked at)."""
    pool = StateRunner(model_dirs[arch], num_slots=8).pool
    pool_bytes = pool.nbytes
    with pytest.raises(ValueError) as refused:
        LLM(
            str(model_dirs[arch]),
            dtype="float32",
            max_model_len=64,
            max_num_seqs=8,
            kv_cache_memory=pool_bytes // 2,
        )
    message = str(refused.value)
    assert f"pool ({pool.describe()}) does not fit in the KV cache budget" in message
    assert pool.describe().startswith("8 slots x ")
    for setting in ("--max-num-seqs", "--mamba-cache-dtype", "--mamba-ssm-cache-dtype"):
        assert setting in message
    assert "--kv-cache-memory" in message


def test_too_few_kv_blocks_beside_the_pool_names_it(model_dirs: dict[str, Path]) -> None:
    """A budget that holds the pool but not one request's KV blocks: the KV cache's error
    says the pool took its share."""
    model_dir = model_dirs["granite_moe_rope"]
    pool_bytes = StateRunner(model_dir, num_slots=8).pool.nbytes
    with pytest.raises(ValueError, match="the KV cache holds") as refused:
        LLM(
            str(model_dir),
            dtype="float32",
            max_model_len=64,
            max_num_seqs=8,
            kv_cache_memory=pool_bytes + 1024,
        )
    assert "recurrent state pool, 8 slots" in str(refused.value)
    assert "--max-num-seqs" in str(refused.value)


def test_a_pool_that_cannot_be_allocated_is_refused_by_name() -> None:
    """The device's allocator failing (here the CPU's, for 4 TiB; on a GPU
    ``torch.OutOfMemoryError``) is a ``ValueError`` naming the pool, not a bare error."""
    spec = RequestStateSpec("layers.0.ssm", (2**20, 2**20), F32, kind="ssm")
    with pytest.raises(ValueError, match=r"pool \(1 slot x 4096.0 GiB") as refused:
        RequestStatePool([spec], 1, "cpu")
    assert "--max-num-seqs" in str(refused.value)

    def out_of_memory(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ValueError, match="does not fit in the device's memory"):
        RequestStatePool([spec], 1, "cpu", zeros=out_of_memory)  # type: ignore[arg-type]


def test_the_start_up_log_states_the_pool_size(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="chassis.core.model_runner"):
        llm = LLM(str(model_dirs["mamba2"]), dtype="float32", max_num_seqs=3, **SMALL)
    pool = pool_of(llm)
    assert f"request state pool: {pool.describe()}" in caplog.text
    assert pool.describe().startswith("3 slots x ") and "(conv float32, ssm float32)" in (
        pool.describe()
    )
    llm.shutdown()


# -- sleep mode -------------------------------------------------------------------------------


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_pool_and_wake_up_brings_it_back_zeroed(
    model_dirs: dict[str, Path], level: int
) -> None:
    """Sleeping (no request unfinished: the engine core refuses otherwise) drops the pool's
    tensors with the KV cache; waking the weights alone leaves it released, waking the KV
    cache allocates it again, zeroed, and greedy tokens are those before the sleep."""
    llm = LLM(str(model_dirs["granite_moe_rope"]), dtype="float32", enable_sleep_mode=True, **SMALL)
    pool = pool_of(llm)
    reference = greedy(llm)
    shapes = [(t.shape, t.dtype) for t in pool.tensors]
    assert any(t.any() for t in pool.tensors)  # (the finished requests' states are there)
    llm.sleep(level)
    assert pool.released and pool.tensors == []
    llm.wake_up(["weights"])
    assert pool.released
    llm.wake_up(["kv_cache"])
    assert [(t.shape, t.dtype) for t in pool.tensors] == shapes
    assert not any(t.any() for t in pool.tensors)
    assert greedy(llm) == reference
    assert pool.num_free + len(pool.slot_of) == pool.num_slots
    llm.shutdown()


# -- no KV cache: asked of the model ----------------------------------------------------------


def test_a_model_without_attention_layers_shapes_no_kv_whatever_its_config_says(
    tmp_path: Path,
) -> None:
    """A Mamba2 checkpoint whose config carries attention fields (as some do) still has no
    KV cache: the runner asks the model (``num_attention_layers`` 0), not the config."""
    model_dir = save_tiny_checkpoint(
        tiny_config("mamba2", num_attention_heads=5, num_key_value_heads=5), tmp_path, seed=5
    )
    llm = LLM(str(model_dir), dtype="float32", **SMALL)
    runner = llm.engine.executor.worker.runner
    assert (runner.num_kv_heads, runner.head_dim) == (1, 1)
    assert runner.kv_cache_bytes_per_block() == 0 and runner.kv_caches == []
    assert [len(t) for t in greedy(llm)] == [6] * len(PROMPTS)
    llm.shutdown()
