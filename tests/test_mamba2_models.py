"""State-space models (Mamba2 mixers) against HF transformers on tiny random float32
checkpoints: Granite 4.0-H (``GraniteMoeHybridForCausalLM``: mamba + attention layers, MoE
and dense, RoPE and NoPE), Bamba (half-rotary attention, dense MLP), Nemotron-H (mamba,
MLP and attention blocks) and ``Mamba2ForCausalLM``.

The mixers have 8 heads of 16 in 2 groups, d_state 16, conv window 4 and a scan chunk of 8
(so prompts span several chunks); A_log, D, dt_bias, conv biases and every norm weight are
randomized (``save_tiny_checkpoint``). Logits must match HF's (prefill of two requests
packed in one step, a decode, a 2-token chunk over the carried state, a step mixing a chunk
and a decode); greedy tokens and logprobs through ``LLM`` must be HF ``generate``'s, with
chunked prefill, preemption, async scheduling and more requests than state slots (the
checks shared by the state-space models' tests: tests/state_space_helpers.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS
from state_space_helpers import (
    StateRunner,
    check_forward_without_state_slots,
    check_greedy_tokens,
    check_logits,
    check_logprobs,
    check_prefill,
    check_prefix_caching_off,
    check_spec_decoding_refused,
    saved_checkpoint,
)
from test_llm_parity import PROMPTS
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_olmo2_granite_models import GRANITE_MULTIPLIERS

from chassis.core.layers.mamba2_mixer import Mamba2Mixer
from chassis.core.layers.ssd_scan import ssd_chunked_varlen, ssd_recurrence
from chassis.core.request_state_cache import RequestStatePool

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
    """The checkpoints of :data:`ARCHS` (seed 5; shared with tests/test_request_state_pool.py)."""
    return {arch: mamba2_checkpoint(tmp_path_factory, arch) for arch in ARCHS}


def mamba2_checkpoint(factory: pytest.TempPathFactory, arch: str) -> Path:
    """``arch``'s tiny checkpoint (of :func:`tiny_config`, seed 5), saved once per run."""
    return saved_checkpoint(factory, f"mamba2-models-{arch}", lambda: tiny_config(arch), seed=5)


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
    runner.use_reference(Mamba2Mixer)
    check_prefill(runner, model_dirs["mamba2"], TOKEN_PROMPTS[0])


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
    check_greedy_tokens(model_dirs[arch])


@pytest.mark.parametrize("setting", ["chunked-prefill", "two-slots", "preemption", "async"])
def test_engine_settings_keep_the_tokens(model_dirs: dict[str, Path], setting: str) -> None:
    check_greedy_tokens(model_dirs["granite_moe_rope"], setting)


@pytest.mark.parametrize("arch", ["granite_dense_nope", "mamba2"])
def test_logprobs_match_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    check_logprobs(model_dirs[arch])


def test_a_forward_without_state_slots_starts_from_zero(model_dirs: dict[str, Path]) -> None:
    check_forward_without_state_slots(model_dirs["granite_moe_rope"])


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
    check_prefix_caching_off(model_dirs["mamba2"], caplog)
    check_spec_decoding_refused(model_dirs["mamba2"])
