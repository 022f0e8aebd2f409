"""Where the test suite's time goes, per test module, from a pytest JUnit XML report.

    python -m pytest -q -p no:cacheprovider --junitxml=/tmp/suite.xml
    python tests/perf/suite_time_by_module.py /tmp/suite.xml [--top 40]

Prints the summed time (set-up, call and tear-down, as pytest reports each test case) and
the number of test cases of each module, most time first, and the total.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def times_by_module(path: str) -> tuple[dict[str, float], dict[str, int]]:
    """``(seconds, test cases)`` per module (the last part of each case's ``classname``)."""
    seconds: dict[str, float] = collections.Counter()
    cases: dict[str, int] = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        module = (case.get("classname") or "?").split(".")[-1]
        seconds[module] += float(case.get("time") or 0.0)
        cases[module] += 1
    return seconds, cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="pytest's --junitxml file")
    parser.add_argument("--top", type=int, default=40, help="modules to list (default: 40)")
    args = parser.parse_args()
    seconds, cases = times_by_module(args.report)
    for module, spent in sorted(seconds.items(), key=lambda item: -item[1])[: args.top]:
        print(f"{spent:8.1f} s {cases[module]:5d} cases  {module}")
    print(f"{sum(seconds.values()):8.1f} s {sum(cases.values()):5d} cases  total")


if __name__ == "__main__":
    main()
