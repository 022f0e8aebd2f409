"""What reasoning + tool-call parsing costs per streamed chunk (docs/performance.md).

Not a test. Feeds a 1,286-character Qwen3-style message (reasoning, an answer, one Hermes tool
call) to the ``qwen3`` + ``hermes`` parsers of one choice in 1- and 4-character pieces, as the
server does per chunk, and prints the best mean time per ``feed`` of five rounds::

    python tests/perf/parser_cost.py
"""

from __future__ import annotations

import time

from chassis.plugins.registries import get_registries
from chassis.serve.chat_parsing import ChoiceParser

MESSAGE = (
    "<think>\n"
    + "Let me think about the weather in Paris and what to call. " * 20
    + "\n</think>\n\nSure, checking.\n"
    + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    + "</tool_call>"
)


def main() -> None:
    registries = get_registries()
    tools = registries.tool_parsers.get("hermes")
    reasoning = registries.reasoning_parsers.get("qwen3")
    for size in (1, 4):
        pieces = [MESSAGE[i : i + size] for i in range(0, len(MESSAGE), size)]
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                parser = ChoiceParser(reasoning(None, "<|im_start|>assistant\n"), tools(None, []))
                for piece in pieces:
                    parser.feed(piece)
                parser.finish()
            best = min(best, (time.perf_counter() - start) / (20 * len(pieces)))
        print(f"{len(MESSAGE)} chars in {size}-char pieces: {best * 1e6:.2f} us per feed")


if __name__ == "__main__":
    main()
