"""Tokens per GiB of bfloat16 KV cache for DeepSeek-style MLA, before (every head's padded key
and value) and with the latent cache (one plane of ``kv_lora_rank + qk_rope_head_dim``): the
table in docs/models.md, "DeepSeek-V2, V3 and GLM-4.5".

    python tests/perf/mla_kv_capacity.py

The per-layer bytes are the runner's formula (``ModelRunner.kv_cache_bytes_per_block``:
``prod(kv_cache_shape(1, block, kv_heads, head_dim)) // 2 * planes`` elements) over the
model's own ``MlaSpec``; the published configs' attention dimensions, no weights.
"""

from __future__ import annotations

import math

from transformers import DeepseekV3Config

from chassis.builtin_plugins.models.deepseek_v2 import MlaSpec
from chassis.core.attention import kv_cache_shape

BLOCK = 16
BF16 = 2
GIB = 2**30
#: name, layers, attention heads (kv_lora_rank 512, rope 64, nope 128, v 128 for all three)
MODELS = [("DeepSeek-V2-Lite", 27, 16), ("DeepSeek-V3", 61, 128), ("Kimi K2", 61, 64)]


def block_bytes(layers: int, kv_heads: int, head_dim: int, planes: int) -> int:
    return math.prod(kv_cache_shape(1, BLOCK, kv_heads, head_dim)) // 2 * planes * BF16 * layers


def main() -> None:
    print("| model | bytes/token before | tokens/GiB before | bytes/token now | tokens/GiB now |")
    for name, layers, heads in MODELS:
        config = DeepseekV3Config(
            num_hidden_layers=layers,
            num_attention_heads=heads,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        )
        spec = MlaSpec.from_config(config)
        padded = max(spec.qk_head_dim, spec.v_head_dim)
        before = block_bytes(layers, spec.num_heads, padded, planes=2)
        now = block_bytes(layers, 1, spec.cache_head_dim, planes=1)
        print(
            f"| {name} | {before // BLOCK:,} | {GIB // before * BLOCK:,} | "
            f"{now // BLOCK:,} | {GIB // now * BLOCK:,} |"
        )


if __name__ == "__main__":
    main()
