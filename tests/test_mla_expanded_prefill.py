"""DeepSeek MLA's expanded prefill (``builtin_plugins/models/mla_prefill.py``) against the
absorbed form and HF transformers, on the tiny random float32 checkpoints of
``test_deepseek_models`` (V2-Lite-like: ``q_proj``, values wider than keys; V3-like: the
low-rank q path, YaRN).

- Logits: a batched prefill, decodes, chunks over a cached prefix, and a mixed step (a
  prefill, a decode and a chunk over a prefix together, split by request) equal the
  absorbed path's (atol 1e-4) and HF's, with the expanded path seen to run.
- Greedy tokens through ``LLM`` with ``CHASSIS_MLA_PREFILL=expanded`` equal HF's and the
  absorbed path's, with chunked prefill over a prefix-cache hit (the chunk's context read
  back from cached blocks) and steps mixing prefill chunks and decodes; on two
  tensor-parallel ranks too.
- ``auto``'s cost rule at V3's shapes, and a bad mode is refused.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import test_models_parity
import torch
from fixtures_models import allocate_block_tables
from test_deepseek_models import MlaRunner, write_checkpoint
from test_llm_parity import MAX_TOKENS, hf_greedy
from test_models_parity import hf_logits, load_hf
from test_tensor_parallel import wait_for_no_workers

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.models import deepseek_v2
from chassis.builtin_plugins.models.mla_prefill import (
    MLA_PREFILL_ENV,
    MlaShape,
    StepPlan,
    absorbed_flops,
    expanded_flops,
    expanded_is_cheaper,
    mla_prefill_mode,
)

VARIANTS = ("v2_lite", "v3")
#: a prompt longer than several blocks of 4, and prompts that extend it (prefix-cache hits)
BASE = "Write a long story about a dragon who learns to bake bread in a small village by the sea"
PROMPTS = [
    BASE,
    BASE + ", and the friends she makes along the way.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    BASE + " where the winters are cold and long.",
    "Hello",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {v: write_checkpoint(v, tmp_path_factory.mktemp(f"mla_pf_{v}")) for v in VARIANTS}


class PlanSpy:
    """Records every step plan the layers use (one entry per step, not per layer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.plans: list[StepPlan] = []
        real = deepseek_v2.plan_step

        def spy(*args: Any) -> StepPlan | None:
            plan = real(*args)
            if plan is not None and all(plan is not p for p in self.plans):
                self.plans.append(plan)
            return plan

        monkeypatch.setattr(deepseek_v2, "plan_step", spy)

    def saw_chunk_over_prefix(self) -> bool:
        return any(
            s > q
            for p in self.plans
            for q, s in zip(p.expanded_query_lens, p.expanded_seq_lens, strict=True)
        )

    def saw_mixed_step(self) -> bool:
        return any(p.absorbed_rows is not None for p in self.plans)


def _runner(model_dir: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> MlaRunner:
    monkeypatch.setenv(MLA_PREFILL_ENV, mode)
    runner = MlaRunner(model_dir)
    assert {m.prefill_mode for m in runner.model.modules() if hasattr(m, "prefill_mode")} == {mode}
    return runner


# -- logits -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_the_absorbed_path_and_transformers(
    model_dirs: dict[str, Path], variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 prefills A (13 tokens) and B (3); step 2: A decodes, B runs a 6-token chunk
    over its cached prefix, C (9) prefills: one step split by request; step 3: A and B
    chunks of 2 and 5 over their prefixes. Every row's logits, both paths and HF."""
    model_dir = model_dirs[variant]
    a = [1, 504, 3458, 282, 4649, 314, 17, 250, 9001, 48000, 3, 4, 5]
    b = [7, 8000, 42, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    c = [99, 98, 97, 96, 95, 94, 93, 92, 91]
    steps = [  # (tokens per request, seq_lens); requests A, B, C
        ([a[:13], b[:3]], [13, 3]),
        ([[2], b[3:9], c], [14, 9, 9]),
        ([[6, 8], b[9:14]], [16, 14]),
    ]
    full = [[*a, 2, 6, 8], b, c]
    hf_model = load_hf(model_dir)
    expected_full = [hf_logits(hf_model, seq) for seq in full]
    outputs: dict[str, list[torch.Tensor]] = {}
    for mode in ("expanded", "absorbed"):
        spy = PlanSpy(monkeypatch)
        runner = _runner(model_dir, mode, monkeypatch)
        tables = allocate_block_tables(
            [24, 24, 24],
            test_models_parity.BLOCK_SIZE,
            test_models_parity.NUM_BLOCKS,
            torch.Generator().manual_seed(0),
        )
        outputs[mode] = []
        for tokens, seq_lens in steps:
            n = len(tokens)
            outputs[mode].append(runner.step(tokens, seq_lens, tables[:n]))
        if mode == "expanded":  # the prefills, the chunks and the mixed step ran expanded
            assert len(spy.plans) == 3
            assert spy.saw_chunk_over_prefix() and spy.saw_mixed_step()
        else:
            assert spy.plans == []
    for step, (tokens, seq_lens) in enumerate(steps):
        torch.testing.assert_close(
            outputs["expanded"][step], outputs["absorbed"][step], atol=1e-4, rtol=1e-4
        )
        row = 0
        for req, (chunk, seq_len) in enumerate(zip(tokens, seq_lens, strict=True)):
            expected = expected_full[req][seq_len - len(chunk) : seq_len]
            got = outputs["expanded"][step][row : row + len(chunk)]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            row += len(chunk)


# -- greedy tokens through LLM ------------------------------------------------------------


def _greedy(model_dir: Path, prompts: list[str], **engine: Any) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=128, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:1], params)]
    # the others after the first finished: its blocks are prefix-cache hits for two of them
    outputs = llm.generate(prompts[1:], params)
    if engine.get("enable_prefix_caching"):
        assert [o.num_cached_tokens > 0 for o in outputs] == [True, False, True, False]
    return tokens + [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize(
    ("variant", "backend"), [("v2_lite", "cpu_paged"), ("v3", "torch_paged")], ids=str
)
def test_greedy_tokens_with_prefix_hits_and_chunks(
    model_dirs: dict[str, Path], variant: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of at most 16 tokens over blocks of 4, prefix caching on: HF's tokens and the
    absorbed path's; the expanded path ran chunks over cached context and mixed steps (the
    backend running the split step's decodes on metadata of their own)."""
    model_dir = model_dirs[variant]
    engine = {
        "max_num_batched_tokens": 16,
        "block_size": 4,
        "enable_prefix_caching": True,
        "attention_backend": backend,
    }
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    spy = PlanSpy(monkeypatch)
    monkeypatch.setenv(MLA_PREFILL_ENV, "expanded")
    assert _greedy(model_dir, PROMPTS, **engine) == expected
    assert spy.saw_chunk_over_prefix() and spy.saw_mixed_step()
    monkeypatch.setenv(MLA_PREFILL_ENV, "absorbed")
    assert _greedy(model_dir, PROMPTS, **engine) == expected
    # the default: the cost rule; at the tiny V3's widths (2 * kv_lora_rank > qk_nope_head_dim
    # + v_head_dim) whole prefills expand, at the tiny V2-Lite's (values of 32) none does
    monkeypatch.setenv(MLA_PREFILL_ENV, "auto")
    spy = PlanSpy(monkeypatch)
    assert _greedy(model_dir, PROMPTS) == expected
    assert bool(spy.plans) == (variant == "v3")


def test_an_fp8_cache_reads_back_the_same_latents(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--kv-cache-dtype fp8`` (one plane, ``torch_paged``, every layer's K and V scale
    0.25): the expanded path writes the chunk's latents quantized as the backend does and
    dequantizes the context it reads, so both paths attend over the same rounded latents:
    the same greedy tokens."""
    model_dir = model_dirs["v3"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {}
    for mode in ("expanded", "absorbed"):
        monkeypatch.setenv(MLA_PREFILL_ENV, mode)
        llm = LLM(
            str(model_dir),
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=128,
            max_num_batched_tokens=16,
            block_size=4,
            kv_cache_dtype="fp8",
            attention_backend="torch_paged",
        )
        runner = llm.engine.executor.worker.runner
        assert runner.kv_planes == 1
        for layer in runner.model.model.layers:
            layer.self_attn.attn.backend.k_scale = layer.self_attn.attn.backend.v_scale = 0.25
        outputs = llm.generate(PROMPTS, params)
        tokens[mode] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens["expanded"] == tokens["absorbed"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_expanded(model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """V3 on two tensor-parallel ranks (2 of 4 heads each, their rows of ``kv_b_proj``),
    every prefill expanded, chunked over prefix hits: HF's tokens."""
    model_dir = model_dirs["v3"]
    monkeypatch.setenv(MLA_PREFILL_ENV, "expanded")  # (the workers inherit it)
    engine = {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": True}
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert _greedy(model_dir, PROMPTS, tensor_parallel_size=2, **engine) == expected
    gc.collect()
    wait_for_no_workers()


# -- the rule ---------------------------------------------------------------------------

V3_SHAPE = MlaShape(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def test_auto_expands_prefills_and_keeps_decodes_absorbed() -> None:
    """At V3's shapes: a whole prefill is cheaper expanded from 2 tokens on (ratio growing
    with length toward 2176 / 640 = 3.4); a decode or a speculative check (4 tokens) over
    a context stays absorbed, as does a short chunk over a long prefix; a long one expands."""
    for n in (2, 16, 1024, 8192):
        assert expanded_is_cheaper(V3_SHAPE, n, n)
    ratio = absorbed_flops(V3_SHAPE, 8192, 8192) / expanded_flops(V3_SHAPE, 8192, 8192)
    assert 3.0 < ratio < 2176 / 640
    assert not expanded_is_cheaper(V3_SHAPE, 1, 100)
    assert not expanded_is_cheaper(V3_SHAPE, 4, 4000)
    assert not expanded_is_cheaper(V3_SHAPE, 64, 4096 + 64)
    assert expanded_is_cheaper(V3_SHAPE, 512, 4096 + 512)


def test_the_plan_splits_by_request_within_the_context_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``expanded`` mode, blocks of 4: a decode, a whole prefill of 6, a chunk of 3 over a
    prefix of 7, a prefill of 5. With the budget the expanded requests' rows, lengths and
    context slots (block-table order), and the absorbed ones' own metadata. With
    ``EXPANDED_CONTEXT_TOKENS`` 13 the budget is the step's 15 tokens: the chunk over 10
    does not fit after the prefill of 6, the prefill of 5 does."""
    from fixtures_models import make_attention_metadata

    from chassis.builtin_plugins.models import mla_prefill

    tables = [[9], [3, 4], [7, 1, 2], [5, 6]]
    metadata = make_attention_metadata([1, 6, 3, 5], [3, 6, 10, 5], tables, 4)
    plan = mla_prefill.plan_step(metadata, V3_SHAPE, "expanded", 4)
    assert plan is not None and metadata.derived["mla_prefill_plan"] is plan
    assert plan.expanded_rows.tolist() == list(range(1, 15))
    assert (plan.expanded_query_lens, plan.expanded_seq_lens) == ([6, 3, 5], [6, 10, 5])
    slots = [[b * 4 + o for b in t for o in range(4)] for t in tables]
    assert plan.context_slots.tolist() == slots[1][:6] + slots[2][:10] + slots[3][:5]
    assert plan.expanded_slots.tolist() == metadata.slot_mapping[1:15].tolist()
    sub = plan.absorbed_metadata
    assert plan.absorbed_rows is not None and plan.absorbed_rows.tolist() == [0]
    assert sub is not None and (sub.num_reqs, sub.num_actual_tokens, sub.max_seq_len) == (1, 1, 3)
    assert sub.query_start_loc.tolist() == [0, 1] and sub.seq_lens.tolist() == [3]
    assert sub.block_table.tolist() == [[9, 0, 0]] and sub.slot_mapping.tolist() == [9 * 4 + 2]
    assert mla_prefill.plan_step(metadata, V3_SHAPE, "absorbed", 4) is None

    monkeypatch.setattr(mla_prefill, "EXPANDED_CONTEXT_TOKENS", 13)
    metadata = make_attention_metadata([1, 6, 3, 5], [3, 6, 10, 5], tables, 4)
    plan = mla_prefill.plan_step(metadata, V3_SHAPE, "expanded", 4)
    assert plan is not None and plan.expanded_seq_lens == [6, 5]  # 15 - 6 = 9 < 10, >= 5
    assert plan.absorbed_metadata is not None
    assert plan.absorbed_metadata.seq_lens_cpu.tolist() == [3, 10]


def test_the_mode_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MLA_PREFILL_ENV, raising=False)
    assert mla_prefill_mode() == "auto"
    monkeypatch.setenv(MLA_PREFILL_ENV, " Absorbed ")
    assert mla_prefill_mode() == "absorbed"
    monkeypatch.setenv(MLA_PREFILL_ENV, "fast")
    with pytest.raises(ValueError, match="CHASSIS_MLA_PREFILL must be one of auto"):
        mla_prefill_mode()
