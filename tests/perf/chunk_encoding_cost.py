"""Time to build one streamed chunk's SSE event (not a test): the pydantic models (the schema)
against serve/stream_chunks.py's msgspec encoding of the same chunk.

    python tests/perf/chunk_encoding_cost.py
"""

from __future__ import annotations

import timeit

from chassis.serve.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from chassis.serve.stream_chunks import ChunkEncoder, chat_choice, completion_choice


def main() -> None:
    completion = ChunkEncoder("text_completion", "cmpl-1", 1, "m")
    chat = ChunkEncoder("chat.completion.chunk", "chatcmpl-1", 1, "m")
    cases = {
        "completion chunk, pydantic": lambda: CompletionResponse(
            id="cmpl-1", created=1, model="m", choices=[CompletionChoice(index=0, text=" hi")]
        ).model_dump_json(),
        "completion chunk, msgspec": lambda: completion.event([completion_choice(0, " hi")], None),
        "chat chunk, pydantic": lambda: ChatCompletionChunk(
            id="chatcmpl-1",
            created=1,
            model="m",
            choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content=" hi"))],
        ).model_dump_json(),
        "chat chunk, msgspec": lambda: chat.event([chat_choice(0, content=" hi")], None),
    }
    number = 20000
    for name, build in cases.items():
        seconds = min(timeit.repeat(build, number=number, repeat=3))
        print(f"{name:28s} {seconds / number * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
