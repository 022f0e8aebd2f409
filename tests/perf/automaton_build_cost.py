"""How long the automaton's NFA build takes (docs/structured_outputs.md, "Recursion").

Not a test. ``python tests/perf/automaton_build_cost.py`` times ``Automaton.from_ir`` on the
IR of ``json_object`` (any JSON object) and of llama.cpp's ``json.gbnf`` (taken from
tests/test_structured_grammar.py): in each of ``--rounds`` fresh processes, one untimed build
per constraint (imports, first-call costs), then one timed, and one timed NFA build alone
(``_Nfa.build``, the part ``from_ir`` shares with determinizing); prints the median, min
and max over the rounds.

``--against DIR`` (repeatable) compares with another checkout of chassis (``git worktree
add /tmp/old COMMIT``): the rounds alternate between the checkouts, a process of each per
round, so that the load of a shared machine falls on all alike; each checkout is imported through a directory
holding a ``chassis`` link to it, put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]


def json_gbnf() -> str:
    """llama.cpp's json.gbnf, as tests/test_structured_grammar.py holds it (read without
    importing that module, which needs this checkout's test helpers)."""
    tree = ast.parse((REPO / "tests" / "test_structured_grammar.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "JSON_GBNF":
            return ast.literal_eval(node.value)
    raise LookupError("JSON_GBNF not found in tests/test_structured_grammar.py")


def one_round() -> dict[str, float]:
    """In this process (whichever chassis it imports): seconds of one timed build each."""
    from chassis.builtin_plugins.structured_output.automaton import Automaton, _Nfa
    from chassis.builtin_plugins.structured_output.grammar import grammar_to_ir
    from chassis.builtin_plugins.structured_output.json_schema import any_json_object

    irs = {"json_object": any_json_object(), "json.gbnf": grammar_to_ir(json_gbnf())}
    seconds = {}
    for name, node in irs.items():
        Automaton.from_ir(node)  # untimed: first-call costs
        start = time.perf_counter()
        Automaton.from_ir(node)
        seconds[f"{name} from_ir"] = time.perf_counter() - start
        nfa = _Nfa()
        start = time.perf_counter()
        nfa.build(node, nfa.new())
        seconds[f"{name} NFA build"] = time.perf_counter() - start
    return seconds


def run_round(checkout: Path, links: Path) -> dict[str, float]:
    """One round in a fresh process that imports ``chassis`` from ``checkout``."""
    link_dir = links / checkout.name
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "chassis"
    if not link.exists():
        link.symlink_to(checkout)
    env = {**os.environ, "PYTHONPATH": f"{link_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, str(HERE), "--one-round", str(checkout)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--against", type=Path, action="append", help="another chassis checkout to compare"
    )
    parser.add_argument("--one-round", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_round is not None:
        import chassis

        assert Path(chassis.__file__).resolve().parent == args.one_round.resolve(), chassis
        print(json.dumps(one_round()))
        return
    checkouts = [*(path.resolve() for path in args.against or ()), REPO]
    times: dict[Path, list[dict[str, float]]] = {c: [] for c in checkouts}
    with tempfile.TemporaryDirectory() as links:
        for _ in range(args.rounds):
            for checkout in checkouts:
                times[checkout].append(run_round(checkout, Path(links)))
    for checkout in checkouts:
        for name in times[checkout][0]:
            samples = [t[name] for t in times[checkout]]
            print(
                f"{checkout}  {name:22s} median {statistics.median(samples):.3f} s  "
                f"min {min(samples):.3f}  max {max(samples):.3f}  ({len(samples)} rounds)"
            )


if __name__ == "__main__":
    main()
