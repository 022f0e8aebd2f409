"""The ShareGPT workload of ``chassis bench serve --dataset-name sharegpt`` (vLLM's serving
benchmark's default dataset).

The file is ShareGPT's JSON: a list of conversations, each ``{"conversations": [{"from":
"human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``. Each conversation with two
turns or more gives one candidate: its first turn is the prompt, and the length of its second
(in tokens) is the request's output length, unless a fixed one is asked for. The candidates
are shuffled with the seed, then taken in order while they pass vLLM's filter: a prompt and
an output of 4 tokens or more (the output not checked when fixed), a prompt of at most 1024
tokens and at most 2048 tokens together, counted as vLLM counts them (the tokenizer's
special tokens included). ``chassis bench serve`` counts with the server's ``POST /tokenize``
(chassis and vLLM have it), so it needs no tokenizer of its own; ``chassis bench
throughput`` with the engine's tokenizer, and runs the prompts' token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from chassis.serve.bench_workload import BenchRequest

#: vLLM's ShareGPT filter
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(frozen=True)
class TextRequest:
    """One request of a text workload: its prompt, the prompt's length in tokens, and how
    many tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


def add_dataset_args(parser: argparse.ArgumentParser, prompts: str) -> None:
    """The workload flags of ``chassis bench serve`` and ``throughput`` (vLLM's names):
    ``--dataset-name random|sharegpt``, ``--dataset-path``, ``--sharegpt-output-len``;
    ``prompts`` says how the command sends ShareGPT's prompts."""
    parser.add_argument(
        "--dataset-name",
        choices=("random", "sharegpt"),
        default="random",
        help="random = random token ids of --input-len/--output-len (default); sharegpt = "
        f"the first turns of ShareGPT's conversations (--dataset-path), {prompts}, output "
        "lengths of their replies",
    )
    parser.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file")
    parser.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="ShareGPT: every request asks for this many tokens instead of its reply's length",
    )


def load_sharegpt(path: str | None) -> list[tuple[str, str]]:
    """The (first turn, second turn) texts of each conversation of two turns or more;
    ``ValueError`` naming the file when it cannot be read or is not ShareGPT's shape, or
    saying that ``--dataset-path`` is missing (``None``)."""
    if not path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (ShareGPT's JSON file)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--dataset-path {path}: not JSON: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: ShareGPT's file is a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(first, str) and isinstance(second, str):
            pairs.append((first, second))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns")
    return pairs


async def sharegpt_workload(
    pairs: list[tuple[str, str]],
    num_requests: int,
    count_tokens: Callable[[str], Awaitable[int]],
    seed: int = 0,
    fixed_output_len: int | None = None,
) -> list[TextRequest]:
    """Up to ``num_requests`` requests from ``pairs`` (see the module docstring); fewer when
    too few pass the filter, and ``ValueError`` when none does."""
    order = list(pairs)
    random.Random(seed).shuffle(order)
    workload: list[TextRequest] = []
    for prompt, completion in order:
        if len(workload) == num_requests:
            break
        prompt_len = await count_tokens(prompt)
        output_len = fixed_output_len or await count_tokens(completion)
        too_short = prompt_len < MIN_LEN or (fixed_output_len is None and output_len < MIN_LEN)
        too_long = prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN
        if not (too_short or too_long):
            workload.append(TextRequest(prompt, prompt_len, output_len))
    if not workload:
        raise ValueError(
            f"no ShareGPT conversation fits the filter (prompt and reply of {MIN_LEN} tokens or "
            f"more, a prompt of at most {MAX_PROMPT_LEN}, {MAX_TOTAL_LEN} together)"
        )
    return workload


def server_token_counter(
    client: Any, headers: dict[str, str], model: str
) -> Callable[[str], Awaitable[int]]:
    """Counts a text's tokens (special tokens included, as vLLM's benchmark counts) with the
    server's ``POST /tokenize``; the counter raises ``ValueError`` when the server has no
    such route."""

    async def count(text: str) -> int:
        response = await client.post(
            "/tokenize",
            json={"model": model, "prompt": text, "add_special_tokens": True},
            headers=headers,
        )
        if response.status_code != 200:
            raise ValueError(
                f"POST /tokenize answered HTTP {response.status_code} ({response.text[:200]}): "
                "the ShareGPT workload counts tokens with the server's /tokenize route"
            )
        return int(response.json()["count"])

    return count


def tokenized_sharegpt_workload(
    path: str | None,
    num_requests: int,
    tokenizer: Any,
    seed: int = 0,
    fixed_output_len: int | None = None,
) -> list[BenchRequest]:
    """The ShareGPT workload of ``path`` as token-id requests of ``tokenizer`` (an HF
    tokenizer; special tokens included, as the counts are)."""

    async def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    requests = asyncio.run(
        sharegpt_workload(load_sharegpt(path), num_requests, count, seed, fixed_output_len)
    )
    return [BenchRequest(list(tokenizer(r.prompt).input_ids), r.output_len) for r in requests]
