"""OPT and GPT-2 against HF transformers on tiny random float32 checkpoints.

Five checkpoints, 2 layers of hidden 64 and 4 heads of 16, every LayerNorm weight drawn
around 1 and bias around 0 (so a norm loaded in the wrong place changes the logits):

- ``opt``: opt-125m in miniature: norms before each block, a final norm, ReLU MLP, biases,
  the LM head tied to the embedding;
- ``opt-post-norm-proj``: opt-350m in miniature: norms after each residual add, no final
  norm, a 32-wide token embedding with ``project_in``/``project_out``, tied;
- ``opt-no-bias-gelu-untied``: ``enable_bias`` off, exact ``gelu``, an untied head (logits
  only);
- ``gpt2``: gpt2 in miniature: ``gelu_new``, fused ``c_attn`` Conv1D weights, tied;
- ``gpt2-layer-scaled``: ``scale_attn_by_inverse_layer_idx`` and
  ``reorder_and_upcast_attn`` on, exact ``gelu``, ``layer_norm_epsilon`` 1e-3, untied head.

Logits must match HF's (batched prefill, a decode, a chunk over a cached prefix); greedy
tokens and their logprobs through ``LLM`` must be HF's, also with chunked prefill, prefix
cache hits and two tensor-parallel ranks; the API server serves completions and refuses
chat without a template as vLLM does.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_lora import greedy_with_adapters, hf_merged_model, lora_engine, write_peft_adapter
from fixtures_lora import hf_greedy as lora_hf_greedy
from fixtures_models import TINY_CONFIG_FIELDS, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_llm_parity import MAX_TOKENS, PROMPTS, hf_greedy
from test_models_parity import PROMPTS as TOKEN_PROMPTS
from test_models_parity import Runner, check_parity, hf_logits, load_hf
from test_tensor_parallel import wait_for_no_workers

from chassis import LLM, SamplingParams
from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.builtin_plugins.models.gpt2 import GPT2LMHeadModel
from chassis.builtin_plugins.models.opt import OPTForCausalLM
from chassis.core import parallel_state
from chassis.core.lora import LoRARequest
from chassis.core.model_interface import ModelBuildContext
from chassis.core.tokenizer import load_tokenizer

_SHARED = {
    key: TINY_CONFIG_FIELDS[key]
    for key in ("vocab_size", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")
}
_OPT = {
    **_SHARED,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "ffn_dim": 128,
    "max_position_embeddings": 512,
    "word_embed_proj_dim": 64,
    "init_std": 0.1,
}
_GPT2 = {**_SHARED, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128, "n_positions": 512}

#: checkpoint name -> (model_type, config fields)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "opt": ("opt", _OPT),
    "opt-post-norm-proj": (
        "opt",
        {**_OPT, "do_layer_norm_before": False, "word_embed_proj_dim": 32},
    ),
    "opt-no-bias-gelu-untied": (
        "opt",
        {
            **_OPT,
            "enable_bias": False,
            "activation_function": "gelu",
            "tie_word_embeddings": False,
        },
    ),
    "gpt2": ("gpt2", _GPT2),
    "gpt2-layer-scaled": (
        "gpt2",
        {
            **_GPT2,
            "scale_attn_by_inverse_layer_idx": True,
            "reorder_and_upcast_attn": True,
            "activation_function": "gelu",
            "layer_norm_epsilon": 1e-3,
            "tie_word_embeddings": False,
        },
    ),
}


def tiny_config(name: str, **overrides: Any) -> Any:
    from transformers import GPT2Config, OPTConfig

    model_type, fields = CHECKPOINTS[name]
    config_class = OPTConfig if model_type == "opt" else GPT2Config
    return config_class(**{**fields, **overrides})


def is_layer_norm(name: str) -> bool:
    leaf = name.split(".")[-2] if "." in name else name
    return "norm" in leaf or leaf.startswith("ln_")


def write_checkpoint(config: Any, directory: Path, seed: int = 3) -> Path:
    """:func:`save_tiny_checkpoint`, then every LayerNorm redrawn: weights around 1, biases
    around 0 (GPT-2's ``ln_*`` names do not say ``norm``, and a bias around 1 on every unit
    of a tied head's input would make one token win whatever the prompt)."""
    directory = save_tiny_checkpoint(config, directory, seed)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if tensor.dim() == 1 and is_layer_norm(name):
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


def build(config: Any, max_model_len: int | None = None) -> Any:
    ctx = ModelBuildContext(
        attention_backend=TorchPagedAttention, dtype=torch.float32, max_model_len=max_model_len
    )
    model_class = OPTForCausalLM if config.model_type == "opt" else GPT2LMHeadModel
    return model_class(config, ctx)


# -- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_logits_match_transformers(model_dirs: dict[str, Path], name: str) -> None:
    """Two prompts prefilled together, a decode each, then a 2-token chunk each over the
    cached prefix (blocks of 4): every row's float32 logits equal HF's."""
    check_parity(model_dirs[name], TOKEN_PROMPTS, atol=1e-4)


def test_the_position_table_and_its_offset_change_the_answer(model_dirs: dict[str, Path]) -> None:
    """Not vacuous: reading OPT's table without its offset of 2, or GPT-2's from row 1,
    moves the logits away from HF's."""
    tokens = TOKEN_PROMPTS[0]
    for name, shifted_offset in (("opt", 0), ("gpt2", 1)):
        runner = Runner(model_dirs[name])
        expected = hf_logits(load_hf(model_dirs[name]), tokens)
        runner.model.model.position_offset = shifted_offset
        got = runner.step([tokens], [len(tokens)], [list(range(len(tokens) // 4 + 1))])
        assert (got - expected).abs().max() > 1e-2


def test_the_config_is_read(model_dirs: dict[str, Path]) -> None:
    opt = Runner(model_dirs["opt"]).model
    assert opt.model.position_offset == 2 and opt.model.embed_positions.num_embeddings == 514
    assert opt.model.norm is not None and opt.model.project_in is None
    assert opt.model.layers[0].pre_norm and opt.lm_head.weight is opt.model.embed_tokens.weight
    assert opt.model.layers[1].self_attn.qkv_proj.bias is not None
    post = Runner(model_dirs["opt-post-norm-proj"]).model
    assert post.model.norm is None and not post.model.layers[0].pre_norm
    assert post.model.embed_tokens.weight.shape == (TINY_CONFIG_FIELDS["vocab_size"], 32)
    assert post.model.project_in.weight.shape == (64, 32)
    assert post.model.project_out.weight.shape == (32, 64)
    gpt2 = Runner(model_dirs["gpt2"]).model
    assert gpt2.model.position_offset == 0 and gpt2.model.embed_positions.num_embeddings == 512
    assert [layer.self_attn.attn.backend.scale for layer in gpt2.model.layers] == [0.25, 0.25]
    assert gpt2.lm_head.weight is gpt2.model.embed_tokens.weight
    scaled = Runner(model_dirs["gpt2-layer-scaled"]).model
    assert [layer.self_attn.attn.backend.scale for layer in scaled.model.layers] == [0.25, 0.125]
    assert scaled.lm_head.weight is not scaled.model.embed_tokens.weight
    assert scaled.model.norm.eps == 1e-3


def test_bare_and_hub_names_load_the_same(model_dirs: dict[str, Path]) -> None:
    """OPT's ``decoder.*`` (no ``model.``) and GPT-2's bare ``h.*`` / ``wte`` with the old
    checkpoints' ``attn.bias`` / ``attn.masked_bias`` mask buffers load the same weights as
    the ``model.decoder.*`` / ``transformer.*`` names."""
    for name, strip in (("opt", "model."), ("gpt2", "transformer.")):
        reference = Runner(model_dirs[name]).model
        tensors = load_file(model_dirs[name] / "model.safetensors")
        renamed = [(key.removeprefix(strip), value) for key, value in tensors.items()]
        if name == "gpt2":
            mask = torch.tril(torch.ones(512, 512, dtype=torch.bool))[None, None]
            renamed += [("h.0.attn.bias", mask), ("h.1.attn.masked_bias", torch.tensor(-1e4))]
        model = build(reference.hf_config)
        assert len(model.load_weights(renamed)) == len(list(model.parameters()))
        for key, param in reference.named_parameters():
            assert torch.equal(model.get_parameter(key), param), key


def test_unknown_tensors_are_named() -> None:
    for name, bad in (
        ("opt", "model.encoder.layers.0.fc1.weight"),
        ("gpt2", "h.0.attn.q_attn.weight"),
    ):
        with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
            build(tiny_config(name)).load_weights([(bad, torch.zeros(64, 64))])


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("opt", {"activation_function": "silu"}, "activation_function 'silu'"),
        ("opt", {"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine"),
        ("gpt2", {"activation_function": "swish"}, "activation_function 'swish'"),
        ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    ],
    ids=["opt-silu", "opt-no-affine", "gpt2-swish", "gpt2-cross-attention"],
)
def test_unsupported_options_are_refused(
    name: str, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build(tiny_config(name, **overrides))


@pytest.mark.parametrize("name", ["opt", "gpt2"])
def test_max_model_len_is_bounded_by_the_position_table(name: str) -> None:
    build(tiny_config(name), max_model_len=512)
    with pytest.raises(ValueError, match=r"exceeds .* 512 learned positions"):
        build(tiny_config(name), max_model_len=513)


def test_max_model_len_past_the_table_is_refused_by_the_engine(
    model_dirs: dict[str, Path],
) -> None:
    with pytest.raises(ValueError, match="max-model-len 600 exceeds"):
        LLM(str(model_dirs["gpt2"]), dtype="float32", max_model_len=600)


@pytest.mark.parametrize("name", ["opt-post-norm-proj", "gpt2-layer-scaled"])
def test_the_model_builds_on_a_non_cpu_default_device(name: str) -> None:
    """Nothing mixes an explicit CPU tensor into a model built on another device."""
    ctx = ModelBuildContext(attention_backend=TorchPagedAttention, dtype=torch.bfloat16)
    config = tiny_config(name)
    model_class = OPTForCausalLM if config.model_type == "opt" else GPT2LMHeadModel
    with torch.device("meta"):
        model = model_class(config, ctx)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


# -- greedy generation and logprobs through LLM -----------------------------------------------


def hf_token_logprobs(model_dir: Path, prompt: str, tokens: list[int]) -> list[float]:
    """HF's log-probability of each generated token given what precedes it."""
    ids = load_tokenizer(model_dir)(prompt).input_ids
    logits = hf_logits(load_hf(model_dir), ids + tokens)
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(ids) - 1 + i, token]) for i, token in enumerate(tokens)]


def generate(model_dir: Path, prompts: list[str], **engine: Any) -> tuple[LLM, list[Any]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=128, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    return llm, [o.outputs[0] for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("name", [n for n in CHECKPOINTS if n != "opt-no-bias-gelu-untied"])
def test_greedy_tokens_and_logprobs_match_transformers(
    model_dirs: dict[str, Path], name: str
) -> None:
    """All prompts in one ``generate``: HF ``generate``'s greedy tokens, and each token's
    logprob equal to HF's (1e-4)."""
    model_dir = model_dirs[name]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    _, outputs = generate(model_dir, PROMPTS)
    assert [list(o.token_ids) for o in outputs] == expected
    assert len({tuple(tokens) for tokens in expected}) > 1  # not one token for every prompt
    for prompt, output, tokens in zip(PROMPTS[:2], outputs, expected, strict=False):
        got = [entry[token].logprob for entry, token in zip(output.logprobs, tokens, strict=True)]
        assert got == pytest.approx(hf_token_logprobs(model_dir, prompt, tokens), abs=1e-4)


@pytest.mark.parametrize("name", ["opt-post-norm-proj", "gpt2"])
def test_chunked_prefill_and_prefix_cache_keep_the_tokens(
    model_dirs: dict[str, Path], name: str
) -> None:
    """Prefills chunked to 16 tokens over blocks of 4, then the same prompts again served
    from the prefix cache: HF's tokens both times."""
    model_dir = model_dirs[name]
    tokenizer = load_tokenizer(model_dir)
    assert max(len(tokenizer(p).input_ids) for p in PROMPTS) > 2 * 4
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    llm, outputs = generate(model_dir, PROMPTS, max_num_batched_tokens=16, block_size=4)
    assert [list(o.token_ids) for o in outputs] == expected
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = llm.generate(PROMPTS, params)
    assert [list(o.outputs[0].token_ids) for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


# -- tensor parallel --------------------------------------------------------------------------


def test_each_rank_loads_its_heads_of_the_fused_c_attn(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two simulated ranks: GPT-2's ``c_attn`` ([in, 3 * hidden], transposed and split in
    q, k, v) gives each rank its two heads of each; ``c_fc`` columns and ``c_proj`` rows of
    the Conv1D weights are cut as Llama's ``up_proj`` / ``down_proj``; everything fills."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dirs["gpt2"])
    tensors = load_file(model_dirs["gpt2"] / "model.safetensors")
    c_attn = tensors["transformer.h.1.attn.c_attn.weight"].t()  # [3 * 64, 64]
    c_fc = tensors["transformer.h.1.mlp.c_fc.weight"].t()
    c_proj = tensors["transformer.h.1.mlp.c_proj.weight"].t()
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(rank, 2))
        model = build(config)
        assert len(model.load_weights(tensors.items())) == len(list(model.parameters()))
        heads = slice(32 * rank, 32 * (rank + 1))
        qkv = model.get_parameter("model.layers.1.self_attn.qkv_proj.weight")
        expected = torch.cat([c_attn[0:64][heads], c_attn[64:128][heads], c_attn[128:][heads]])
        assert torch.equal(qkv, expected)
        rows = slice(64 * rank, 64 * (rank + 1))
        assert torch.equal(model.get_parameter("model.layers.1.mlp.c_fc.weight"), c_fc[rows])
        assert torch.equal(model.get_parameter("model.layers.1.mlp.c_proj.weight"), c_proj[:, rows])


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_match_transformers(model_dirs: dict[str, Path]) -> None:
    """Two real ranks of the opt-350m-shaped checkpoint: half the heads and half the MLP
    columns each, biases cut or added once, half the vocabulary rows of the 32-wide
    embedding, the position table and project_in/out whole; HF's greedy tokens (GPT-2's
    fused ``c_attn`` cut: the simulated-rank test above)."""
    model_dir = model_dirs["opt-post-norm-proj"]
    expected = hf_greedy(model_dir, PROMPTS, MAX_TOKENS)
    llm, outputs = generate(model_dir, PROMPTS, tensor_parallel_size=2)
    assert [list(o.token_ids) for o in outputs] == expected
    del llm
    gc.collect()  # the engine is gone, and with it the worker rank
    wait_for_no_workers()


# -- LoRA -------------------------------------------------------------------------------------


def test_opt_lora_adapters_match_the_merged_model(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A PEFT adapter on OPT's q/k/v_proj, out_proj, fc1 and fc2 (the checkpoint's names)
    gives the greedy tokens of HF's model with ``scale * B @ A`` merged in; the base model
    in the same batch keeps its own."""
    model_dir = model_dirs["opt-post-norm-proj"]
    targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    adapter = write_peft_adapter(tmp_path / "adapter", model_dir, targets=targets)
    ids = load_tokenizer(model_dir)(PROMPTS[2]).input_ids
    expected_lora = lora_hf_greedy(hf_merged_model(model_dir, adapter), ids, 8)
    expected_base = lora_hf_greedy(hf_merged_model(model_dir, None), ids, 8)
    assert expected_lora != expected_base
    llm = lora_engine(model_dir)
    loras = [LoRARequest("a", 1, str(adapter)), None]
    assert greedy_with_adapters(llm, loras, [ids, ids], 8) == [expected_lora, expected_base]


def test_opt_lora_slices_name_the_checkpoint_modules_whole(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On rank 1 of 2: ``qkv_proj`` holds the q/k/v slices of this rank's heads under the
    checkpoint's names and whole shapes; ``out_proj`` and ``fc2`` are cut by columns."""
    monkeypatch.setattr(parallel_state, "_GROUP", parallel_state.TensorParallelGroup(1, 2))
    model = build(tiny_config("opt"))
    layer = "model.layers.1."
    found = {
        name: [tuple(s) for s in model.lora_slices(layer + name, model.get_submodule(layer + name))]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.c_fc", "mlp.c_proj")
    }
    hf = "model.decoder.layers.1."
    assert found == {
        "self_attn.qkv_proj": [
            (hf + "self_attn.q_proj", 0, 32, 64, 64),
            (hf + "self_attn.k_proj", 32, 32, 64, 64),
            (hf + "self_attn.v_proj", 64, 32, 64, 64),
        ],
        "self_attn.o_proj": [(hf + "self_attn.out_proj", 0, 64, 64, 64)],
        "mlp.c_fc": [(hf + "fc1", 0, 64, 64, 128)],
        "mlp.c_proj": [(hf + "fc2", 0, 64, 128, 64)],
    }
    a, b = torch.randn(8, 128), torch.randn(64, 8)
    a_part, b_part = model.lora_shard(hf + "fc2", a, b)
    assert torch.equal(a_part, a[:, 64:]) and torch.equal(b_part, b)
    a, b = torch.randn(8, 64), torch.randn(64, 8)
    a_part, b_part = model.lora_shard(hf + "self_attn.k_proj", a, b)
    assert torch.equal(a_part, a) and torch.equal(b_part, b[32:])


# -- serving ----------------------------------------------------------------------------------


def test_completions_are_served_and_chat_needs_a_template(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """With no chat template in the tokenizer (as gpt2's and opt's have none),
    ``/v1/completions`` answers HF's greedy text and ``/v1/chat/completions`` is a 400
    that says to pass ``--chat-template``."""
    from fastapi.testclient import TestClient

    from chassis.core.async_llm import AsyncLLM
    from chassis.core.config import EngineConfig
    from chassis.serve.app import build_app
    from chassis.serve.settings import ServerSettings

    model_dir = tmp_path / "gpt2-no-template"
    model_dir.mkdir()
    for path in model_dirs["gpt2"].iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (model_dir / extra).unlink(missing_ok=True)
    [expected] = hf_greedy(model_dir, PROMPTS[1:2], MAX_TOKENS)

    engine = AsyncLLM.from_engine_config(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=64)
    )
    try:
        with TestClient(build_app(engine, ServerSettings(shutdown_engine_on_exit=False))) as client:
            body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            completion = client.post("/v1/completions", json={**body, "prompt": PROMPTS[1]})
            messages = [{"role": "user", "content": "Hello"}]
            chat = client.post("/v1/chat/completions", json={**body, "messages": messages})
    finally:
        engine.shutdown_sync()
    assert completion.status_code == 200, completion.text
    text = load_tokenizer(model_dir).decode(expected, skip_special_tokens=True)
    assert completion.json()["choices"][0]["text"] == text
    assert chat.status_code == 400, chat.text
    assert "--chat-template" in chat.json()["error"]["message"]
