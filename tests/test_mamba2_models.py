"""State-space models (Mamba2 mixers) against HF transformers on tiny random float32
checkpoints: Granite 4.0-H (``GraniteMoeHybridForCausalLM``: mamba + attention layers, MoE
and dense, RoPE and NoPE), Bamba (half-rotary attention, dense MLP), Nemotron-H (mamba,
MLP and attention blocks) and ``Mamba2ForCausalLM``.

The mixers have 8 heads of 16 in 2 groups, d_state 16, conv window 4 and a scan chunk of 8
(so prompts span several chunks); A_log, D, dt_bias, conv biases and every norm weight are
randomized (``save_tiny_checkpoint``). Logits must match HF's (prefill of two requests
packed in one step, a decode, a 2-token chunk over the carried state, a step mixing a chunk
and a decode); greedy tokens and logprobs through ``LLM`` must be HF ``generate``'s, with
chunked prefill, preemption, async scheduling and more requests than state slots.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS, make_attention_metadata, save_tiny_checkpoint
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import hf_logits, load_hf
from test_olmo2_granite_models import GRANITE_MULTIPLIERS

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core.attention import ForwardContext, kv_cache_shape
from chassis.core.config import EngineConfig
from chassis.core.layers.mamba2_mixer import Mamba2Mixer
from chassis.core.layers.ssd_scan import ssd_chunked_varlen, ssd_recurrence
from chassis.core.model_loader import build_model, load_hf_config
from chassis.core.request_state_cache import RequestStatePool

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAMBA_FIELDS: dict[str, Any] = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}
ARCHS = ("granite_moe_rope", "granite_dense_nope", "mamba2", "bamba", "nemotron_h")


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import BambaConfig, GraniteMoeHybridConfig, Mamba2Config, NemotronHConfig

    if arch == "nemotron_h":
        fields = {
            key: TINY_CONFIG_FIELDS[key]
            for key in (
                "vocab_size",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "bos_token_id",
                "eos_token_id",
                "pad_token_id",
            )
        }
        fields.update(
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
            head_dim=16,
            intermediate_size=48,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            tie_word_embeddings=False,
        )
        return NemotronHConfig(**{**fields, **overrides})
    if arch == "bamba":
        fields = {**TINY_CONFIG_FIELDS, **MAMBA_FIELDS, "tie_word_embeddings": False}
        fields.update(num_hidden_layers=3, attn_layer_indices=[1], intermediate_size=48)
        return BambaConfig(**{**fields, **overrides})
    if arch == "mamba2":
        fields = {
            key: TINY_CONFIG_FIELDS[key]
            for key in ("vocab_size", "hidden_size", "bos_token_id", "eos_token_id", "pad_token_id")
        }
        fields.update(
            num_hidden_layers=3,
            num_heads=8,
            head_dim=16,
            state_size=16,
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=8,
            tie_word_embeddings=False,
        )
        return Mamba2Config(**{**fields, **overrides})
    fields = {
        **TINY_CONFIG_FIELDS,
        **GRANITE_MULTIPLIERS,
        **MAMBA_FIELDS,
        "tie_word_embeddings": False,
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "intermediate_size": 32,
        "shared_intermediate_size": 48,
    }
    if arch == "granite_moe_rope":
        fields.update(num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope")
    else:
        fields.update(num_local_experts=0, position_embedding_type=None)
    return GraniteMoeHybridConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_tiny_checkpoint(tiny_config(arch), tmp_path_factory.mktemp(arch), seed=5)
        for arch in ARCHS
    }


class StateRunner:
    """Our model, paged KV caches for its attention layers and a request-state pool."""

    def __init__(self, model_dir: Path, num_slots: int = 4) -> None:
        hf_config = load_hf_config(model_dir)
        config = EngineConfig(model=str(model_dir))
        self.model = build_model(
            config, hf_config, model_dir, TorchPagedAttention, "cpu", torch.float32
        )
        heads = getattr(hf_config, "num_attention_heads", 1)
        kv_heads = getattr(hf_config, "num_key_value_heads", heads)
        shape = kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, kv_heads, hf_config.hidden_size // heads)
        self.kv_caches = [torch.zeros(shape) for _ in range(self.model.num_attention_layers)]
        self.pool = RequestStatePool(self.model.request_state_specs(), num_slots, "cpu")

    def step(
        self, tokens: list[list[int]], seq_lens: list[int], request_ids: list[str]
    ) -> torch.Tensor:
        query_lens = [len(t) for t in tokens]
        per_request = NUM_BLOCKS // 4
        tables = [
            list(range(int(r) * per_request, (int(r) + 1) * per_request)) for r in request_ids
        ]
        metadata = make_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        ids = torch.tensor([t for seq in tokens for t in seq])
        positions = torch.tensor(
            [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
        )
        ctx = ForwardContext(metadata, self.kv_caches)
        ctx.request_states = self.pool.tensors
        ctx.state_slots = torch.from_numpy(self.pool.slots(request_ids))
        with torch.no_grad():
            return self.model.compute_logits(self.model(ids, positions, ctx))


def check_logits(model_dir: Path, atol: float = 1e-4) -> None:
    runner = StateRunner(model_dir)
    hf_model = load_hf(model_dir)
    prompts = [TOKEN_PROMPTS[0] * 2, TOKEN_PROMPTS[1]]  # 26 and 3 tokens
    ids = ["0", "1"]
    for r in ids:
        runner.pool.allocate(r)
    seq_lens = [len(p) for p in prompts]
    logits = runner.step(prompts, seq_lens, ids)
    start, following = 0, []
    for prompt in prompts:
        expected = hf_logits(hf_model, prompt)
        torch.testing.assert_close(
            logits[start : start + len(prompt)], expected, atol=atol, rtol=1e-4
        )
        following.append(int(expected[-1].argmax()))
        start += len(prompt)
    # one decode each, from the carried states (and KV)
    logits = runner.step([[t] for t in following], [n + 1 for n in seq_lens], ids)
    extended = [[*p, t] for p, t in zip(prompts, following, strict=True)]
    for i, tokens in enumerate(extended):
        torch.testing.assert_close(logits[i], hf_logits(hf_model, tokens)[-1], atol=atol, rtol=1e-4)
    # a 2-token chunk each over the carried state
    logits = runner.step([[5, 77], [9, 11]], [n + 3 for n in seq_lens], ids)
    for i, (tokens, more) in enumerate(zip(extended, ([5, 77], [9, 11]), strict=True)):
        expected = hf_logits(hf_model, tokens + more)[-2:]
        torch.testing.assert_close(logits[2 * i : 2 * i + 2], expected, atol=atol, rtol=1e-4)
        extended[i] = tokens + more
    # a mixed step: a 3-token chunk for the first request, one token for the second
    logits = runner.step([[8, 9, 10], [12]], [seq_lens[0] + 6, seq_lens[1] + 4], ids)
    expected = hf_logits(hf_model, extended[0] + [8, 9, 10])[-3:]
    torch.testing.assert_close(logits[:3], expected, atol=atol, rtol=1e-4)
    expected = hf_logits(hf_model, extended[1] + [12])[-1]
    torch.testing.assert_close(logits[3], expected, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_logits(model_dirs[arch])


def test_the_layers_are_read(model_dirs: dict[str, Path]) -> None:
    runner = StateRunner(model_dirs["granite_moe_rope"])
    model = runner.model
    kinds = [layer.mamba is not None for layer in model.model.layers]
    assert kinds == [True, False, True] and model.num_attention_layers == 1
    assert model.model.layers[1].self_attn.attn.layer_idx == 0  # its KV cache
    specs = model.request_state_specs()
    # conv [conv_dim = 128 + 2 * 2 * 16, d_conv - 1], ssm [heads, head_dim, d_state]
    assert [s.shape for s in specs] == [(192, 3), (8, 16, 16)] * 2
    assert model.graph_capture_blocker() is not None
    assert StateRunner(model_dirs["mamba2"]).model.num_attention_layers == 0


def test_the_chunked_scan_is_the_recurrence() -> None:
    """Prefill's chunked scan of several packed requests (lengths below, at and across the
    chunk size, chunks handled 3 at a time) equals the token-by-token reference of each,
    from nonzero states."""
    gen = torch.Generator().manual_seed(0)
    heads, head_dim, groups, d_state = 4, 8, 2, 6
    A = -torch.rand(heads, generator=gen) - 0.2
    D = torch.randn(heads, generator=gen)
    lengths = [1, 5, 8, 19, 2, 17]
    total = sum(lengths)
    x = torch.randn(total, heads, head_dim, generator=gen)
    dt = torch.rand(total, heads, generator=gen)
    B = torch.randn(total, groups, d_state, generator=gen)
    C = torch.randn(total, groups, d_state, generator=gen)
    h0 = torch.randn(len(lengths), heads, head_dim, d_state, generator=gen)
    y, h = ssd_chunked_varlen(h0, x, dt, A, B, C, D, lengths, 8, max_chunks_at_once=3)
    start = 0
    for r, n in enumerate(lengths):
        part = slice(start, start + n)
        y_ref, h_ref = ssd_recurrence(h0[r], x[part], dt[part], A, B[part], C[part], D)
        torch.testing.assert_close(y[part], y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h[r], h_ref, atol=1e-5, rtol=1e-5)
        start += n


def test_the_reference_path_matches_transformers(model_dirs: dict[str, Path]) -> None:
    """The mixers' token-by-token reference scan in the model gives HF's logits too."""
    runner = StateRunner(model_dirs["mamba2"])
    for module in runner.model.modules():
        if isinstance(module, Mamba2Mixer):
            module.use_reference = True
    prompt = TOKEN_PROMPTS[0]
    runner.pool.allocate("0")
    logits = runner.step([prompt], [len(prompt)], ["0"])
    expected = hf_logits(load_hf(model_dirs["mamba2"]), prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_state_slots_are_zeroed_and_reused() -> None:
    from chassis.core.request_state_cache import RequestStateSpec

    pool = RequestStatePool([RequestStateSpec("s", (2,), torch.float32)], 2, "cpu")
    a = pool.allocate("a")
    pool.tensors[0][a] = 7.0
    pool.allocate("b")
    with pytest.raises(RuntimeError, match="no free request-state slot"):
        pool.allocate("c")
    pool.free("a")
    assert pool.allocate("c") == a and torch.equal(pool.tensors[0][a], torch.zeros(2))


# -- greedy generation through LLM ------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """All prompts (1 to 40 tokens) in one ``generate``."""
    model_dir = model_dirs[arch]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS) == expected


@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_batched_tokens": 7, "block_size": 4},  # chunked prefill, chunks of <= 7
        {"max_num_seqs": 2},  # more requests than state slots: slots are reused
        {"num_kv_blocks": 28, "block_size": 4, "max_num_batched_tokens": 16},  # preemption
        {"async_scheduling": True, "max_num_batched_tokens": 16, "block_size": 4},
    ],
    ids=["chunked-prefill", "two-slots", "preemption", "async"],
)
def test_engine_settings_keep_the_tokens(model_dirs: dict[str, Path], engine: dict) -> None:
    model_dir = model_dirs["granite_moe_rope"]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    kwargs = dict(engine)
    if "num_kv_blocks" in kwargs:  # (chassis_greedy sets its own)
        from chassis.core.llm import LLM
        from chassis.core.sampling_params import SamplingParams

        llm = LLM(str(model_dir), dtype="float32", max_model_len=100, **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        got = chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, **kwargs)
    assert got == expected


@pytest.mark.parametrize("arch", ["granite_dense_nope", "mamba2"])
def test_logprobs_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    """Each sampled token's logprob (prompts of different lengths in one batch) is HF's
    log-softmax at that position over the whole sequence."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams
    from chassis.core.tokenizer import load_tokenizer

    model_dir = model_dirs[arch]
    prompts = PROMPTS[1:4]
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    hf_model = load_hf(model_dir)
    tokenizer = load_tokenizer(model_dir)
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        completion = output.outputs[0]
        logits = hf_logits(hf_model, prompt_ids + completion.token_ids)
        expected = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
        assert completion.token_ids == expected.argmax(-1).tolist()
        got = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        want = expected.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)


def test_a_forward_without_state_slots_starts_from_zero(model_dirs: dict[str, Path]) -> None:
    """A memory-profiling forward (no pool in the context) is a fresh prefill and keeps
    nothing: HF's logits, the pool untouched."""
    runner = StateRunner(model_dirs["granite_moe_rope"])
    prompt = TOKEN_PROMPTS[0]
    metadata = make_attention_metadata([len(prompt)], [len(prompt)], [list(range(4))], BLOCK_SIZE)
    ctx = ForwardContext(metadata, runner.kv_caches)
    with torch.no_grad():
        logits = runner.model.compute_logits(
            runner.model(torch.tensor(prompt), torch.arange(len(prompt)), ctx)
        )
    expected = hf_logits(load_hf(model_dirs["granite_moe_rope"]), prompt)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert all(not t.any() for t in runner.pool.tensors)


def test_a_fixed_kv_budget_holds_the_state_pool(model_dirs: dict[str, Path]) -> None:
    """With ``--kv-cache-memory`` the state pool's bytes come off the budget before the KV
    blocks are counted; the pool has ``--max-num-seqs`` slots, held by exactly the requests
    of the runner's persistent batch."""
    from chassis.core.llm import LLM
    from chassis.core.sampling_params import SamplingParams

    budget = 4 * 2**20
    llm = LLM(
        str(model_dirs["granite_moe_rope"]),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=3,
        kv_cache_memory=budget,
    )
    runner = llm.engine.executor.worker.runner
    pool = runner.request_states
    # two mamba layers: conv [192, 3] + ssm [8, 16, 16], float32, per slot
    assert pool.num_slots == 3 and pool.bytes_per_slot == 2 * 4 * (192 * 3 + 8 * 16 * 16)
    assert runner.num_kv_blocks == (budget - pool.nbytes) // runner.kv_cache_bytes_per_block()
    for _ in range(2):  # (the runner hears of the last finished requests in the next step)
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3))
        # the slots held are those of the requests in the persistent batch
        assert set(pool.slot_of) == set(runner.batch.row_of)
        assert pool.num_free + len(pool.slot_of) == 3


def test_prefix_caching_is_off_and_spec_decoding_refused(
    model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from chassis.core.llm import LLM

    model_dir = model_dirs["mamba2"]
    with caplog.at_level(logging.INFO, logger="chassis.core.request_state_cache"):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=64, num_kv_blocks=32)
    assert llm.config.enable_prefix_caching is False
    assert "prefix caching is off" in caplog.text
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(
            str(model_dir),
            dtype="float32",
            max_model_len=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
