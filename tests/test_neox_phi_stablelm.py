"""GPT-NeoX, Phi, StableLM and GPT-J against HF transformers on tiny random float32
checkpoints.

Each checkpoint has 2 layers of hidden 64 and 4 heads of 16 (2 KV heads where the
architecture has GQA), LayerNorm weights around 1 and biases around 0 (so a norm loaded into
the wrong place, or RMSNorm in place of LayerNorm, changes the logits), and a partial RoPE:

- ``neox-parallel``: ``use_parallel_residual`` (two norms), ``rotary_pct`` 0.25, exact GELU;
- ``neox-sequential``: the sequential residual, 0.5 of each head rotated, ``gelu_new``, no
  attention biases;
- ``phi``: one norm feeding attention and MLP, 0.5 rotated, GQA, LM head bias;
- ``phi-qk-norm``: ``qk_layernorm`` (shared LayerNorms over head_dim), 0.75 rotated;
- ``stablelm``: the sequential residual, ``use_qkv_bias``, 0.25 rotated, GQA;
- ``stablelm-parallel-qk-norm``: ``use_parallel_residual`` (one norm) and per-head q/k
  LayerNorms;
- ``gptj``: interleaved RoPE over ``rotary_dim`` 8 of 16, LM head bias.

Logits must match HF's (a batched prefill, a decode, a chunk over a cached prefix); greedy
tokens and their logprobs through ``LLM`` must be HF's ``generate``'s; two simulated
tensor-parallel ranks load their shares (GPT-NeoX's per-head Q/K/V, StableLM's per-head
norms, the LM head's bias), and two real ranks generate HF's tokens (Phi).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import greedy_with_adapters, hf_merged_model, lora_engine, write_peft_adapter
from fixtures_lora import hf_greedy as hf_greedy_ids
from fixtures_models import save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, chassis_greedy, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_tensor_parallel import wait_for_no_workers

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.gpt_neox import GPTNeoXForCausalLM
from chassis.builtin_plugins.models.gptj import GPTJForCausalLM
from chassis.builtin_plugins.models.parallel_residual import ParallelResidualLayer
from chassis.builtin_plugins.models.phi import PhiForCausalLM
from chassis.builtin_plugins.models.stablelm import PerHeadLayerNorm, StableLmForCausalLM
from chassis.builtin_plugins.models.starcoder2 import LayerNorm
from chassis.core import parallel_state
from chassis.core.lora import LoRARequest
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

_COMMON = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}

#: checkpoint name -> (transformers config class name, fields over _COMMON)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "neox-parallel": (
        "GPTNeoXConfig",
        {"use_parallel_residual": True, "rotary_pct": 0.25, "hidden_act": "gelu"},
    ),
    "neox-sequential": (
        "GPTNeoXConfig",
        {
            "use_parallel_residual": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000.0,
                "partial_rotary_factor": 0.5,
            },
            "hidden_act": "gelu_new",
            "attention_bias": False,
            "layer_norm_eps": 1e-3,
        },
    ),
    "phi": (
        "PhiConfig",
        {"num_key_value_heads": 2, "partial_rotary_factor": 0.5, "hidden_act": "gelu_new"},
    ),
    "phi-qk-norm": (
        "PhiConfig",
        {"qk_layernorm": True, "partial_rotary_factor": 0.75, "hidden_act": "gelu_new"},
    ),
    "stablelm": (
        "StableLmConfig",
        {"num_key_value_heads": 2, "use_qkv_bias": True, "partial_rotary_factor": 0.25},
    ),
    "stablelm-parallel-qk-norm": (
        "StableLmConfig",
        {
            "num_key_value_heads": 2,
            "use_parallel_residual": True,
            "qk_layernorm": True,
            "partial_rotary_factor": 0.5,
        },
    ),
    "gptj": ("GPTJConfig", {"rotary_dim": 8, "n_inner": 128}),
}

#: the architecture each checkpoint builds
CLASSES = {
    "neox-parallel": GPTNeoXForCausalLM,
    "neox-sequential": GPTNeoXForCausalLM,
    "phi": PhiForCausalLM,
    "phi-qk-norm": PhiForCausalLM,
    "stablelm": StableLmForCausalLM,
    "stablelm-parallel-qk-norm": StableLmForCausalLM,
    "gptj": GPTJForCausalLM,
}


def tiny_config(name: str, **overrides: Any) -> Any:
    import transformers

    class_name, fields = CHECKPOINTS[name]
    common = dict(_COMMON)
    if class_name == "GPTJConfig":  # GPT-J's own field names (n_inner is in its fields)
        del common["intermediate_size"]
    return getattr(transformers, class_name)(**{**common, **fields, **overrides})


def _is_layer_norm(name: str) -> bool:
    return "norm" in name or ".ln_" in name


def write_checkpoint(config: Any, directory: Path, seed: int = 5) -> Path:
    """:func:`save_tiny_checkpoint`, then every LayerNorm's weight redrawn around 1 and its
    bias around 0 (GPT-J's ``ln_*`` names do not say ``norm``)."""
    directory = save_tiny_checkpoint(config, directory, seed)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if _is_layer_norm(name):
            base = 1.0 if name.endswith(".weight") else 0.0
            tensors[name] = base + 0.1 * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_checkpoint(tiny_config(name), tmp_path_factory.mktemp(name))
        for name in CHECKPOINTS
    }


def build(name: str, config: Any | None = None) -> Any:
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.float32)
    return CLASSES[name](config if config is not None else tiny_config(name), ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_transformers(model_dirs: dict[str, Path], name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dirs[name], TOKEN_PROMPTS, atol=1e-4)


def test_the_residual_layout_and_the_head_bias_change_the_answer(
    model_dirs: dict[str, Path],
) -> None:
    """Not vacuous: HF's logits move when GPT-NeoX's residual is switched to the other
    layout and when GPT-J's LM head bias is zeroed."""
    tokens = list(range(100, 116))
    neox = load_hf(model_dirs["neox-parallel"])
    parallel = hf_logits(neox, tokens)
    for layer in neox.gpt_neox.layers:
        layer.use_parallel_residual = False
    assert (hf_logits(neox, tokens) - parallel).abs().max() > 1e-2
    gptj = load_hf(model_dirs["gptj"])
    with_bias = hf_logits(gptj, tokens)
    with torch.no_grad():
        gptj.lm_head.bias.zero_()
    assert (hf_logits(gptj, tokens) - with_bias).abs().max() > 1e-2


def test_the_config_is_read(model_dirs: dict[str, Path]) -> None:
    neox = Runner(model_dirs["neox-parallel"]).model
    layer = neox.model.layers[0]
    assert isinstance(layer, ParallelResidualLayer) and layer.parallel and not layer.shared_norm
    assert isinstance(layer.post_attention_layernorm, LayerNorm)
    assert layer.self_attn.rotary_emb.rotary_dim == 4
    assert layer.self_attn.qkv_proj.bias is not None and layer.mlp.gelu_approximate == "none"
    assert neox.lm_head.bias is None
    sequential = Runner(model_dirs["neox-sequential"]).model.model.layers[1]
    assert not sequential.parallel and sequential.self_attn.qkv_proj.bias is None
    assert sequential.input_layernorm.eps == 1e-3 and sequential.mlp.gelu_approximate == "tanh"
    phi = Runner(model_dirs["phi-qk-norm"]).model
    layer = phi.model.layers[1]
    assert layer.shared_norm and not hasattr(layer, "post_attention_layernorm")
    assert isinstance(layer.self_attn.q_norm, LayerNorm)
    assert layer.self_attn.rotary_emb.rotary_dim == 12 and phi.lm_head.bias is not None
    stablelm = Runner(model_dirs["stablelm-parallel-qk-norm"]).model.model.layers[0]
    assert stablelm.parallel and stablelm.shared_norm
    assert isinstance(stablelm.self_attn.k_norm, PerHeadLayerNorm)
    assert stablelm.self_attn.k_norm.weight.shape == (2, 16)
    assert not Runner(model_dirs["stablelm"]).model.model.layers[0].parallel
    gptj = Runner(model_dirs["gptj"]).model
    rotary = gptj.model.layers[0].self_attn.rotary_emb
    assert rotary.interleaved and rotary.rotary_dim == 8 and gptj.lm_head.bias is not None


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("neox-parallel", {"hidden_act": "relu"}, "GPT-NeoX hidden_act 'relu'"),
        ("phi", {"hidden_act": "silu"}, "Phi hidden_act 'silu'"),
        ("gptj", {"activation_function": "relu"}, "GPT-J activation_function 'relu'"),
        ("gptj", {"rotary_dim": 7}, "rotary_dim 7"),
        ("stablelm", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_options_are_refused(name: str, overrides: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        build(name, tiny_config(name, **overrides))


def test_a_per_head_norm_without_qk_layernorm_is_refused(model_dirs: dict[str, Path]) -> None:
    model = build("stablelm")
    with pytest.raises(ValueError, match="qk_layernorm"):
        model.load_weights(
            [("model.layers.0.self_attn.q_layernorm.norms.0.weight", torch.ones(16))]
        )


def test_an_unknown_tensor_is_refused_under_its_checkpoint_name() -> None:
    model = build("gptj")
    with pytest.raises(ValueError, match=r"checkpoint name 'transformer\.h\.0\.attn\.mystery"):
        model.load_weights([("transformer.h.0.attn.mystery.weight", torch.ones(3))])


def test_a_fused_qkv_of_the_wrong_size_is_refused() -> None:
    model = build("neox-parallel")
    with pytest.raises(ValueError, match="query_key_value"):
        model.load_weights(
            [("gpt_neox.layers.0.attention.query_key_value.weight", torch.ones(3, 64))]
        )


# -- greedy generation and logprobs through LLM -----------------------------------------------


def hf_greedy_logprobs(model_dir: Path, prompt: str, tokens: list[int]) -> list[float]:
    """HF's log-softmax of each of ``tokens`` after ``prompt`` and the tokens before it."""
    model = load_hf(model_dir)
    ids = load_tokenizer(model_dir)(prompt).input_ids
    logits = hf_logits(model, ids + tokens)[len(ids) - 1 : -1]
    return logits.log_softmax(-1)[torch.arange(len(tokens)), tokens].tolist()


@pytest.mark.parametrize("name", ["neox-parallel", "phi", "stablelm-parallel-qk-norm", "gptj"])
def test_greedy_tokens_and_logprobs_match_transformers(
    model_dirs: dict[str, Path], name: str
) -> None:
    """All prompts in one ``generate``; tokens equal HF ``generate``'s, and each token's
    logprob equals HF's log-softmax at that step."""
    model_dir = model_dirs[name]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    assert [o.token_ids for o in outputs] == expected
    for prompt, output in zip(PROMPTS[:2], outputs[:2], strict=True):
        assert output.logprobs is not None
        steps = zip(output.token_ids, output.logprobs, strict=True)
        ours = [position[token].logprob for token, position in steps]
        theirs = hf_greedy_logprobs(model_dir, prompt, output.token_ids)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=0)


# -- tensor parallel and LoRA names -----------------------------------------------------------


def _two_ranks(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))


def test_each_rank_loads_its_heads_of_the_fused_qkv(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks of GPT-NeoX: rank r's ``qkv_proj`` holds heads 2r and 2r + 1 of
    q, then of k, then of v, cut out of the per-head ``[heads, 3, head_dim]`` rows; every
    parameter fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs["neox-parallel"])
    tensors = load_file(model_dirs["neox-parallel"] / "model.safetensors")
    fused = tensors["gpt_neox.layers.1.attention.query_key_value.weight"].reshape(4, 3, 16, 64)
    for rank in (0, 1):
        _two_ranks(monkeypatch, rank)
        model = build("neox-parallel", config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        heads = fused[2 * rank : 2 * rank + 2]
        expected = torch.cat([heads[:, i].reshape(32, 64) for i in range(3)])
        assert torch.equal(
            model.get_parameter("model.layers.1.self_attn.qkv_proj.weight"), expected
        )


def test_each_rank_loads_its_heads_norms_and_lm_head_bias(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """StableLM's per-head norms keep this rank's heads' rows; Phi's and GPT-J's LM head
    bias is cut by vocabulary rows as the head's weight."""
    from transformers import AutoConfig

    stablelm = model_dirs["stablelm-parallel-qk-norm"]
    tensors = load_file(stablelm / "model.safetensors")
    for rank in (0, 1):
        _two_ranks(monkeypatch, rank)
        model = build("stablelm-parallel-qk-norm", AutoConfig.from_pretrained(stablelm))
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        q_norm = model.get_parameter("model.layers.0.self_attn.q_norm.weight")
        prefix = "model.layers.0.self_attn.q_layernorm.norms"
        assert torch.equal(q_norm[1], tensors[f"{prefix}.{2 * rank + 1}.weight"])
        k_norm = model.get_parameter("model.layers.0.self_attn.k_norm.weight")
        assert k_norm.shape == (1, 16)
        assert torch.equal(k_norm[0], tensors[f"{prefix.replace('q_', 'k_')}.{rank}.weight"])
    for name in ("phi", "gptj"):
        tensors = load_file(model_dirs[name] / "model.safetensors")
        for rank in (0, 1):
            _two_ranks(monkeypatch, rank)
            model = build(name, AutoConfig.from_pretrained(model_dirs[name]))
            assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
            rows = slice(24576 * rank, 24576 * (rank + 1))
            assert torch.equal(model.lm_head.bias, tensors["lm_head.bias"][rows])


def test_lora_slices_carry_the_checkpoint_names() -> None:
    """Adapters name the checkpoint's modules: our renamed layers report those names."""
    phi = build("phi")
    names = {
        s.hf_module
        for module_name, module in phi.named_modules()
        if module_name.startswith("model.layers.0.")
        for s in phi.lora_slices(module_name, module)
    }
    assert names == {
        f"model.layers.0.{'mlp' if leaf.startswith('fc') else 'self_attn'}.{leaf}"
        for leaf in ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")
    }
    neox = build("neox-parallel")
    names = {
        s.hf_module
        for module_name, module in neox.named_modules()
        if module_name.startswith("model.layers.1.")
        for s in neox.lora_slices(module_name, module)
    }
    assert names == {
        "gpt_neox.layers.1.attention.dense",
        "gpt_neox.layers.1.mlp.dense_h_to_4h",
        "gpt_neox.layers.1.mlp.dense_4h_to_h",
    }
    gptj = build("gptj")
    slices = gptj.lora_slices(
        "model.layers.0.self_attn.o_proj", gptj.model.layers[0].self_attn.o_proj
    )
    assert [s.hf_module for s in slices] == ["transformer.h.0.attn.out_proj"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Two real Phi ranks: half the heads (one KV head each), half the MLP columns, half
    the vocabulary rows of the LM head and its bias; HF's greedy tokens."""
    model_dir = model_dirs["phi"]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    assert chassis_greedy(model_dir, PROMPTS, MAX_TOKENS, tensor_parallel_size=2) == expected
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()


#: each architecture's adaptable projections, by their checkpoint names
LORA_TARGETS = {
    "phi": ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"),
    "neox-sequential": ("dense", "dense_h_to_4h", "dense_4h_to_h"),
    "gptj": ("q_proj", "v_proj", "out_proj", "fc_in", "fc_out"),
}


@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_lora_adapters_match_hf_merged(
    model_dirs: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """A random PEFT adapter on every adaptable projection (checkpoint names): greedy
    tokens equal HF's with the adapter merged into its weights, and differ from the base."""
    model_dir = model_dirs[name]
    adapter = write_peft_adapter(tmp_path / "a", model_dir, targets=LORA_TARGETS[name])
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [TOKEN_PROMPTS[0]]
    got = greedy_with_adapters(lora_engine(model_dir), [lora], prompts, MAX_TOKENS)
    reference = hf_merged_model(model_dir, adapter)
    assert got == [hf_greedy_ids(reference, prompts[0], MAX_TOKENS)]
    assert got[0] != hf_greedy_ids(hf_merged_model(model_dir, None), prompts[0], MAX_TOKENS)


def test_lora_on_neox_fused_qkv_is_refused(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = model_dirs["neox-parallel"]
    adapter = write_peft_adapter(tmp_path / "a", model_dir, targets=("query_key_value",))
    lora = LoRARequest("a", 1, str(adapter))
    with pytest.raises(ValueError, match=r"query_key_value.*adaptable here: dense"):
        greedy_with_adapters(lora_engine(model_dir), [lora], [TOKEN_PROMPTS[0]], 2)
