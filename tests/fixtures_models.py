"""Tiny HF checkpoints and hand-built attention metadata, shared by model and engine tests.

``tests/conftest.py`` registers the fixtures (once for the run: a session fixture imported
into a test module would be that module's own, built again); a test module imports only the
helpers it calls (``write_tiny_checkpoint``, ``make_attention_metadata``, ...).

Session fixtures (each a directory with ``config.json``, ``model.safetensors`` and the
SmolLM2 tokenizer, so real text round-trips):

- ``tiny_llama_dir``: ``LlamaForCausalLM``, untied ``lm_head``, Llama-3 RoPE scaling.
- ``tiny_qwen2_dir``: ``Qwen2ForCausalLM`` (QKV bias), tied embeddings.
- ``tiny_qwen3_dir``: ``Qwen3ForCausalLM`` (q/k norm, ``head_dim`` 32 != hidden / heads).
- ``smollm2_dir``: the converted embedded SmolLM2-135M-Instruct (the real model).
- ``tiny_mixtral_dir``, ``tiny_qwen2_moe_dir``, ``tiny_qwen3_moe_dir``: mixture-of-experts
  models (:data:`TINY_MOE_ARCHITECTURES`): Mixtral with 4 experts of intermediate 64, top 2;
  Qwen2-MoE with 4 experts of 32, top 2, a shared expert of 48 and a dense second layer
  (``mlp_only_layers``); Qwen3-MoE with 8 experts of 32, top 2, ``norm_topk_prob``.

All tiny models: 2 layers, hidden 64, 4 heads, 2 KV heads, intermediate 128, 512 positions,
vocab 49,152, float32 weights from ``torch.manual_seed(seed)`` (biases and norm weights
randomized too). ``initializer_range`` is 0.1
(HF's default is 0.02) so logits are peaked enough that greedy choices do not hinge on rounding.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from chassis.core.attention import AttentionMetadata, kv_cache_shape

__all__ = [
    "TINY_ARCHITECTURES",
    "TINY_CONFIG_FIELDS",
    "TINY_MOE_ARCHITECTURES",
    "allocate_block_tables",
    "make_attention_metadata",
    "new_kv_caches",
    "save_tiny_checkpoint",
    "smollm2_dir",
    "tiny_llama_dir",
    "tiny_mixtral_dir",
    "tiny_qwen2_dir",
    "tiny_qwen2_moe_dir",
    "tiny_qwen3_dir",
    "tiny_qwen3_moe_dir",
    "write_tiny_checkpoint",
]

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3")
TINY_MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

#: the config fields every tiny model shares (other test modules build their configs on them)
TINY_CONFIG_FIELDS: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def _tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(TINY_CONFIG_FIELDS)
    if arch == "llama":
        common.update(
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        common.update(overrides)
        return LlamaConfig(**common)
    if arch == "qwen2":
        common.update(tie_word_embeddings=True, rope_theta=1000000.0)
        common.update(overrides)
        return Qwen2Config(**common)
    if arch == "qwen3":
        common.update(tie_word_embeddings=False, head_dim=32)
        common.update(overrides)
        return Qwen3Config(**common)
    if arch == "mixtral":
        common.update(
            intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
        )
        common.update(overrides)
        return MixtralConfig(**common)
    if arch == "qwen2_moe":
        common.update(
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
        common.update(overrides)
        return Qwen2MoeConfig(**common)
    if arch == "qwen3_moe":
        common.update(
            tie_word_embeddings=False,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
        common.update(overrides)
        return Qwen3MoeConfig(**common)
    known = ", ".join(TINY_ARCHITECTURES + TINY_MOE_ARCHITECTURES)
    raise ValueError(f"unknown tiny architecture {arch!r}; known: {known}")


def write_tiny_checkpoint(arch: str, directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random HF checkpoint of ``arch`` (one of :data:`TINY_ARCHITECTURES` or
    :data:`TINY_MOE_ARCHITECTURES`) to ``directory``.

    ``overrides`` replace config fields (e.g. ``attention_bias=True``). The SmolLM2 tokenizer
    is copied in (this converts the embedded model once if it is not cached yet).
    """
    return save_tiny_checkpoint(_tiny_config(arch, **overrides), directory, seed)


def save_tiny_checkpoint(
    config: Any,
    directory: Path,
    seed: int = 0,
    *,
    norm_base: float = 1.0,
    scale: float = 0.1,
) -> Path:
    """Save a random float32 HF model of ``config`` to ``directory`` with the SmolLM2
    tokenizer.

    Weights come from ``torch.manual_seed(seed)``. HF initializes biases to 0 and norm
    weights to 1; every 1-D parameter is randomized to ``base + scale * randn`` (``base``:
    ``norm_base`` for norms, 0 otherwise; Gemma's norms store an offset from 1, so its tests
    pass ``norm_base=0``), so that a bias or norm weight loaded into the wrong place (or the
    wrong shard) changes the logits.
    """
    from transformers import AutoModelForCausalLM

    from chassis.core.gguf_checkpoint import embedded_model_dir

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = norm_base if "norm" in name else 0.0
                param.copy_(base + scale * torch.randn_like(param))
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer_source = embedded_model_dir()
    for name in _TOKENIZER_FILES:
        shutil.copy(tokenizer_source / name, directory / name)
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("tiny_mixtral"))


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("tiny_qwen2_moe"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted to the chassis cache (read-only use)."""
    from chassis.core.gguf_checkpoint import embedded_model_dir

    return embedded_model_dir()


def allocate_block_tables(
    seq_lens: Sequence[int],
    block_size: int,
    num_blocks: int,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Give each request enough distinct physical blocks, in a random (non-contiguous) order."""
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, only {num_blocks} in the cache")
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n])
        start += n
    return tables


def make_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    num_tokens: int | None = None,
    pad_block_id: int = 0,
) -> AttentionMetadata:
    """Metadata for a batch where request ``i`` adds its last ``query_lens[i]`` of ``seq_lens[i]``
    tokens, whose K/V go to the slots its ``block_tables[i]`` implies.

    ``num_tokens`` > ``sum(query_lens)`` appends padding rows (slot -1). Block-table rows are
    padded with ``pad_block_id`` (backends must ignore entries past a request's own blocks).
    """
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 0 < q_len <= s_len or len(table) * block_size < s_len:
            raise ValueError(f"bad request: query {q_len}, seq {s_len}, {len(table)} blocks")
        for pos in range(s_len - q_len, s_len):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    num_actual = len(slots)
    total = num_actual if num_tokens is None else num_tokens
    slots += [-1] * (total - num_actual)
    width = max(len(t) for t in block_tables)
    table = [list(t) + [pad_block_id] * (width - len(t)) for t in block_tables]
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=num_actual,
        num_reqs=len(query_lens),
        query_start_loc=starts.to(device),
        seq_lens=lens.to(device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


def new_kv_caches(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Zeroed per-layer paged KV caches for a model with ``hf_config``."""
    num_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [
        torch.zeros(shape, dtype=dtype, device=device)
        for _ in range(int(hf_config.num_hidden_layers))
    ]


def hf_greedy_tokens(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_tokens: int
) -> list[list[int]]:
    """HF ``generate``'s greedy continuation of each prompt (tokenized with special tokens),
    exactly ``max_tokens`` new token ids each (EOS does not stop it): the reference the
    parity tests compare chassis' greedy tokens with."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs
