"""``Phi3ForCausalLM`` against HF transformers: tiny Phi-3 checkpoints with plain RoPE (and a
sliding window), with Phi-4-mini's ``partial_rotary_factor`` 0.75, and with LongRoPE; the
fused ``qkv_proj``/``gate_up_proj`` loading and its tensor-parallel sharding."""

from __future__ import annotations

import gc
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fixtures_models import allocate_block_tables, new_kv_caches
from safetensors.torch import load_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import BLOCK_SIZE, NUM_BLOCKS, Runner, check_parity, load_hf
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_sliding_window_models import TINY, check_window_parity, write_checkpoint
from test_tensor_parallel import wait_for_no_workers

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.llama import LlamaForCausalLM
from chassis.builtin_plugins.models.phi3 import Phi3ForCausalLM, split_fused
from chassis.core import parallel_state
from chassis.core.config import EngineConfig
from chassis.core.layers.rotary import RotaryEmbedding, longrope_attention_factor, rope_parameters
from chassis.core.model_interface import ModelBuildContext
from chassis.core.model_loader import build_model, load_hf_config

#: LongRoPE's original_max_position_embeddings (max_position_embeddings is 512)
ORIGINAL_MAX = 32


def longrope(num_factors: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(num_factors)],
        "long_factor": [2.0 + 1.5 * i for i in range(num_factors)],
    }


def phi3_config(**fields: Any) -> Any:
    from transformers import Phi3Config

    return Phi3Config(**{**TINY, **fields})


#: name -> Phi3Config fields (head_dim 16: rotary_dim 12 with the factor 0.75)
CONFIGS = {
    "default_rope": {"sliding_window": 6},
    "partial_rotary": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    "longrope": {
        "partial_rotary_factor": 0.75,
        "rope_scaling": longrope(6),
        "original_max_position_embeddings": ORIGINAL_MAX,
    },
}


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_checkpoint(phi3_config(**fields), tmp_path_factory.mktemp(name), seed=5)
        for name, fields in CONFIGS.items()
    }


class ContextRunner(Runner):
    """:class:`Runner` for an engine with ``--max-model-len max_model_len``."""

    def __init__(self, model_dir: Path, max_model_len: int) -> None:
        self.hf_config = load_hf_config(model_dir)
        config = EngineConfig(model=str(model_dir), max_model_len=max_model_len)
        self.model = build_model(
            config, self.hf_config, model_dir, TorchPagedAttention, "cpu", torch.float32
        )
        self.kv_caches = new_kv_caches(self.hf_config, NUM_BLOCKS, BLOCK_SIZE)
        self.generator = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("name", ["default_rope", "partial_rotary"])
def test_logits_match_transformers(phi3_dirs: dict[str, Path], name: str) -> None:
    check_parity(phi3_dirs[name], TOKEN_PROMPTS, atol=1e-4)


def test_sliding_window_matches_transformers(phi3_dirs: dict[str, Path]) -> None:
    runner = check_window_parity(phi3_dirs["default_rope"])
    assert {layer.self_attn.attn.sliding_window for layer in runner.model.model.layers} == {6}


def test_longrope_within_the_original_length_matches_transformers(
    phi3_dirs: dict[str, Path],
) -> None:
    """``--max-model-len`` <= ORIGINAL_MAX: the short factors and the attention factor, as HF
    uses them for such sequences (prefill, chunk over a cached prefix, decodes; 24 tokens)."""
    runner = ContextRunner(phi3_dirs["longrope"], ORIGINAL_MAX)
    check_window_parity(phi3_dirs["longrope"], runner=runner)


def test_longrope_tables(phi3_dirs: dict[str, Path]) -> None:
    """The short factors for a context within ORIGINAL_MAX, else the long ones; cos/sin
    scaled by sqrt(1 + log(512 / 32) / log(32)); the last 4 of 16 head dims do not rotate."""
    params = rope_parameters(phi3_config(**CONFIGS["longrope"]))
    scale = math.sqrt(1 + math.log(512 / 32) / math.log(32))
    assert longrope_attention_factor(params) == pytest.approx(scale)
    exponents = torch.arange(0, 12, 2).float() / 12
    for context_len, factors in [(32, "short_factor"), (33, "long_factor"), (None, "long_factor")]:
        rope = RotaryEmbedding(16, 512, params, context_len=context_len)
        assert rope.rotary_dim == 12 and rope.cos_cache.shape == (512, 6)
        inv_freq = 1.0 / (torch.tensor(params[factors]) * 10000.0**exponents)
        torch.testing.assert_close(rope.cos_cache[37], (37 * inv_freq).cos() * scale)
        torch.testing.assert_close(rope.sin_cache[5], (5 * inv_freq).sin() * scale)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    q_rot, k_rot = rope(torch.tensor([0, 5, 40]), q.clone(), k.clone())
    assert torch.equal(q_rot[..., 12:], q[..., 12:]) and torch.equal(k_rot[..., 12:], k[..., 12:])
    assert not torch.equal(q_rot[1:, :, :12], q[1:, :, :12])


def test_longrope_past_the_original_length_matches_transformers(
    phi3_dirs: dict[str, Path],
) -> None:
    """A longer ``--max-model-len``: the long factors everywhere. HF uses them for every
    position of a sequence longer than ORIGINAL_MAX: its single forward over 40 tokens, and
    its forward over each sequence of 33 tokens or more, equal ours, decoded token by token
    past the crossing; before the crossing HF's short factors differ. (The reference is not
    HF's ``generate``: it drops its cache at the crossing, and transformers 5.17, the H200
    image's, then runs the last token alone; 5.24 recomputes the whole sequence.)"""
    model_dir = phi3_dirs["longrope"]
    hf_model = load_hf(model_dir)
    prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = ContextRunner(model_dir, 64)
    tables = allocate_block_tables([52], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    ours = torch.cat(
        [runner.step([prompt[:25]], [25], tables), runner.step([prompt[25:]], [40], tables)]
    )
    with torch.no_grad():
        torch.testing.assert_close(
            ours, hf_model(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4
        )
        expected = torch.stack(
            [hf_model(torch.tensor([prompt[:n]])).logits[0, -1] for n in range(28, 41)]
        )
    runner = ContextRunner(model_dir, 64)
    logits = runner.step([prompt[:28]], [28], tables)[-1:]
    for n in range(29, 41):
        logits = torch.cat([logits, runner.step([[prompt[n - 1]]], [n], tables)])
    # row i predicts the token after position 27 + i: rows 5.. ran on sequences past 32
    torch.testing.assert_close(logits[5:], expected[5:], atol=1e-4, rtol=1e-4)
    assert (logits[:5] - expected[:5]).abs().max() > 1e-3


def llm_greedy(model_dir: Path, prompts: list[str], max_model_len: int) -> list[list[int]]:
    llm = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=max_model_len,
        num_kv_blocks=128,
        attention_backend="torch_paged",
        max_num_batched_tokens=16,
        block_size=4,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("max_model_len", "prompts"),
    [(ORIGINAL_MAX, [PROMPTS[0], PROMPTS[1], PROMPTS[4]]), (256, [PROMPTS[3], PROMPTS[2] * 2])],
    ids=["within-original", "beyond-original"],
)
def test_longrope_greedy_generation_matches_transformers(
    phi3_dirs: dict[str, Path], max_model_len: int, prompts: list[str]
) -> None:
    """Through ``LLM`` with chunked prefill: short prompts within ORIGINAL_MAX, and prompts
    longer than ORIGINAL_MAX with a long ``--max-model-len``."""
    expected = hf_greedy(phi3_dirs["longrope"], prompts, MAX_TOKENS)
    assert llm_greedy(phi3_dirs["longrope"], prompts, max_model_len) == expected


def test_greedy_generation_with_a_window_matches_transformers(phi3_dirs: dict[str, Path]) -> None:
    expected = hf_greedy(phi3_dirs["default_rope"], PROMPTS, MAX_TOKENS)
    engine = {"attention_backend": "torch_paged", "max_num_batched_tokens": 16, "block_size": 4}
    assert chassis_greedy(phi3_dirs["default_rope"], PROMPTS, MAX_TOKENS, **engine) == expected


# -- configs -----------------------------------------------------------------------------------


def test_rope_parameters_of_a_transformers_4_phi3_config() -> None:
    """4.x configs: ``rope_scaling`` with the old type name, top-level
    ``partial_rotary_factor`` and ``original_max_position_embeddings``."""
    config = SimpleNamespace(
        rope_theta=250000.0,
        rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
        partial_rotary_factor=0.75,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
    )
    params = rope_parameters(config)
    assert params["rope_type"] == "longrope"
    assert params["partial_rotary_factor"] == 0.75
    assert params["original_max_position_embeddings"] == 4096
    assert params["factor"] == 32.0
    assert rope_parameters(SimpleNamespace(rope_theta=1e4))["rope_type"] == "default"


def test_partial_rotation_calls_the_qk_norm_modules() -> None:
    """With ``qk_norms`` a partial rotation normalizes with the modules it is given (any
    module, not only RMSNorm), then rotates the first ``rotary_dim`` dimensions."""
    params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}
    rope = RotaryEmbedding(16, 64, params)
    norms = (torch.nn.LayerNorm(16), torch.nn.Tanh())
    positions = torch.tensor([0, 3, 9])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with torch.no_grad():
        q_rot, k_rot = rope(positions, q.clone(), k.clone(), norms)
        expected = rope(positions, norms[0](q), norms[1](k))
    torch.testing.assert_close(q_rot, expected[0])
    torch.testing.assert_close(k_rot, expected[1])


def test_bad_rotary_configs_are_refused() -> None:
    params = {**longrope(6), "original_max_position_embeddings": 8, "factor": 8.0}
    params["long_factor"] = params["long_factor"][:5]  # checked even when the short ones serve
    with pytest.raises(ValueError, match="long_factor must be a list of 6 numbers"):
        RotaryEmbedding(16, 64, {**params, "partial_rotary_factor": 0.75}, context_len=8)
    with pytest.raises(ValueError, match="even, non-zero rotary_dim"):
        RotaryEmbedding(
            16, 64, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}
        )


# -- fused weights --------------------------------------------------------------------------


def test_fused_tensors_split_into_row_slices() -> None:
    spec = Phi3ForCausalLM.decoder_spec(phi3_config())  # 4 heads, 2 KV heads of 16
    qkv = torch.arange(128.0).unsqueeze(1)
    parts = dict(split_fused("model.layers.3.self_attn.qkv_proj.weight", qkv, spec))
    assert list(parts) == [f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv"]
    q, k, v = parts.values()
    assert (q[0, 0], q[-1, 0], k[0, 0], k[-1, 0], v[0, 0], v[-1, 0]) == (0, 63, 64, 95, 96, 127)
    gate, up = dict(
        split_fused("model.layers.0.mlp.gate_up_proj.weight", torch.zeros(256, 64), spec)
    ).values()
    assert gate.shape == up.shape == (128, 64)
    assert split_fused("model.norm.weight", qkv, spec) == [("model.norm.weight", qkv)]
    with pytest.raises(ValueError, match="has 100 rows, expected 128 \\(64 \\+ 32 \\+ 32"):
        split_fused("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(100, 64), spec)


def test_fused_loading_reports_filled_parameters(phi3_dirs: dict[str, Path]) -> None:
    model = Runner(phi3_dirs["default_rope"]).model
    prefix = "model.layers.1."
    tensors = load_file(phi3_dirs["default_rope"] / "model.safetensors")
    filled = model.load_weights(
        [
            (n, tensors[n])
            for n in (prefix + "self_attn.qkv_proj.weight", prefix + "mlp.gate_up_proj.weight")
        ]
    )
    assert filled == {prefix + "self_attn.qkv_proj.weight", prefix + "mlp.gate_up_proj.weight"}


def test_each_rank_loads_its_sections_of_the_fused_tensors(
    phi3_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks: each one's ``qkv_proj`` holds its q heads, its KV head's k and
    v rows; its ``gate_up_proj`` its gate and up columns; everything equal to a Llama model
    loading the same weights as separate tensors."""
    from transformers import AutoConfig

    model_dir = phi3_dirs["default_rope"]
    config = AutoConfig.from_pretrained(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    separate: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if "qkv_proj" in name:
            for part, rows in zip("qkv", tensor.split([64, 32, 32]), strict=True):
                separate[name.replace("qkv_proj", f"{part}_proj")] = rows
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            separate[name.replace("gate_up_proj", "gate_proj")] = gate
            separate[name.replace("gate_up_proj", "up_proj")] = up
        else:
            separate[name] = tensor
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        phi3 = Phi3ForCausalLM(config, ctx)
        assert len(phi3.load_weights(tensors.items())) == len(list(phi3.parameters()))
        llama = LlamaForCausalLM(config, ctx)
        llama.load_weights(separate.items())
        for (name, ours), (_, reference) in zip(
            phi3.state_dict().items(), llama.state_dict().items(), strict=True
        ):
            assert torch.equal(ours, reference), name
        qkv = tensors["model.layers.0.self_attn.qkv_proj.weight"]
        expected = torch.cat(
            [
                qkv[32 * rank : 32 * (rank + 1)],
                qkv[64 + 16 * rank : 80 + 16 * rank],
                qkv[96 + 16 * rank : 112 + 16 * rank],
            ]
        )
        assert torch.equal(phi3.get_parameter("model.layers.0.self_attn.qkv_proj.weight"), expected)
        gate_up = tensors["model.layers.0.mlp.gate_up_proj.weight"]
        expected = torch.cat(
            [gate_up[64 * rank : 64 * (rank + 1)], gate_up[128 + 64 * rank : 192 + 64 * rank]]
        )
        assert torch.equal(phi3.get_parameter("model.layers.0.mlp.gate_up_proj.weight"), expected)


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_tensor_parallel_ranks_match_transformers(phi3_dirs: dict[str, Path]) -> None:
    """Partial RoPE and fused weights split over two real ranks: HF's greedy tokens."""
    model_dir = phi3_dirs["partial_rotary"]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()
