"""What the structured-output work budget allows (docs/structured_outputs.md, "Work budget").

Not a test. On the embedded SmolLM2 (49,152-token vocabulary)::

    python tests/perf/structured_output_budget.py

prints (1) the work (NFA states touched, ``WorkMeter.used``) that ordinary constraints need:
their first mask, then a walk along a sample output with a mask at every token, each on a
fresh backend with no budget; (2) for :data:`TANGLED` (nested nullable bounded repetitions,
whose first mask alone needs tens of millions of units), the engine core's time to spend
budgets of 1e5, 1e6 and the default, and the time per unit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from chassis.builtin_plugins.structured_output.backend import (
    DEFAULT_WORK_BUDGET,
    ChassisStructuredOutputBackend,
)
from chassis.core.gguf_checkpoint import embedded_model_dir
from chassis.core.structured_output import ConstraintBudgetExceeded
from chassis.core.structured_output import StructuredOutputsParams as Params
from chassis.core.token_vocabulary import vocabulary_from_tokenizer
from chassis.core.tokenizer import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
#: four rules of nested, nullable bounded repetitions (the test's grammar, defined there)
from test_structured_budget import TANGLED

SAMPLE_JSON = (
    '{"name": "Tom", "age": 3, "tags": ["a", {"x": [1, 2.5e3, null, true]}], "pet": "cat"}'
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
    },
    "required": ["name", "age"],
}
CASES = [
    ("json_object", Params(json_object=True), SAMPLE_JSON),
    ("a 3-property schema", Params(json=SCHEMA), '{"name": "Tom", "age": 3, "tags": ["a"]}'),
    ("a choice of 20,000 strings", Params(choice=[f"item{i}" for i in range(20000)]), "item12345"),
    ("a regex", Params(regex=r"[ab]{3,6}-(x|yz)\d?"), "abab-yz1"),
]


def main() -> None:
    tokenizer = load_tokenizer(embedded_model_dir())
    vocabulary = vocabulary_from_tokenizer(tokenizer, 49152, [tokenizer.eos_token_id])
    for label, params, text in CASES:
        matcher = ChassisStructuredOutputBackend(vocabulary, work_budget=None).compile(params)
        matcher = matcher.matcher()
        matcher.allowed_tokens()
        first = matcher.meter.used
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token_id), (label, text)
            matcher.allowed_tokens()
        print(f"{label}: first mask {first} units, {matcher.meter.used} units along {text!r}")
    for budget in (100_000, 1_000_000, DEFAULT_WORK_BUDGET):
        backend = ChassisStructuredOutputBackend(vocabulary, work_budget=budget)
        matcher = backend.compile(Params(grammar=TANGLED)).matcher()
        start = time.perf_counter()
        try:
            matcher.allowed_tokens()
            outcome = "fits"
        except ConstraintBudgetExceeded:
            outcome = "exceeded"
        seconds = time.perf_counter() - start
        print(
            f"tangled grammar, budget {budget}: {outcome} after {matcher.meter.used} units in "
            f"{seconds:.2f} s ({seconds / matcher.meter.used * 1e6:.2f} us per unit)"
        )


if __name__ == "__main__":
    main()
