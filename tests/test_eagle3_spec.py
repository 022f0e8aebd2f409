"""EAGLE-3 speculative decoding (core/eagle3.py, ``--speculative-config``
``{"method": "eagle3", "model": HEAD, "num_speculative_tokens": k}``): random heads in the
layout real heads ship, over a tiny four-layer Llama; greedy output is plain decoding's,
every proposal is the head recomputed from the format over HF's target, random requests'
drafts live on the draft vocabulary, and bad heads are refused at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures_eagle3 import (
    ReferenceEagle3,
    draft_vocabulary,
    write_eagle3_head,
    write_mirror_pair,
    write_pytorch_bin_copy,
    write_speculators_copy,
)
from fixtures_models import write_tiny_checkpoint
from spec_decode_helpers import PROMPTS, greedy, head_llm, record_proposals, token_ids

from chassis import LLM, SamplingParams
from chassis.core.config import EngineConfig

K = 3
DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("eagle3_target"), num_hidden_layers=4
    )


@pytest.fixture(scope="module")
def small_vocab_head(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its own 512-token vocabulary (d2t), reading the layers its config names."""
    return write_eagle3_head(
        target_dir, tmp_path_factory.mktemp("eagle3_small"), layer_ids=[0, 2, 3]
    )


@pytest.fixture(scope="module")
def default_head(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's vocabulary (no d2t) and the default layers (2, 2, 1 for four)."""
    return write_eagle3_head(
        target_dir, tmp_path_factory.mktemp("eagle3_default"), draft_vocab_size=None, seed=1
    )


def make_llm(model_dir: Path, head: Path | None = None, **engine) -> LLM:
    return head_llm(model_dir, "eagle3", head, K, **engine)


@pytest.fixture(scope="module")
def expected(target_dir: Path) -> list[list[int]]:
    llm = make_llm(target_dir)
    try:
        model = llm.engine.executor.worker.runner.model
        assert not model.model.aux_layer_ids  # the plain path keeps nothing
        assert model.graph_capture_blocker() is None
        return token_ids(llm, greedy())
    finally:
        llm.shutdown()


@pytest.mark.parametrize("head", ["small_vocab", "default"])
def test_greedy_output_is_plain_decoding_and_drafts_are_the_heads(
    head: str, expected: list[list[int]], target_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Chunked prefill (16 tokens a step) and prefix caching on, the prompts twice: the
    tokens of plain decoding, drafts proposed and counted, every block freed; and every
    proposal equals the head recomputed from the checkpoint format over HF's target."""
    head_dir = request.getfixturevalue(f"{head}_head")
    llm = make_llm(target_dir, head_dir, max_num_batched_tokens=16)
    runner = llm.engine.executor.worker.runner
    seen = record_proposals(runner.drafter)
    try:
        # kept states block no graph: they come out of the graphs as static outputs
        assert runner.model.graph_capture_blocker() is None
        assert runner.model.aux_hidden_state_layers() == tuple(runner.drafter.model.aux_layer_ids)
        assert token_ids(llm, greedy()) == expected
        assert token_ids(llm, greedy()) == expected
        stats = llm.engine.scheduler.stats()
        assert stats.spec_num_draft_tokens > 0
        assert stats.prefix_cache_hits > 0
        engine = llm.engine
        if engine.scheduler.has_finished_requests():
            engine.step()
        assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    finally:
        llm.shutdown()
    reference = ReferenceEagle3(target_dir, head_dir)
    assert len(seen) > 8
    for sequence, drafts in seen[:40]:
        assert drafts == reference.drafts(sequence, len(drafts))
    if head == "small_vocab":
        ids = set(draft_vocabulary(49152, DRAFT_VOCAB).tolist())
        assert all(set(drafts) <= ids for _, drafts in seen)


def test_a_head_trained_on_a_shorter_context_runs_over_the_whole_context(
    expected: list[list[int]], target_dir: Path, tmp_path: Path
) -> None:
    """A head whose config says ``max_position_embeddings`` 16 (published EAGLE-3 heads say
    2048 for targets of far longer contexts) drafts at every position of the target's
    context: the output is plain decoding's and the proposals past position 16 are the
    head's (RoPE at those positions, as the reference computes it)."""
    head_dir = write_eagle3_head(
        target_dir, tmp_path / "short", config_overrides={"max_position_embeddings": 16}
    )
    llm = make_llm(target_dir, head_dir)
    seen = record_proposals(llm.engine.executor.worker.runner.drafter)
    try:
        assert token_ids(llm, greedy()) == expected
    finally:
        llm.shutdown()
    late = [(sequence, drafts) for sequence, drafts in seen if len(sequence) > 20]
    assert late
    reference = ReferenceEagle3(target_dir, head_dir)
    for sequence, drafts in late[:10]:
        assert drafts == reference.drafts(sequence, len(drafts))


def test_a_head_that_computes_the_target_gets_its_drafts_accepted(tmp_path: Path) -> None:
    """A bigram target and a head that computes it from the token (fixtures_eagle3's
    ``write_mirror_pair``): the output is plain decoding's and nearly every draft is
    accepted, through the head's own vocabulary and d2t."""
    target, head = write_mirror_pair(tmp_path)
    plain = make_llm(target)
    try:
        want = token_ids(plain, greedy())
    finally:
        plain.shutdown()
    llm = make_llm(target, head, max_num_batched_tokens=16)
    try:
        assert token_ids(llm, greedy()) == want
        stats = llm.engine.scheduler.stats()
        drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
        assert drafted > 0
        assert accepted >= 0.9 * drafted, (accepted, drafted)
    finally:
        llm.shutdown()


def test_random_requests_draw_drafts_on_the_draft_vocabulary(
    target_dir: Path, small_vocab_head: Path
) -> None:
    """Seeded random requests give plain decoding's tokens; unseeded ones get probabilistic
    drafts whose ``q`` (over the target's ids) is zero outside the draft vocabulary and sums
    to one, verified by rejection sampling."""
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=7)
    plain = make_llm(target_dir)
    try:
        want = token_ids(plain, seeded)
    finally:
        plain.shutdown()
    llm = make_llm(target_dir, small_vocab_head)
    drafter = llm.engine.executor.worker.runner.drafter
    outside = torch.ones(49152, dtype=torch.bool)
    outside[draft_vocabulary(49152, DRAFT_VOCAB)] = False
    checked = []
    choose_probs = drafter._draft_rounds

    def checking(*args, **kwargs):
        drafts = choose_probs(*args, **kwargs)
        for request_id in drafts:
            entry = drafter._draft_probs.get(request_id)
            if entry is not None:
                q = entry.flat[entry.base : entry.base + len(entry.token_ids)]
                checked.append((float(q[:, outside].abs().sum()), q.sum(-1)))
        return drafts

    drafter._draft_rounds = checking
    try:
        assert token_ids(llm, seeded) == want
        outs = token_ids(llm, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
        assert all(len(o) == 16 for o in outs)
        assert drafter.sampler is not None  # probabilistic drafts
        assert checked
        for mass_outside, sums in checked:
            assert mass_outside == 0.0
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-4)
    finally:
        llm.shutdown()


def test_the_memory_profile_runs_the_head_and_keeps_nothing(
    target_dir: Path, small_vocab_head: Path
) -> None:
    from fixtures_tensor_memory import PeakTensorBytes

    llm = make_llm(target_dir, small_vocab_head)
    try:
        runner = llm.engine.executor.worker.runner
        with PeakTensorBytes() as memory:
            runner.profile_run(64)
        assert memory.current == 0
        assert runner.model.model.aux_hidden_states == []
    finally:
        llm.shutdown()


def test_the_method_and_its_inference_from_the_path() -> None:
    spec = EngineConfig(speculative_config={"method": "eagle3", "model": "h"}).speculative
    assert spec.uses_eagle3 and spec.uses_eagle and spec.uses_draft_model

    def method(model: str) -> str:
        return EngineConfig(speculative_config={"model": model}).speculative.method

    assert method("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B") == "eagle3"
    assert method("AngelSlim/Qwen3-8B_eagle3") == "eagle3"
    with pytest.raises(ValueError, match="method 'eagle3' needs \"model\": the EAGLE-3 head"):
        EngineConfig(speculative_config={"method": "eagle3"})


def test_bad_heads_and_targets_are_refused_at_start_up(target_dir: Path, tmp_path: Path) -> None:
    """Each a one-line ``ValueError`` naming the problem."""

    def refused(head: Path, match: str, model: Path = target_dir, **engine) -> None:
        with pytest.raises(ValueError, match=match) as info:
            make_llm(model, head, **engine)
        assert "\n" not in str(info.value)

    no_d2t = write_eagle3_head(target_dir, tmp_path / "no_d2t", with_d2t=False)
    refused(no_d2t, r"drafts over 512 of the target's 49152 tokens but ships no d2t")
    out_of_range = write_eagle3_head(target_dir, tmp_path / "range", layer_ids=[1, 2, 4])
    refused(out_of_range, r"layer ids \[4\] are outside the target's layers 0 \.\. 3")
    bad_d2t = write_eagle3_head(
        target_dir, tmp_path / "bad_d2t", tensors={"d2t": torch.full((DRAFT_VOCAB,), 49152)}
    )
    refused(bad_d2t, r"d2t maps draft ids to target ids outside 0 \.\. 49151")
    refused(target_dir, r"not an EAGLE-3 head")  # a whole model
    two_layers = write_eagle3_head(
        target_dir, tmp_path / "two", tensors={"layers.1.norm.weight": torch.ones(64)}
    )
    refused(two_layers, r"decoder layers \['0', '1'\]: heads of one decoder layer")
    refused(no_d2t, r"cannot be combined with --torch-compile", torch_compile=True)
    # an EAGLE-3 head given as an EAGLE-1 head or a draft model: named
    as_eagle = {"method": "eagle", "model": str(no_d2t), "num_speculative_tokens": K}
    with pytest.raises(ValueError, match=r"is an EAGLE-3 head .* method 'eagle3'"):
        make_llm(target_dir, speculative_config=as_eagle)
    as_draft = {"method": "draft_model", "model": str(no_d2t), "num_speculative_tokens": K}
    with pytest.raises(ValueError, match=r"is an EAGLE-3 head .* method 'eagle3'"):
        make_llm(target_dir, speculative_config=as_draft)


def test_a_target_without_aux_hidden_states_is_refused(tmp_path: Path) -> None:
    """OLMo 2's decoder has a forward of its own that keeps no layer's input."""
    from test_olmo2_granite_models import write_checkpoint as write_olmo2

    target = write_olmo2("olmo2", tmp_path / "olmo2", num_hidden_layers=4)
    head = write_eagle3_head(target, tmp_path / "head")
    with pytest.raises(ValueError, match="does not expose auxiliary hidden states") as info:
        make_llm(target, head)
    assert "cannot run over this target" in str(info.value)


def test_a_target_with_kv_cache_groups_preemptions_and_cache_hits(tmp_path: Path) -> None:
    """Gemma 2 (window and full layers: two KV cache groups, the window's blocks released),
    a tight cache (preemptions) and the prompts twice (prefix-cache hits): the output is
    HF's and every proposal equals the reference over HF's Gemma 2 hidden states (kept after
    Gemma's embedding scale, as HF's ``hidden_states``)."""
    from test_eagle_spec import _llama_head_config_for
    from test_gemma_models import hf_greedy as gemma_hf_greedy
    from test_gemma_models import write_checkpoint as write_gemma
    from test_sliding_window_kv import make_llm as make_grouped_llm

    target = write_gemma(
        "gemma2",
        tmp_path / "gemma2",
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    head_dir = write_eagle3_head(
        _llama_head_config_for(target, tmp_path / "llama"), tmp_path / "head", layer_ids=[0, 1, 3]
    )
    prompts = PROMPTS[1:]
    spec = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": K}
    tight = {"num_kv_blocks": 40, "max_model_len": 104}
    llm = make_grouped_llm(target, release=True, speculative_config=spec, **tight)
    drafter = llm.engine.executor.worker.runner.drafter
    seen = record_proposals(drafter)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    try:
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
    reference = ReferenceEagle3(target, head_dir)
    assert len(seen) > 8
    for sequence, drafts in seen[:40]:
        assert drafts == reference.drafts(sequence, len(drafts))


def test_published_layouts_draft_as_the_safetensors_head(
    expected: list[list[int]], target_dir: Path, tmp_path: Path
) -> None:
    """The same weights as ``pytorch_model.bin`` (yuhuili layout) and in the speculators
    layout (config.json with speculators_model_type, transformer_layer_config,
    speculators_config; layers.0.* tensors in pytorch_model.bin, and in safetensors) propose
    the same drafts as the safetensors head, step for step; the output is plain decoding's."""
    head = write_eagle3_head(
        target_dir,
        tmp_path / "safetensors",
        layer_ids=[0, 2, 3],
        seed=3,
        config_overrides={"norm_before_residual": True},
    )
    heads = {
        "safetensors": head,
        "bin": write_pytorch_bin_copy(head, tmp_path / "bin"),
        "speculators": write_speculators_copy(head, tmp_path / "speculators"),
        "speculators_st": write_speculators_copy(
            head, tmp_path / "speculators_st", safetensors=True
        ),
    }
    assert not list(heads["speculators"].glob("*.safetensors"))
    results = {}
    for name, head_dir in heads.items():
        llm = make_llm(target_dir, head_dir)
        seen = record_proposals(llm.engine.executor.worker.runner.drafter)
        try:
            results[name] = (token_ids(llm, greedy()), seen)
        finally:
            llm.shutdown()
    tokens, proposals = results["safetensors"]
    assert tokens == expected and len(proposals) > 8
    for name, result in results.items():
        assert result == (tokens, proposals), name


def test_speculators_heads_the_head_cannot_run_are_refused(
    default_head: Path, target_dir: Path, tmp_path: Path
) -> None:
    """Another speculators model type, a decoder layer other than Llama's, an option the
    head lacks, and a speculators head given as an EAGLE-1 head: one-line errors naming it."""

    def refused(overrides: dict, match: str, method: str = "eagle3") -> None:
        head = write_speculators_copy(
            default_head, tmp_path / str(len(list(tmp_path.iterdir()))), overrides=overrides
        )
        spec = {"method": method, "model": str(head), "num_speculative_tokens": K}
        with pytest.raises(ValueError, match=match) as info:
            make_llm(target_dir, speculative_config=spec)
        assert "\n" not in str(info.value)

    refused({"speculators_model_type": "eagle"}, r"speculators 'eagle' checkpoint: only 'eagle3'")
    refused({"fc_norm": True}, r"sets \['fc_norm'\]: not supported")
    refused(
        {"transformer_layer_config": {"model_type": "qwen3", "hidden_size": 64}},
        r"'qwen3' decoder layer: Llama-style",
    )
    refused({}, r"speculators-layout config.json: that layout is read for EAGLE-3", "eagle")


@pytest.mark.parametrize("head", ["small_vocab", "default"])
def test_greedy_drafts_skip_the_full_vocabulary_and_equal_its_argmax(
    head: str, expected: list[list[int]], target_dir: Path, request: pytest.FixtureRequest
) -> None:
    """Greedy drafts are the argmax over the draft vocabulary mapped through d2t: equal to
    the argmax of the widened logits (DraftModelProposer.greedy_drafts, the reference) on
    random hidden states, and a greedy run never widens (compute_logits is not called)
    while its output stays plain decoding's."""
    from chassis.core.draft_model import DraftModelProposer

    llm = make_llm(target_dir, request.getfixturevalue(f"{head}_head"))
    drafter = llm.engine.executor.worker.runner.drafter
    try:
        hidden = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
        fast = drafter.greedy_drafts(hidden)
        assert torch.equal(fast, DraftModelProposer.greedy_drafts(drafter, hidden))
        widened = []
        compute_logits = drafter.model.compute_logits
        drafter.model.compute_logits = lambda h: widened.append(len(h)) or compute_logits(h)
        assert token_ids(llm, greedy()) == expected
        assert widened == [] and llm.engine.scheduler.stats().spec_num_draft_tokens > 0
    finally:
        llm.shutdown()
