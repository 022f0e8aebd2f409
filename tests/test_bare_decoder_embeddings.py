"""Decoder embedding checkpoints that declare the bare decoder (``MistralModel``,
``LlamaModel``, ``Qwen2Model``, ``Qwen3Model``, ``Gemma2Model``): no LM head, tensors
without the ``model.`` prefix (``builtin_plugins/models/decoder_embedding.py``).

Each tiny checkpoint is saved as HF's bare class (``MistralModel(config).save_pretrained``)
with the SmolLM2 tokenizer; the reference is that class in float32, its
``last_hidden_state``'s last token, L2-normalized (vLLM's default pooling for these
architectures). The token budget is below the longest prompt, so it runs over several
steps.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_models import TINY_CONFIG_FIELDS

from chassis.core.llm import LLM
from chassis.core.pooler import finish_vector, pool_reference
from chassis.core.pooling_config import PoolerConfig

TOLERANCE = 1e-5
BUDGET = 24  # below the longest prompt: it is computed over several steps
ARCHITECTURES = ("MistralModel", "LlamaModel", "Qwen2Model", "Qwen3Model", "Gemma2Model")
TEXTS = ["Hello world", "a " * 40, "The quick brown fox jumps over the lazy dog."]


def _bare_config(architecture: str, **overrides: Any) -> Any:
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    fields: dict[str, Any] = {**TINY_CONFIG_FIELDS, "architectures": [architecture]}
    if architecture == "MistralModel":
        fields.update(sliding_window=None)
        config_cls: Any = MistralConfig
    elif architecture == "LlamaModel":
        config_cls = LlamaConfig
    elif architecture == "Qwen2Model":
        fields.update(rope_theta=1000000.0)
        config_cls = Qwen2Config
    elif architecture == "Qwen3Model":
        fields.update(head_dim=32)
        config_cls = Qwen3Config
    else:  # Gemma2Model: sliding layers (a window below the prompts), attention soft cap
        fields.update(
            head_dim=32,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        )
        config_cls = Gemma2Config
    fields.update(overrides)
    return config_cls(**fields)


def save_bare_checkpoint(architecture: str, directory: Path, seed: int = 0) -> Path:
    """A random float32 checkpoint of HF's bare decoder ``architecture`` (tensors without
    ``model.``, no ``lm_head``) with the SmolLM2 tokenizer; 1-D weights randomized (Gemma's
    norms around 0, the others' around 1) so a misplaced one shows."""
    import transformers

    from chassis.core.gguf_checkpoint import embedded_model_dir

    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(_bare_config(architecture))
    norm_base = 0.0 if architecture == "Gemma2Model" else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = norm_base if "norm" in name else 0.0
                param.copy_(base + 0.2 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def bare_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_bare_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=i)
        for i, arch in enumerate(ARCHITECTURES)
    }


def engine(model_dir: Path, **kwargs: Any) -> LLM:
    """A float32 engine of ``model_dir`` with the runner left at ``auto``."""
    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 128,
        "num_kv_blocks": 64,
        "max_num_batched_tokens": BUDGET,
        "enforce_eager": True,
        "attention_backend": "torch_paged",  # Gemma 2's soft cap and windows
    }
    settings.update(kwargs)
    return LLM(str(model_dir), **settings)


def hf_last_token(model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0]
    return finish_vector(pool_reference(hidden, "LAST"), None, True)


def assert_matches_hf(model: Any, outputs: list[Any]) -> None:
    for output in outputs:
        expected = hf_last_token(model, output.prompt_token_ids)
        got = torch.tensor(output.outputs.embedding)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_checkpoints_are_bare(bare_dirs: dict[str, Path]) -> None:
    from safetensors import safe_open

    for model_dir in bare_dirs.values():
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        assert "embed_tokens.weight" in names and "norm.weight" in names
        assert not any(n.startswith("model.") or n.startswith("lm_head") for n in names)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_embeddings_match_hf(bare_dirs: dict[str, Path], architecture: str) -> None:
    """Runner ``auto`` pools; several prompts in one step, a long one over several steps,
    then the same prompts again (prefix-cache hits): each the last token's normalized
    hidden state."""
    from transformers import AutoModel

    model_dir = bare_dirs[architecture]
    llm = engine(model_dir)
    try:
        assert llm.config.runner == "pooling"
        assert llm.pooler_config == PoolerConfig("LAST", True)
        long_ids = list(range(100, 190))  # > 3 x the token budget
        prompts: list[Any] = [*TEXTS, long_ids, [42]]
        first = llm.embed(prompts)
        again = llm.embed(prompts[::-1])
    finally:
        llm.shutdown()
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == architecture
    assert_matches_hf(hf.eval(), first + again)
    assert [o.prompt_token_ids for o in again] == [o.prompt_token_ids for o in first][::-1]


def test_generate_is_refused(bare_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="without its language-model head"):
        engine(bare_dirs["MistralModel"], runner="generate")


def test_prefixed_causal_lm_checkpoint_loads(tiny_llama_dir: Path) -> None:
    """A ``*ForCausalLM`` checkpoint named as the bare decoder (``model.``-prefixed tensors,
    an untied ``lm_head.weight``, skipped) pools as HF's decoder of it."""
    from safetensors import safe_open
    from transformers import AutoModel

    with safe_open(str(tiny_llama_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.norm.weight" in names
    llm = engine(tiny_llama_dir, hf_overrides={"architectures": ["LlamaModel"]})
    try:
        assert llm.config.runner == "pooling"
        outputs = llm.embed(TEXTS)
    finally:
        llm.shutdown()
    assert_matches_hf(AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32), outputs)


def test_is_causal_false_runs_bidirectionally(bare_dirs: dict[str, Path], tmp_path: Path) -> None:
    """``--hf-overrides '{"is_causal": false}'`` (vLLM's switch for gte-Qwen2): whole
    prompts, every token attending to all of its prompt, as HF's decoder with its attention
    made non-causal; a Gemma2Model is refused."""
    from transformers import Qwen2Model

    model_dir = bare_dirs["Qwen2Model"]
    whole = {"max_model_len": 64, "max_num_batched_tokens": 64}  # each prompt in one step
    llm = engine(model_dir, hf_overrides={"is_causal": False}, **whole)
    try:
        assert llm.config.runner == "pooling"
        assert not llm.config.enable_prefix_caching
        assert not llm.config.enable_chunked_prefill
        prompts: list[Any] = [*TEXTS, list(range(100, 164)), [42]]
        outputs = llm.embed(prompts)
    finally:
        llm.shutdown()
    hf = Qwen2Model.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    causal = [hf_last_token(hf, o.prompt_token_ids) for o in outputs]
    for layer in hf.layers:
        layer.self_attn.is_causal = False  # no mask for an unpadded prompt: SDPA's is_causal
    assert_matches_hf(hf.eval(), outputs)
    got = torch.tensor(outputs[1].outputs.embedding)
    assert (got - causal[1]).abs().max() > 1e-3  # not the causal decoder's

    with pytest.raises(ValueError, match="is_causal: false"):
        engine(bare_dirs["Gemma2Model"], hf_overrides={"is_causal": False})
    # the same switch in config.json
    config = json.loads((model_dir / "config.json").read_text())
    copy = tmp_path / "gte_like"
    shutil.copytree(model_dir, copy)
    (copy / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    llm = engine(copy, **whole)
    try:
        assert not llm.config.enable_prefix_caching
        again = llm.embed(TEXTS)
    finally:
        llm.shutdown()
    for a, b in zip(again, outputs, strict=False):
        assert a.outputs.embedding == b.outputs.embedding


@pytest.mark.timeout(300)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_two_ranks_embed_as_one(bare_dirs: dict[str, Path]) -> None:
    """Tensor parallelism over bare tensor names (the vocabulary rows of
    ``embed_tokens.weight``, the column/row shards): the vectors of two ranks equal one's."""
    model_dir = bare_dirs["MistralModel"]
    prompts: list[Any] = [*TEXTS, list(range(100, 170))]
    one = engine(model_dir)
    try:
        expected = [o.outputs.embedding for o in one.embed(prompts)]
    finally:
        one.shutdown()
    two = engine(model_dir, tensor_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in two.embed(prompts)]
    finally:
        two.shutdown()
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(e), atol=TOLERANCE, rtol=0)
