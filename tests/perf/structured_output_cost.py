"""What structured outputs cost per step on this host (docs/structured_outputs.md).

Not a test. On the embedded SmolLM2 (49,152-token vocabulary)::

    python tests/perf/structured_output_cost.py

prints (1) the time to compute a token mask the first time the grammar reaches a state and
when it returns to one, along one real constrained output; (2) the per-request, per-step
host work of a warm state: the matcher's mask, packing it for the plan, and masking a batch
of logits in the runner; (3) end to end, milliseconds per generated token of 8 chat requests
with and without ``json_object``, greedy, in one engine, alternated; (4) what a new
constraint costs before its first token: the front-end's ``check``, the engine core's
``compile`` and its first mask (the engine core's thread waits for the last two), with the
size of its NFA; measured first, before any check is cached in this process; (5) how the
NFA of a free-form JSON object grows with its nesting depth, and how long it takes to build.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from chassis import LLM, SamplingParams
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.structured_output import StructuredOutputsParams
from chassis.core.structured_output_manager import StructuredOutputManager, pack_mask, unpack_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "colour": {"enum": ["black", "white", "ginger", "grey"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "indoor": {"type": "boolean"},
    },
    "required": ["name", "colour", "age", "indoor"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a cat in JSON."}]


def new_constraint_costs(backend_cls: type, vocabulary: object) -> None:
    """(4): check, compile and first mask of constraints no backend has seen yet."""
    from chassis.builtin_plugins.structured_output.automaton import estimated_nfa_states
    from chassis.builtin_plugins.structured_output.backend import constraint_to_ir

    backend = backend_cls(vocabulary)  # a fresh one: nothing compiled or cached
    cases = {
        "json_object": StructuredOutputsParams(json_object=True),
        "a 4-property schema": StructuredOutputsParams(json=SCHEMA),
        "a choice of 20,000 strings": StructuredOutputsParams(
            choice=[f"item{i}" for i in range(20000)]
        ),
        "a choice of two 12,000-character strings": StructuredOutputsParams(
            choice=["x" * 12000, "y" * 12000]
        ),
    }
    for label, params in cases.items():
        start = time.perf_counter()
        backend_cls.check(params)
        checked = time.perf_counter()
        matcher = backend.compile(params).matcher()
        compiled = time.perf_counter()
        matcher.allowed_tokens()
        masked = time.perf_counter()
        states = estimated_nfa_states(constraint_to_ir(params))
        print(
            f"new constraint, {label}: check {checked - start:.2f} s, compile "
            f"{compiled - checked:.2f} s, first mask {masked - compiled:.2f} s "
            f"({states} NFA states)"
        )


def free_form_depths() -> None:
    """(5): the NFA of a free-form JSON object nested 1 to 10 levels deep (the limit is
    ``MAX_NFA_STATES``; ``json_object`` uses ``JSON_OBJECT_DEPTH``, a schema's free-form
    values ``ANY_JSON_DEPTH``), and how long ``Automaton.from_ir`` takes at depths 5 to 9
    (the best of 3, after one untimed build of depth 5 for first-call costs)."""
    from chassis.builtin_plugins.structured_output.automaton import (
        MAX_NFA_STATES,
        Automaton,
        estimated_nfa_states,
    )
    from chassis.builtin_plugins.structured_output.json_schema import any_object

    sizes = [estimated_nfa_states(any_object(depth)) for depth in range(1, 11)]
    growth = ", ".join(f"{b / a:.1f}x" for a, b in itertools.pairwise(sizes))
    print(
        f"free-form JSON object, NFA states at depths 1-10: {sizes} (each level {growth}; "
        f"limit {MAX_NFA_STATES})"
    )
    Automaton.from_ir(any_object(5))
    for depth in range(5, 10):
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            Automaton.from_ir(any_object(depth))
            seconds.append(time.perf_counter() - start)
        print(f"free-form JSON object, depth {depth}: from_ir {min(seconds):.3f} s")


def per_call(fn, repeat: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    model = str(embedded_model_dir())
    llm = LLM(model, max_model_len=1024, num_kv_blocks=512)
    manager = StructuredOutputManager(llm.config)
    # 4. (first: nothing is checked or compiled yet) a new constraint's cost
    new_constraint_costs(type(manager.backend), manager.backend.vocabulary)
    free_form_depths()

    schema_params = SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    [reference] = llm.chat(CHAT, schema_params)
    tokens = reference.outputs[0].token_ids
    print(f"constrained answer ({len(tokens)} tokens): {reference.outputs[0].text!r}")

    # 1. masks along that output: the manager's backend has compiled nothing yet, so every
    # state is new the first time
    grammar = manager.backend.compile(schema_params.structured_outputs)
    for label in ("first visit", "second visit"):
        matcher = grammar.matcher()
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.allowed_tokens()
            times.append(time.perf_counter() - start)
            matcher.accept_token(token)
        ms = np.array(times) * 1e3
        print(
            f"mask, {label}: median {np.median(ms):.3f} ms, max {ms.max():.2f} ms, "
            f"total {ms.sum():.1f} ms over {len(ms)} tokens"
        )

    # 2. the warm per-step host work of one constrained request
    matcher = grammar.matcher()
    matcher.accept_token(tokens[0])
    allowed = matcher.allowed_tokens()
    vocab = allowed.shape[0]
    packed = pack_mask(allowed)
    print(f"allowed_tokens() warm: {per_call(matcher.allowed_tokens) * 1e6:.1f} us")
    print(f"pack_mask: {per_call(lambda: pack_mask(allowed)) * 1e6:.1f} us")
    for rows in (1, 8, 32):
        logits = torch.randn(rows, vocab)
        index = torch.arange(rows)

        def mask_rows(
            rows: int = rows, logits: torch.Tensor = logits, index: torch.Tensor = index
        ) -> None:
            unpacked = torch.from_numpy(unpack_masks([packed] * rows, vocab))
            sub = logits[index, :vocab]
            sub.masked_fill_(~unpacked, float("-inf"))
            logits[index, :vocab] = sub

        print(f"runner masking of {rows} rows: {per_call(mask_rows, 50) * 1e3:.3f} ms")

    # 3. end to end: 8 requests, constrained or not, alternated twice
    free = SamplingParams(temperature=0, max_tokens=120)
    obj = SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    conversations = [CHAT] * 8
    llm.chat(conversations[:2], obj)  # warm the grammar's states
    for round_ in range(2):
        for label, params in (("free", free), ("json_object", obj)):
            start = time.perf_counter()
            outputs = llm.chat(conversations, params)
            elapsed = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            print(
                f"round {round_ + 1} {label:11s}: {generated} tokens in {elapsed:.2f} s, "
                f"{elapsed / generated * 1e3:.2f} ms per token"
            )


if __name__ == "__main__":
    main()
