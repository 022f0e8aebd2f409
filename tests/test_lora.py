"""LoRA adapters: the layer against merged weights, the engine against HF with merged
adapters (greedy, float32), batches mixing adapters, and what is refused."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_lora import (
    greedy_with_adapters,
    hf_greedy,
    hf_merged_model,
    lora_engine,
    write_peft_adapter,
)

from chassis.core.llm import LLM
from chassis.core.lora import LoRARequest
from chassis.core.lora.adapter import check_adapter
from chassis.core.lora.layers import LoRALinear, LoRAStepState
from chassis.core.model_interface import LoRASlice
from chassis.core.sampling_params import SamplingParams

NEW_TOKENS = 12
#: two prompts sharing a first block (prefix caching must keep adapters apart)
PROMPTS = [
    [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913, 402, 1033, 77, 5, 811, 64, 90],
    [1, 422, 3108, 314, 9216, 253, 1345, 2442, 88, 913, 402, 1033, 77, 5, 811, 64, 3001, 12],
]


def _engine(model_dir: Path, **kwargs: object) -> LLM:
    return lora_engine(model_dir, **kwargs)


def _greedy(llm: LLM, loras: list[LoRARequest | None], prompts: list[list[int]]) -> list:
    return greedy_with_adapters(llm, loras, prompts, NEW_TOKENS)


# -- the layer ---------------------------------------------------------------------------------


def test_lora_linear_matches_merged_weights_per_token() -> None:
    """Each token gets its own slot's delta (or none): equal to x @ (W + B A)^T."""
    torch.manual_seed(0)
    base = torch.nn.Linear(16, 12, bias=True)
    state = LoRAStepState(torch.zeros(8, 2))
    layer = LoRALinear(base, [(0, 8), (8, 4)], state, max_loras=2, max_rank=4)
    adapters = {}
    for slot, rank in ((0, 2), (1, 4)):
        a0, b0 = torch.randn(rank, 16), torch.randn(8, rank)
        a1, b1 = torch.randn(rank, 16), torch.randn(4, rank)
        layer.set_slot(slot, 0, a0, b0)
        layer.set_slot(slot, 1, a1, b1)
        adapters[slot] = torch.cat([b0 @ a0, b1 @ a1])
    layer.set_slot(1, 1, None, None)  # slot 1 leaves the second slice alone
    adapters[1][8:] = 0
    x = torch.randn(5, 16)
    token_slots = [0, -1, 1, 1, 0]
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            state.token_mask[t, slot] = 1.0
    state.active = True
    with torch.no_grad():
        got = layer(x)
        for t, slot in enumerate(token_slots):
            weight = base.weight + (adapters[slot] if slot >= 0 else 0)
            torch.testing.assert_close(got[t], x[t] @ weight.T + base.bias)
        state.active = False
        torch.testing.assert_close(layer(x), base(x))


# -- the engine against HF -------------------------------------------------------------------


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_adapter_greedy_matches_hf_merged(
    arch_dir: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir = request.getfixturevalue(arch_dir)
    adapter = write_peft_adapter(tmp_path / "a", model_dir, rank=8, alpha=16)
    lora = LoRARequest("a", 1, str(adapter))
    llm = _engine(model_dir)
    got = _greedy(llm, [lora, lora], PROMPTS)
    reference = hf_merged_model(model_dir, adapter)
    assert got == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    base = hf_merged_model(model_dir, None)
    # the adapter changes the output (else the test could not fail)
    assert got[0] != hf_greedy(base, PROMPTS[0], NEW_TOKENS)


@pytest.fixture(scope="module")
def two_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two different adapters for the tiny Llama and each one's HF greedy references."""
    root = tmp_path_factory.mktemp("adapters")
    first = write_peft_adapter(root / "first", tiny_llama_dir, rank=8, alpha=16, seed=1)
    # rank 4, rsLoRA scaling, attention only: slots must zero what it does not touch
    second = write_peft_adapter(
        root / "second",
        tiny_llama_dir,
        rank=4,
        alpha=8,
        use_rslora=True,
        targets=("q_proj", "v_proj", "o_proj"),
        seed=2,
    )
    references = {
        name: [hf_greedy(hf_merged_model(tiny_llama_dir, path), p, NEW_TOKENS) for p in PROMPTS]
        for name, path in (("first", first), ("second", second), ("base", None))
    }
    return {
        "first": LoRARequest("first", 1, str(first)),
        "second": LoRARequest("second", 2, str(second)),
        "references": references,
    }


@pytest.mark.parametrize("max_loras", [1, 2])
def test_batch_mixing_adapters_and_base(
    tiny_llama_dir: Path, two_adapters: dict, max_loras: int
) -> None:
    """Every request gets its own adapter's tokens, whether the adapters share a step
    (max_loras=2) or take turns in one slot (max_loras=1)."""
    refs = two_adapters["references"]
    first, second = two_adapters["first"], two_adapters["second"]
    assert len({tuple(refs[k][0]) for k in refs}) == 3  # all three differ
    llm = _engine(tiny_llama_dir, max_loras=max_loras)
    loras = [first, second, None, second, first, None]
    prompts = [PROMPTS[i % 2] for i in range(len(loras))]
    got = _greedy(llm, loras, prompts)
    names = ["first", "second", "base", "second", "first", "base"]
    assert got == [refs[name][i % 2] for i, name in enumerate(names)]
    # again, now with the prefix cache holding every adapter's blocks
    assert _greedy(llm, loras[::-1], prompts[::-1]) == got[::-1]


def test_scheduler_keeps_steps_within_max_loras(tiny_llama_dir: Path, two_adapters: dict) -> None:
    """With one slot, requests of the other adapter wait until the running ones finish."""
    llm = _engine(tiny_llama_dir, max_loras=1)
    first, second = two_adapters["first"], two_adapters["second"]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    from chassis.core.lora.model import LoRAModel

    lora_model = llm.engine.executor.worker.lora
    assert isinstance(lora_model, LoRAModel)
    seen: list[set[int]] = []
    original = lora_model.prepare_step

    def record(token_lora_ids: np.ndarray) -> None:
        seen.append(set(token_lora_ids.tolist()) - {0})
        original(token_lora_ids)

    lora_model.prepare_step = record  # type: ignore[method-assign]
    llm.generate(PROMPTS * 2, params, lora_request=[first, second, None, second])
    assert seen and all(len(ids) <= 1 for ids in seen)
    assert {1, 2} <= set().union(*seen)


# -- refusals ------------------------------------------------------------------------------------


def test_refusals_before_anything_runs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapter = write_peft_adapter(tmp_path / "ok", tiny_llama_dir, rank=8)
    good = LoRARequest("ok", 1, str(adapter))
    params = SamplingParams(max_tokens=2)
    off = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="--enable-lora"):
        off.generate(PROMPTS[0], params, lora_request=good)
    llm = _engine(tiny_llama_dir, max_lora_rank=4)
    with pytest.raises(ValueError, match="above --max-lora-rank 4"):
        llm.generate(PROMPTS[0], params, lora_request=good)
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(PROMPTS[0], params, lora_request=LoRARequest("x", 2, str(tmp_path / "no")))
    with pytest.raises(ValueError, match="1 prompts"):
        llm.generate(PROMPTS[0], params, lora_request=[None, None])
    small = write_peft_adapter(tmp_path / "small", tiny_llama_dir, rank=2)
    assert llm.generate(PROMPTS[0], params, lora_request=LoRARequest("s", 3, str(small)))
    with pytest.raises(ValueError, match="already names adapter 's'"):
        llm.generate(PROMPTS[0], params, lora_request=LoRARequest("t", 3, str(adapter)))
    # a bad request in a batch: nothing of the batch runs
    with pytest.raises(ValueError):
        llm.generate(PROMPTS, params, lora_request=[None, LoRARequest("x", 4, str(tmp_path))])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(adapter))


def test_an_id_reused_for_another_folder_is_refused_naming_both(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """An id keeps its first adapter for the engine's lifetime (slots and prefix cache are
    keyed by it): the front-end refuses another folder under it, naming both folders, and so
    does the engine core for a request that skipped that check, pinned or not."""
    first = write_peft_adapter(tmp_path / "first", tiny_llama_dir, rank=4, seed=1)
    other = write_peft_adapter(tmp_path / "other", tiny_llama_dir, rank=4, seed=2)
    lora_a, lora_b = LoRARequest("a", 1, str(first)), LoRARequest("b", 1, str(other))
    llm = _engine(tiny_llama_dir)
    expected_a = _greedy(llm, [lora_a], PROMPTS[:1])
    with pytest.raises(ValueError) as refused:
        _greedy(llm, [lora_b], PROMPTS[:1])
    assert str(first) in str(refused.value) and str(other) in str(refused.value)
    assert "already names adapter 'a'" in str(refused.value)
    # without the front-end's check: the engine core refuses the request alone
    monkeypatch.setattr(llm.input_processor, "check_lora", lambda lora_request: None)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    together = llm.generate(PROMPTS[:1] * 2, params, lora_request=[lora_a, lora_b])  # a pinned
    assert list(together[0].outputs[0].token_ids) == expected_a[0]
    assert together[1].outputs[0].finish_reason == "abort"
    assert together[1].outputs[0].token_ids == []
    alone = llm.generate(PROMPTS[:1], params, lora_request=lora_b)  # a unpinned, still in a slot
    assert alone[0].outputs[0].finish_reason == "abort"
    # the caller is told why, as the request's fault (a 400 through the server)
    for refused_output in (together[1].outputs[0], alone[0].outputs[0]):
        error = refused_output.error
        assert error is not None and error.client_error
        assert "cannot take it" in error.message
        assert str(first) in error.message and str(other) in error.message
    assert together[0].outputs[0].error is None
    refusals = [r.getMessage() for r in caplog.records if "cannot take it" in r.getMessage()]
    assert len(refusals) == 2 and all(str(first) in m and str(other) in m for m in refusals)
    assert _greedy(llm, [lora_a], PROMPTS[:1]) == expected_a  # the id still runs its adapter


def test_check_adapter_refuses_what_cannot_be_applied(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shapes = {"model.layers.0.self_attn.q_proj": (64, 64)}
    adapter = write_peft_adapter(tmp_path / "a", tiny_llama_dir, targets=("q_proj",), rank=4)
    with pytest.raises(
        ValueError, match=r"changes 'model\.layers\.1\.self_attn\.q_proj', which this model cannot"
    ):
        check_adapter(adapter, shapes, 16)
    shapes["model.layers.1.self_attn.q_proj"] = (64, 32)
    with pytest.raises(ValueError, match=r"needs \[r, 64\] and \[32, r\]"):
        check_adapter(adapter, shapes, 16)
    shapes["model.layers.1.self_attn.q_proj"] = (64, 64)
    assert check_adapter(adapter, shapes, 16).rank == 4
    for key, value, match in (
        ("use_dora", True, "DoRA"),
        ("bias", "all", "bias 'all'"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("peft_type", "IA3", "peft_type 'IA3'"),
    ):
        config_path = adapter / "adapter_config.json"
        config = json.loads(config_path.read_text())
        saved = config.get(key)
        config[key] = value
        config_path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            check_adapter(adapter, shapes, 16)
        config[key] = saved
        config_path.write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no adapter_model\.safetensors"):
        check_adapter(adapter, shapes, 16)


def test_engine_settings_refused(tiny_llama_dir: Path) -> None:
    from chassis.core.config import EngineConfig

    with pytest.raises(ValueError, match="--max-loras must be an integer >= 1"):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        EngineConfig(max_loras=2, max_cpu_loras=1)
    EngineConfig(enable_lora=True, torch_compile=True)  # (tests/test_lora_robustness.py)


@pytest.mark.parametrize(
    "settings",
    [
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 8},
    ],
    ids=["async", "ngram", "chunked"],
)
def test_adapters_with_other_engine_modes(
    tiny_llama_dir: Path, two_adapters: dict, settings: dict
) -> None:
    """Async scheduling, n-gram drafts (verified per token) and prefill chunks keep each
    request's adapter tokens."""
    refs = two_adapters["references"]
    llm = _engine(tiny_llama_dir, max_loras=2, **settings)
    loras = [two_adapters["first"], two_adapters["second"], None]
    got = _greedy(llm, loras, [PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    assert got == [refs["first"][0], refs["second"][1], refs["base"][0]]


def test_token_mask_is_right_for_every_step_whatever_came_before() -> None:
    """A captured decode graph always runs the adapter matmuls and reads the mask's first
    rows: after ``prepare_step`` they must be each token's one-hot slot (zeros for the base
    model) whatever earlier, longer steps left there."""
    from chassis.core.lora.model import LoRAModel

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def lora_slices(self, name: str, module: torch.nn.Module) -> list[LoRASlice]:
            return [LoRASlice(name, 0, 4, 4, 4)] if isinstance(module, torch.nn.Linear) else []

        def lora_shard(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple:
            return a, b

    lora = LoRAModel(Tiny(), max_loras=2, max_rank=2, max_cpu_loras=2, max_num_tokens=8)
    slot_of: dict[int, int] = {}

    def load(lora_id: int, needed: set[int]) -> int:  # no files: record the slot only
        slot = slot_of.setdefault(lora_id, len(slot_of) % 2)
        lora._slot_ids[slot] = lora_id
        return slot

    lora._slot_for = load  # type: ignore[method-assign]
    steps = [[1, 2, 1, 0, 2, 1, 1, 2], [0, 0], [0] * 8, [2, 0, 0], [0, 0, 0, 0, 0, 1], [0] * 8]
    for ids in steps:
        lora.prepare_step(np.array(ids))
        expected = torch.zeros(len(ids), 2)
        for t, lora_id in enumerate(ids):
            if lora_id:
                expected[t, slot_of[lora_id]] = 1.0
        assert torch.equal(lora.state.token_mask[: len(ids)], expected), ids
        assert lora.state.active == any(ids)
    with pytest.raises(RuntimeError, match="more than the 8"):
        lora.prepare_step(np.zeros(9, dtype=np.int64))


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_apply_their_share(
    tiny_llama_dir: Path, two_adapters: dict
) -> None:
    """Each rank adds its part of every delta (B's rows for q/k/v/gate/up, A's columns for
    o/down, summed by the all-reduce): the tokens are the single-device ones."""
    refs = two_adapters["references"]
    llm = _engine(tiny_llama_dir, max_loras=2, tensor_parallel_size=2)
    try:
        assert llm.engine.info.lora_target_shapes["model.layers.0.mlp.down_proj"] == (128, 64)
        loras = [two_adapters["first"], two_adapters["second"], None]
        got = _greedy(llm, loras, [PROMPTS[0], PROMPTS[1], PROMPTS[1]])
        assert got == [refs["first"][0], refs["second"][1], refs["base"][1]]
    finally:
        llm.shutdown()


def test_stats_and_metrics_name_the_adapters_in_use(
    tiny_llama_dir: Path, two_adapters: dict
) -> None:
    """With one slot, a step runs one adapter's requests while the other's wait: the
    scheduler's snapshot and /metrics' lora_requests_info (vLLM's gauge) say which."""
    from chassis.serve.metrics import ServerMetrics

    llm = _engine(tiny_llama_dir, max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, lora in enumerate((two_adapters["first"], two_adapters["second"], None)):
        for request in llm.input_processor.process(PROMPTS[0], params, f"r{i}", lora_request=lora):
            llm.engine.add_request(request)
    stats = llm.engine.step().stats
    assert stats is not None
    assert (stats.max_loras, stats.running_lora_adapters) == (1, ["first"])
    assert stats.waiting_lora_adapters == ["second"]
    text = ServerMetrics("m", stats=lambda: stats).render()[0].decode()
    assert (
        'chassis:lora_requests_info{engine="0",max_lora="1",running_lora_adapters="first",'
        'waiting_lora_adapters="second"}' in text
    )
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.scheduler.stats().running_lora_adapters == []
    plain = ServerMetrics("m2", stats=lambda: llm.engine.scheduler.stats()).render()[0].decode()
    assert "lora_requests_info" in plain  # LoRA on: reported even when no adapter runs


# -- review regressions --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_lora_shapes(tiny_llama_dir: Path) -> dict[str, tuple[int, int]]:
    """The tiny Llama's adaptable modules, as the engine reports them."""
    shapes = _engine(tiny_llama_dir).engine.info.lora_target_shapes
    assert shapes is not None
    return shapes


def _rewrite_adapter(source: Path, directory: Path, change, **config: object) -> Path:
    """A copy of ``source`` whose tensors go through ``change`` (a dict in, a dict out) and
    whose config gets ``config`` (a value None removes the key)."""
    from safetensors.torch import load_file, save_file

    directory.mkdir()
    tensors = change(load_file(str(source / "adapter_model.safetensors")))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = json.loads((source / "adapter_config.json").read_text())
    settings.update(config)
    settings = {key: value for key, value in settings.items() if value is not None}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def _first_pair(tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    key_a = sorted(k for k in tensors if ".lora_A." in k)[0]
    return key_a, key_a.replace(".lora_A.", ".lora_B.")


def test_adapters_that_would_break_the_engine_or_other_requests_are_refused(
    tiny_llama_dir: Path, llama_lora_shapes: dict, tmp_path: Path
) -> None:
    """Rank 0 passed the checks and then killed the engine at its first step (a division by
    zero in the scaling); NaN or infinity reached the base model's tokens in the same step
    (every slot is computed for every token and masked after, and 0 * NaN is NaN). Both
    are refused before a request reaches the engine, as is lora_bias."""
    adapter = write_peft_adapter(tmp_path / "ok", tiny_llama_dir, rank=4, targets=("q_proj",))

    def empty(tensors: dict) -> dict:
        key_a, key_b = _first_pair(tensors)
        return {key_a: torch.zeros(0, 64), key_b: torch.zeros(64, 0)}

    def poisoned(value: float, matrix: int):
        def change(tensors: dict) -> dict:
            key = _first_pair(tensors)[matrix]
            tensors[key] = tensors[key].clone()
            tensors[key][0, 0] = value
            return tensors

        return change

    rank0 = _rewrite_adapter(adapter, tmp_path / "rank0", empty)
    with pytest.raises(ValueError, match="has rank 0"):
        check_adapter(rank0, llama_lora_shapes, 16)
    for name, change in (("nan", poisoned(float("nan"), 0)), ("inf", poisoned(-math.inf, 1))):
        bad = _rewrite_adapter(adapter, tmp_path / name, change)
        with pytest.raises(ValueError, match="NaN or infinite values"):
            check_adapter(bad, llama_lora_shapes, 16)
    bias = _rewrite_adapter(adapter, tmp_path / "bias", dict, lora_bias=True)
    with pytest.raises(ValueError, match="lora_bias"):
        check_adapter(bias, llama_lora_shapes, 16)
    # through the engine: refused, and the engine keeps serving
    llm = _engine(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for lora_id, folder in enumerate((rank0, tmp_path / "nan"), start=1):
        with pytest.raises(ValueError, match=f"{folder.name}"):
            llm.generate(PROMPTS[0], params, lora_request=LoRARequest("x", lora_id, str(folder)))
    assert llm.generate(PROMPTS[0], params, lora_request=LoRARequest("ok", 9, str(adapter)))


def test_a_missing_lora_alpha_is_peft_s_default(
    tiny_llama_dir: Path, llama_lora_shapes: dict, tmp_path: Path
) -> None:
    """PEFT's LoraConfig.lora_alpha is 8 when the config leaves it out (chassis took r,
    a scaling of 1 instead of 8 / r)."""
    adapter = write_peft_adapter(tmp_path / "a", tiny_llama_dir, rank=4, targets=("q_proj",))
    bare = _rewrite_adapter(adapter, tmp_path / "bare", dict, lora_alpha=None)
    config = check_adapter(bare, llama_lora_shapes, 16)
    assert (config.alpha, config.scaling(4)) == (8.0, 2.0)


def test_refusal_names_the_modules_this_model_can_adapt(
    llama_lora_shapes: dict, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    adapter = write_peft_adapter(tmp_path / "a", tiny_llama_dir, rank=2, targets=("q_proj",))
    shapes = {k: v for k, v in llama_lora_shapes.items() if not k.endswith("q_proj")}
    with pytest.raises(ValueError, match=r"adaptable here: k_proj, v_proj, o_proj, gate_proj"):
        check_adapter(adapter, shapes, 16)


def test_check_lora_gives_an_id_to_one_adapter_across_threads(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AsyncLLM checks requests with adapters in worker threads: two adapters checked at
    once under one id both passed (the id then ran whichever the engine read first); now
    the first to claim the id keeps it and the other is refused."""
    import threading

    from chassis.core.lora import adapter as adapter_module

    folders = [
        write_peft_adapter(tmp_path / name, tiny_llama_dir, rank=2, targets=("q_proj",), seed=s)
        for s, name in enumerate(("a", "b"))
    ]
    llm = _engine(tiny_llama_dir)
    both_checked = threading.Barrier(2)
    check = adapter_module.check_adapter

    def check_then_wait(*args: object) -> object:
        config = check(*args)
        both_checked.wait(timeout=30)  # neither thread has claimed the id yet
        return config

    monkeypatch.setattr(adapter_module, "check_adapter", check_then_wait)
    refusals: list[str] = []

    def run(lora: LoRARequest) -> None:
        try:
            llm.input_processor.check_lora(lora)
        except ValueError as exc:
            refusals.append(str(exc))

    threads = [
        threading.Thread(target=run, args=(LoRARequest(path.name, 7, str(path)),))
        for path in folders
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(refusals) == 1 and "lora_int_id 7 already names adapter" in refusals[0]


def test_waiting_for_an_adapter_keeps_the_queue_order_in_linear_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests whose adapter cannot join step aside each step and keep their places; the
    scheduler once rebuilt the running adapters' set for every waiting request (O(running x
    waiting) per step: 40 ms for 128 x 2000 on this host) and re-inserted each one."""
    from chassis.builtin_plugins.schedulers.fcfs import FcfsScheduler
    from chassis.core.config import EngineConfig
    from chassis.core.kv_cache_manager import KVCacheManager
    from chassis.core.request import Request

    config = EngineConfig(
        block_size=16, max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=64,
        enable_lora=True, max_loras=1,
    )  # fmt: skip
    scheduler = FcfsScheduler(config, KVCacheManager(4096, 16))
    first, second = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    params = SamplingParams(max_tokens=8)
    for i in range(100):
        scheduler.add_request(Request(f"a{i}", [1, 2, i + 3], params, lora_request=first))
    scheduler.schedule()
    for i in range(1000):  # the other adapter's, with a base-model request every tenth
        lora = None if i % 10 == 0 else second
        scheduler.add_request(Request(f"w{i}", [1, 2, i + 3], params, lora_request=lora))
    reads = 0
    lora_int_id = Request.lora_int_id

    def counted(request: Request) -> int:
        nonlocal reads
        reads += 1
        return lora_int_id.fget(request)

    monkeypatch.setattr(Request, "lora_int_id", property(counted))
    output = scheduler.schedule()
    assert reads < 3 * (100 + 1000)
    admitted = {new.request_id for new in output.new_requests}
    assert admitted == {f"w{i}" for i in range(0, 1000, 10)}
    assert [r.request_id for r in scheduler.waiting] == [f"w{i}" for i in range(1000) if i % 10]


def test_the_batch_keeps_each_rows_adapter_when_rows_move() -> None:
    """Removing a request moves the last row into its place, adapter id included."""
    from chassis.core.input_batch import InputBatch, RequestState

    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=4)
    for i, lora_id in enumerate((1, 0, 2)):
        state = RequestState(f"r{i}", [1, 2], [], SamplingParams(), frozenset(), None, lora_id)
        batch.add(state, [[i]], 0)  # one KV cache group
    batch.remove("r0")
    assert batch.request_ids == ["r2", "r1"]
    assert batch.lora_ids[:2].tolist() == [2, 0]
