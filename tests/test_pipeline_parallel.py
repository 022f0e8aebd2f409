"""Pipeline parallelism on the CPU: ``--pipeline-parallel-size 2`` runs two stages (the
engine's process and one worker process) joined over gloo, each holding its run of the decoder
layers of tiny 3-layer checkpoints (stage 0: layers 0-1 and the embedding; stage 1: layer 2,
the final norm and the LM head). The bar is the single-device one: HF's greedy tokens, through
chunked prefill and preemption.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
from fixtures_models import write_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy

from chassis import LLM, SamplingParams
from chassis.core import parallel_state
from chassis.core.config import EngineConfig
from chassis.core.layers.attention import Attention
from chassis.core.pipeline_parallel import stage_layers

pytestmark = [
    pytest.mark.timeout(300),
    # the CPU platform gives each rank a core of its own
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def three_layer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Llama (untied head), Qwen2 (tied head) and Qwen3 checkpoints of 3 layers: an
    uneven split over 2 stages."""
    root = tmp_path_factory.mktemp("pp")
    return {
        arch: write_tiny_checkpoint(arch, root / arch, num_hidden_layers=3)
        for arch in ("llama", "qwen2", "qwen3")
    }


def test_the_layers_split_as_vllm_splits_them() -> None:
    def split(layers: int, stages: int) -> list[int]:
        ranges = [stage_layers(layers, s, stages) for s in range(stages)]
        assert ranges[0][0] == 0 and ranges[-1][1] == layers  # contiguous, all of them
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        return [end - start for start, end in ranges]

    # the remainder goes to the stages before the last, from the one before the last back
    assert split(32, 4) == [8, 8, 8, 8]
    assert split(61, 2) == [31, 30]
    assert split(61, 4) == [15, 15, 16, 15]
    assert split(22, 4) == [5, 6, 6, 5]
    assert split(5, 3) == [2, 2, 1]
    assert split(3, 2) == [2, 1]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 is more than the model's 2"):
        stage_layers(2, 0, 3)


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_stage_builds_and_loads_only_its_layers(
    three_layer_dirs, monkeypatch: pytest.MonkeyPatch, arch: str, stage: int
) -> None:
    """A stage's model (built here as that stage, without a group: nothing is sent while
    building) holds exactly the checkpoint tensors of its layers, the embedding (stage 0) or
    the final norm and LM head (stage 1; a tied head loads the embedding matrix), and its
    attention layers read KV caches 0 .. its layer count - 1."""
    from safetensors.torch import load_file

    from chassis.core.model_loader import build_model, engine_hf_config
    from chassis.plugins import get_registries

    model_dir = three_layer_dirs[arch]
    stage_group = parallel_state.TensorParallelGroup(pp_rank=stage, pp_size=2)
    monkeypatch.setattr(parallel_state, "_GROUP", stage_group)
    config = EngineConfig(model=str(model_dir), max_model_len=64, dtype="float32")
    backend = get_registries().attention_backends.get("torch_paged")
    hf_config = engine_hf_config(config)
    model = build_model(config, hf_config, model_dir, backend, "cpu", torch.float32)

    checkpoint = load_file(str(model_dir / "model.safetensors"))
    layers = range(0, 2) if stage == 0 else range(2, 3)
    expected = {
        name: tensor.numel()
        for name, tensor in checkpoint.items()
        if any(name.startswith(f"model.layers.{i}.") for i in layers)
    }
    if stage == 0:
        expected["model.embed_tokens.weight"] = checkpoint["model.embed_tokens.weight"].numel()
    else:
        expected["model.norm.weight"] = checkpoint["model.norm.weight"].numel()
        head = "lm_head.weight" if "lm_head.weight" in checkpoint else "model.embed_tokens.weight"
        expected["lm_head.weight"] = checkpoint[head].numel()
        lm_head = model.lm_head.weight
        assert torch.equal(lm_head, checkpoint[head])  # tied: the embedding, loaded here
    held = sum(p.numel() for p in model.parameters())
    assert held == sum(expected.values())
    assert held < sum(t.numel() for t in checkpoint.values())
    for i in range(3):  # another stage's layers are there by name only, without parameters
        if i not in layers:
            assert not list(model.model.layers[i].parameters())
    assert model.num_attention_layers == len(layers)
    caches = sorted(m.layer_idx for m in model.modules() if isinstance(m, Attention))
    assert caches == list(range(len(layers)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_stages_match_hf_through_chunked_prefill_and_preemption(
    three_layer_dirs, arch: str
) -> None:
    """Greedy tokens of 2 stages equal HF's (and 1 stage's, checked against HF by
    tests/test_llm_parity.py) while long prompts are prefilled in chunks of 16 tokens and a
    cache of 128 tokens (the prompts and their completions take 187) makes the scheduler preempt requests."""
    model_dir = three_layer_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        num_kv_blocks=32,
        max_num_batched_tokens=16,
        pipeline_parallel_size=2,
    )
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.engine.scheduler.stats().num_preemptions > 0
        # the driver is stage 0: 2 of the 3 layers, and a KV cache for those 2 only
        runner = llm.engine.executor.worker.runner
        assert len(runner.kv_caches) == 2
        assert runner.model.lm_head is None and runner.model.model.norm is None
    finally:
        llm.shutdown()
    assert parallel_state.world_size() == 1  # the group is gone with the engine


def test_one_stage_is_the_single_device_engine(three_layer_dirs) -> None:
    model_dir = three_layer_dirs["llama"]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, pipeline_parallel_size=1)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert tokens == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert len(llm.engine.executor.worker.runner.kv_caches) == 3


def test_a_model_without_support_is_refused_before_any_stage_starts(tiny_mixtral_dir) -> None:
    with pytest.raises(ValueError, match="MixtralForCausalLM does not support --pipeline-par"):
        LLM(str(tiny_mixtral_dir), dtype="float32", max_model_len=64, pipeline_parallel_size=2)


def test_bad_sizes_are_refused(tiny_llama_dir, tmp_path: Path) -> None:
    one_layer = write_tiny_checkpoint("llama", tmp_path / "one", num_hidden_layers=1)
    with pytest.raises(ValueError, match="is more than the model's 1 decoder layers"):
        LLM(str(one_layer), dtype="float32", max_model_len=64, pipeline_parallel_size=2)
    # 3 stages of the 2-layer model: too many ranks for the host's cores, or for its layers
    with pytest.raises(ValueError, match=r"-size 3 runs 3 ranks: |more than the model's 2 dec"):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="--pipeline-parallel-size must be an integer >= 1"):
        EngineConfig(model=str(tiny_llama_dir), pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="cannot be combined with --tensor-parallel-size"):
        EngineConfig(model=str(tiny_llama_dir), pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cannot be combined with --enable-lora"):
        EngineConfig(model=str(tiny_llama_dir), pipeline_parallel_size=2, enable_lora=True)


def test_seeded_sampling_and_logprobs_with_async_scheduling_match_one_stage(
    three_layer_dirs,
) -> None:
    """Every stage samples from the last stage's logits and continues from rank 0's ids: seeded
    samples, their logprobs and prompt logprobs equal one stage's, also with async scheduling
    (the next step's input ids read from the device)."""
    model_dir = str(three_layer_dirs["qwen2"])
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        seed=7,
        max_tokens=8,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
    )

    def run(**engine) -> list[tuple]:
        llm = LLM(model_dir, dtype="float32", max_model_len=128, **engine)
        try:
            outputs = llm.generate(PROMPTS[:3], params)
        finally:
            llm.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]

    one = run()
    two = run(pipeline_parallel_size=2, async_scheduling=True)
    for (tokens, logprobs, prompt), (tokens2, logprobs2, prompt2) in zip(one, two, strict=True):
        assert tokens == tokens2
        for expected, got in zip([*logprobs, *prompt[1:]], [*logprobs2, *prompt2[1:]], strict=True):
            assert expected.keys() == got.keys()
            for token, lp in expected.items():
                assert got[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


def test_sliding_window_layers_on_some_stages_match_hf(tmp_path: Path) -> None:
    """Qwen2 whose layer 0 attends fully and layers 1-2 slide: stage 0 alone would plan two KV
    cache groups and stage 1 one sliding group, so the stages keep every block instead (one
    group, as ``--no-sliding-window-kv-release``) and agree on the block tables."""
    model_dir = write_tiny_checkpoint(
        "qwen2",
        tmp_path / "sliding",
        num_hidden_layers=3,
        use_sliding_window=True,
        max_window_layers=1,
        sliding_window=8,
    )
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=128, block_size=4, pipeline_parallel_size=2
    )
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.executor.kv_cache_group_windows() == (None,)
    finally:
        llm.shutdown()
    assert tokens == hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
