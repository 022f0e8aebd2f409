"""Write a tiny Qwen3 config directory (random weights with ``--load-format dummy``).

Not a test: the model of the host-overhead measurements in docs/performance.md, whose
forward costs almost nothing, so that what a step costs is the engine's own host work::

    python tests/perf/tiny_config.py /tmp/tiny0 --layers 0
    python tests/perf/tiny_config.py /tmp/tiny --layers 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: hidden 64, 4 heads of 16 (2 KV heads), a 512-token vocabulary, tied embeddings
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (0 allowed)")
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, "num_hidden_layers": args.layers}
    (args.directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(args.directory / "config.json")


if __name__ == "__main__":
    main()
