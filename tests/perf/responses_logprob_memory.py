"""What a stored Responses API logprob entry costs in memory (serve/responses_store.py's
bound on stored logprobs, docs/serving.md).

Not a test. On the embedded SmolLM2's vocabulary::

    python tests/perf/responses_logprob_memory.py

builds 4,000 output-token entries with ``top_logprobs: 20`` in the shape the store keeps
(``ChatLogprobToken(...).model_dump(mode="json")``: token text, logprob, UTF-8 bytes and 20
alternatives, real token strings drawn at random), and prints the traced Python memory per
entry (a token or one of its alternatives) and per output token.
"""

from __future__ import annotations

import random
import tracemalloc

from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.tokenizer import load_tokenizer
from chassis.serve.protocol import ChatLogprobToken, ChatLogprobTop

NUM_TOKENS = 4_000
TOP_N = 20


def main() -> None:
    tokenizer = load_tokenizer(str(embedded_model_dir()))
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    rng = random.Random(0)

    def top() -> ChatLogprobTop:
        text = rng.choice(texts)
        return ChatLogprobTop(token=text, logprob=-rng.random() * 10, bytes=list(text.encode()))

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    stored = []
    for _ in range(NUM_TOKENS):
        head = top()
        entry = ChatLogprobToken(**head.model_dump(), top_logprobs=[top() for _ in range(TOP_N)])
        stored.append(entry.model_dump(mode="json"))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    entries = NUM_TOKENS * (1 + TOP_N)
    print(f"{NUM_TOKENS} tokens x (1 + {TOP_N}) entries: {used / 2**20:.1f} MiB traced")
    print(f"per entry: {used / entries:.0f} bytes; per output token: {used / NUM_TOKENS:.0f} bytes")
    print(f"1,000,000 entries (the store's bound): {used / entries * 1e6 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
