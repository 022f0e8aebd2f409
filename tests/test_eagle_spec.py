"""EAGLE-1 speculative decoding (core/eagle.py, ``--speculative-config``
``{"method": "eagle", "model": HEAD, "num_speculative_tokens": k}``): heads in the layout
real heads ship, loaded over a tiny target; greedy output is plain decoding's token for
token whatever the head proposes, drafts are proposed and counted, and a head that mirrors
the target gets most of them accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_eagle import (
    ReferenceHead,
    write_mirror_head,
    write_mirror_target,
    write_random_head,
)
from spec_decode_helpers import PROMPTS, greedy, head_llm, record_proposals, token_ids

from chassis import LLM, SamplingParams
from chassis.core.config import EngineConfig

K = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mirror_target(tmp_path_factory.mktemp("eagle_target"))


@pytest.fixture(scope="module")
def mirror_head(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mirror_head(target_dir, tmp_path_factory.mktemp("eagle_mirror"))


@pytest.fixture(scope="module")
def random_head(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_head(target_dir, tmp_path_factory.mktemp("eagle_random"))


def make_llm(model_dir: Path, head: Path | None = None, **engine) -> LLM:
    return head_llm(model_dir, "eagle", head, K, **engine)


@pytest.fixture(scope="module")
def expected(target_dir: Path) -> list[list[int]]:
    llm = make_llm(target_dir)
    try:
        return token_ids(llm, greedy())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("head", ["mirror", "random"])
def test_greedy_output_is_plain_decoding(
    head: str, expected: list[list[int]], target_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Chunked prefill (16 tokens a step) and prefix caching on, the prompts twice: the
    tokens of plain decoding; drafts proposed and counted. The mirror head gets most of its
    drafts accepted, the random one few."""
    llm = make_llm(target_dir, request.getfixturevalue(f"{head}_head"), max_num_batched_tokens=16)
    try:
        assert token_ids(llm, greedy()) == expected
        assert token_ids(llm, greedy()) == expected
        stats = llm.engine.scheduler.stats()
        drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        assert drafted > 0
        assert 0 <= accepted <= drafted
        if head == "mirror":
            assert accepted > drafted / 2
        else:
            assert accepted < drafted / 2
        engine = llm.engine
        if engine.scheduler.has_finished_requests():
            engine.step()
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("head", ["mirror", "random"])
def test_drafts_are_the_heads_own(
    head: str, target_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Every proposal (after chunked prefills, accepted and rejected drafts) equals the
    head computed from scratch with HF's Llama layer over the request's whole sequence and
    the target's hidden states: the head's KV cache, positions, tokens and hidden states
    line up."""
    head_dir = request.getfixturevalue(f"{head}_head")
    llm = make_llm(target_dir, head_dir, max_num_batched_tokens=16)
    drafter = llm.engine.executor.worker.runner.drafter
    seen = record_proposals(drafter)
    try:
        llm.generate(PROMPTS[1:3], greedy(16))
    finally:
        llm.shutdown()
    reference = ReferenceHead(target_dir, head_dir)
    assert len(seen) > 8
    for sequence, drafts in seen:
        assert drafts == reference.drafts(sequence, len(drafts))


def test_a_head_trained_on_a_shorter_context_runs_over_the_whole_context(
    expected: list[list[int]], target_dir: Path, tmp_path: Path
) -> None:
    """A head whose config says ``max_position_embeddings`` 16 drafts at every position of
    the target's context (its RoPE table covers ``--max-model-len``): plain decoding's
    output."""
    import json

    head_dir = write_random_head(target_dir, tmp_path / "short")
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    llm = make_llm(target_dir, head_dir)
    try:
        assert token_ids(llm, greedy()) == expected
        assert llm.engine.scheduler.stats().spec_num_draft_tokens > 0
    finally:
        llm.shutdown()


def test_random_requests_keep_the_distribution_and_seeded_ones_their_tokens(
    target_dir: Path, mirror_head: Path
) -> None:
    """Unseeded random requests get probabilistic drafts (drawn from the head's ``q``,
    verified by rejection sampling) and some accepted; seeded ones plain decoding's tokens."""
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7)
    plain = make_llm(target_dir)
    try:
        want = token_ids(plain, seeded)
    finally:
        plain.shutdown()
    llm = make_llm(target_dir, mirror_head)
    try:
        assert token_ids(llm, seeded) == want
        before = llm.engine.scheduler.stats().spec_num_accepted_tokens
        outs = token_ids(llm, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
        assert all(len(o) == 16 for o in outs)
        assert llm.engine.scheduler.stats().spec_num_accepted_tokens > before
        assert llm.engine.executor.worker.runner.drafter.sampler is not None  # probabilistic
    finally:
        llm.shutdown()


def test_the_memory_profile_runs_the_head(target_dir: Path, mirror_head: Path) -> None:
    """The start-up profile runs the head over dummy tokens and hidden states, keeping
    nothing."""
    from fixtures_tensor_memory import PeakTensorBytes

    llm = make_llm(target_dir, mirror_head)
    try:
        runner = llm.engine.executor.worker.runner
        drafter = runner.drafter
        profile_forward = drafter._profile_forward
        head_inputs: list[tuple[int, int]] = []

        def recording(input_ids, positions, ctx):
            hidden = profile_forward(input_ids, positions, ctx)
            head_inputs.append((input_ids.numel(), hidden.shape[0]))
            return hidden

        drafter._profile_forward = recording
        with PeakTensorBytes() as memory:
            runner.profile_run(64)
        assert memory.current == 0
        # The head itself ran over the profiled tokens (not only the target's forward).
        assert head_inputs and all(tokens > 0 and rows == tokens for tokens, rows in head_inputs)
    finally:
        llm.shutdown()


def test_configuration_errors(target_dir: Path, tmp_path: Path) -> None:
    spec = EngineConfig(speculative_config={"method": "eagle", "model": "h"}).speculative
    assert spec.uses_eagle and spec.uses_draft_model and spec.num_speculative_tokens == 4
    with pytest.raises(ValueError, match=r"method 'medusa' is not implemented; known: .*eagle"):
        EngineConfig(speculative_config={"method": "medusa", "model": "h"})
    with pytest.raises(ValueError, match="method 'eagle' needs \"model\": the EAGLE-1 head"):
        EngineConfig(speculative_config={"method": "eagle"})
    narrow = write_random_head(target_dir, tmp_path / "narrow", hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 32 and the target 64"):
        make_llm(target_dir, narrow)
    with pytest.raises(ValueError, match=r"no fc\.weight: it is not an EAGLE-1 head"):
        make_llm(target_dir, target_dir)  # a whole model, not a head


def test_the_head_is_no_model_of_its_own(mirror_head: Path) -> None:
    """A checkpoint naming the head's architecture as the served model: a clear error."""
    from chassis.builtin_plugins.models.llama_eagle import EagleLlamaHead
    from chassis.core.model_interface import ModelBuildContext
    from chassis.core.model_loader import load_hf_config

    config = load_hf_config(mirror_head)
    ctx = ModelBuildContext(attention_backend=object, dtype=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="an EAGLE draft head, not a model"):
        EagleLlamaHead(config, ctx)


def _llama_head_config_for(target_dir: Path, directory: Path) -> Path:
    """A Llama ``config.json`` of the target's hidden size (an EAGLE-1 head is a Llama
    layer whatever its target): the folder :func:`write_random_head` shapes a head from."""
    import json

    config = json.loads((target_dir / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    head = {key: config[key] for key in (*keys, "vocab_size", "rms_norm_eps")}
    head.update(
        model_type="llama",
        num_hidden_layers=1,
        head_dim=config["hidden_size"] // config["num_attention_heads"],
        max_position_embeddings=config["max_position_embeddings"],
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(head))
    return directory


def test_a_target_with_kv_cache_groups(tmp_path: Path) -> None:
    """Gemma 2 (window and full layers: two KV cache groups, the window's blocks released):
    the head's full-attention layer reads the full group's table, every proposal (chunked
    prefills, prefix-cache hits, preemptions) equals the head recomputed from scratch over
    HF's Gemma 2 hidden states, and the output is HF's."""
    from test_gemma_models import hf_greedy as gemma_hf_greedy
    from test_gemma_models import write_checkpoint as write_gemma
    from test_sliding_window_kv import make_llm as make_grouped_llm

    target = write_gemma(
        "gemma2",
        tmp_path / "gemma2",
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    head_dir = write_random_head(
        _llama_head_config_for(target, tmp_path / "llama"), tmp_path / "head"
    )
    prompts = PROMPTS[1:]
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": K}
    # 40 blocks of 4 tokens: the three requests outgrow them together and are preempted
    tight = {"num_kv_blocks": 40, "max_model_len": 104}
    llm = make_grouped_llm(target, release=True, speculative_config=spec, **tight)
    drafter = llm.engine.executor.worker.runner.drafter
    seen = record_proposals(drafter)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
        assert llm.engine.kv_cache_manager.group_windows == [None, 4]
        assert drafter.layer_group == [0]
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.stats()
    finally:
        llm.shutdown()
    assert first == again == gemma_hf_greedy(target, prompts, 40)
    assert stats.spec_num_draft_tokens > 0
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    reference = ReferenceHead(target, head_dir)
    assert len(seen) > 8
    for sequence, drafts in seen:
        assert drafts == reference.drafts(sequence, len(drafts))


def test_a_model_without_a_method_is_named_by_its_path_as_vllm_does() -> None:
    """vLLM's rule: a path with "eagle-" in it (any case) is an EAGLE-1 head, one with
    "eagle3" an EAGLE-3 head (tests/test_eagle3_spec.py); any other a draft model."""

    def method(model: str) -> str:
        return EngineConfig(speculative_config={"model": model}).speculative.method

    assert method("yuhuili/EAGLE-LLaMA3-Instruct-8B") == "eagle"
    assert method("/models/my-eagle-head") == "eagle"
    assert method("HuggingFaceTB/SmolLM2-135M") == "draft_model"
    assert method("/models/eagle") == "draft_model"  # no "eagle-": vLLM's rule exactly
    assert method("AngelSlim/Qwen3-8B_eagle3") == "eagle3"
    assert method("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") == "eagle3"


def test_an_eagle_head_given_as_a_draft_model_is_named(target_dir: Path, random_head: Path) -> None:
    spec = {"method": "draft_model", "model": str(random_head), "num_speculative_tokens": K}
    with pytest.raises(ValueError, match=r"is an EAGLE-1 head .* method 'eagle'"):
        make_llm(target_dir, speculative_config=spec)


def test_a_head_shipped_as_pytorch_model_bin(
    target_dir: Path, random_head: Path, tmp_path: Path
) -> None:
    """The random head's tensors in ``pytorch_model.bin`` (read with ``weights_only``), no
    safetensors: the same tokens and the same proposals, step for step."""
    from fixtures_eagle3 import write_pytorch_bin_copy

    bin_head = write_pytorch_bin_copy(random_head, tmp_path / "bin")
    assert not list(bin_head.glob("*.safetensors"))
    results = []
    for head_dir in (random_head, bin_head):
        llm = make_llm(target_dir, head_dir)
        seen = record_proposals(llm.engine.executor.worker.runner.drafter)
        try:
            outputs = llm.generate(PROMPTS[1:3], greedy(16))
        finally:
            llm.shutdown()
        results.append(([o.outputs[0].token_ids for o in outputs], seen))
    assert len(results[0][1]) > 8 and results[1] == results[0]
