"""How busy the machine's cores are while a command runs (is there room for parallel workers?).

    python tests/perf/cpu_busy.py [--interval 30] -- bash .ci/run

Runs the command, reads the whole machine's CPU time from ``/proc/stat`` every ``--interval``
seconds, and prints each sample (the share of all cores' time that was not idle or waiting
for I/O, in percent) and, when the command ends, their mean and median; it exits with the
command's status. Anything else running on the machine counts too: measure on a quiet one.
Linux only.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot: idle and iowait are not busy."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    process = subprocess.Popen(command)
    samples: list[float] = []
    busy, total = cpu_times()
    while True:
        try:
            process.wait(timeout=args.interval)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        now_busy, now_total = cpu_times()
        if now_total > total:
            share = 100.0 * (now_busy - busy) / (now_total - total)
            samples.append(share)
            print(f"{time.strftime('%H:%M:%S')} busy {share:.0f}%", file=sys.stderr, flush=True)
        busy, total = now_busy, now_total
        if finished:
            break
    if samples:
        print(
            f"cpu busy over {len(samples)} samples: mean {statistics.fmean(samples):.1f}%, "
            f"median {statistics.median(samples):.1f}%",
            file=sys.stderr,
        )
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
