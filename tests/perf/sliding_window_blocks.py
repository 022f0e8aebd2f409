"""KV blocks held with and without sliding-window release (docs/performance.md, "Sliding-window
KV release").

Not a test, and not a timing: it counts blocks, so the machine's load does not matter. A
Mistral-shaped model with random weights (``--load-format dummy``; 2 layers, hidden 64, every
layer windowed over 256 positions, block size 16) serves 16 requests of 1,024 prompt token
ids plus 64 generated tokens (``ignore_eos``), once with the release (the default) and once
with ``sliding_window_kv_release=False``::

    python tests/perf/sliding_window_blocks.py
    python tests/perf/sliding_window_blocks.py --shape gemma2

Per setting it prints: with an ample pool (2,048 blocks), the most blocks one request held
after any step (its 1,024-token prefill step allocates them all at once), the most a request
held while decoding, and the most blocks in use at once; with a pool of 200 blocks (3,200 tokens,
fewer than the 16 x 68 blocks the requests need kept whole), the most requests running at
once, the preemptions and the steps to finish. Takes well under a minute on the 2-core CPU.

``--shape gemma2``: a Gemma-2-shaped model instead (4 layers alternating a window of 256 and
full attention), whose two kinds of layers become two KV cache groups of 2 layers with the
release on; a block id then holds 2 layers' K/V where the single table's holds all 4, so
each pool gets the same memory (the release's pools have twice the block ids) and the
counts are also given in layer-blocks (block ids times the layers each holds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from chassis import LLM, SamplingParams

WINDOW = 256
BLOCK_SIZE = 16
NUM_REQUESTS = 16
PROMPT_LEN = 1024
MAX_TOKENS = 64

CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": WINDOW,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: the Gemma-2 shape: sliding and full layers alternate
GEMMA2_CONFIG = {
    **CONFIG,
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


def measure(model_dir: Path, release: bool, num_kv_blocks: int) -> dict[str, int]:
    """Run the requests with a pool of ``num_kv_blocks`` block ids; the counts seen."""
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=2048,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        sliding_window_kv_release=release,
    )
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = []
    for i in range(NUM_REQUESTS):
        prompt = [3 + (i * 7 + j) % 500 for j in range(PROMPT_LEN)]
        request = llm.input_processor.process(prompt, params, f"r{i}")[0]
        engine.add_request(request)
        ids.append(request.request_id)
    most_per_request = most_decoding = most_in_use = most_running = steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        most_per_request = max([most_per_request] + [kv.num_held_blocks(r) for r in ids])
        decoding = [r for r in engine.scheduler.running if r.num_computed_tokens > PROMPT_LEN]
        most_decoding = max([most_decoding] + [kv.num_held_blocks(r.request_id) for r in decoding])
        most_in_use = max(most_in_use, kv.block_pool.num_used_blocks)
        most_running = max(most_running, len(engine.scheduler.running))
    runner = engine.executor.worker.runner
    result = {
        "layers_per_block": runner._num_cache_tensors(),
        "most_blocks_one_request": most_per_request,
        "most_blocks_one_decoding_request": most_decoding,
        "most_blocks_in_use": most_in_use,
        "most_running": most_running,
        "preemptions": engine.scheduler.num_preemptions,
        "steps": steps,
    }
    llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("mistral", "gemma2"), default="mistral")
    args = parser.parse_args()
    config = GEMMA2_CONFIG if args.shape == "gemma2" else CONFIG
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        for release in (True, False):
            # the same memory for both: block ids of the grouped engine hold fewer layers
            scale = 2 if release and args.shape == "gemma2" else 1
            ample = measure(model_dir, release, 2048 * scale)
            tight = measure(model_dir, release, 200 * scale)
            layers = ample["layers_per_block"]
            print(
                f"release={release!s:5}  {layers} layers per block  ample pool "
                f"({2048 * scale}): one request at most {ample['most_blocks_one_request']} "
                f"blocks (decoding: {ample['most_blocks_one_decoding_request']}; "
                f"{ample['most_blocks_one_decoding_request'] * layers} layer-blocks), at most "
                f"{ample['most_blocks_in_use']} in use "
                f"({ample['most_blocks_in_use'] * layers} layer-blocks)  |  "
                f"{200 * scale} blocks: at most {tight['most_running']} running, "
                f"{tight['preemptions']} preemptions, {tight['steps']} steps"
            )


if __name__ == "__main__":
    main()
