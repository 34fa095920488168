"""Benchmark: two commands run in turn (A B A B ...), their CPU, wall time and peak memory side by side.

    python bench/alternate.py -n 7 --vs "python bench/datasketch_filter.py --stream STREAM" -- neardup filter -q STREAM

Each run is a process of its own, its output read through a pipe and dropped. CPU is the finished process's
user + system time as the system accounts it (what `/usr/bin/time -f '%U %S'` prints), wall from its start to
its exit, peak memory its maximum resident set. Printed: the median of each, and the median (min-max) of the
pairwise ratios A ÷ B: pairing keeps a ratio meaningful while the machine's speed drifts during the call, so
compare ratios of one call. A shell is not used: give `sh -c '...'` for a pipe or a set-up step.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class Run:
    cpu: float  # seconds, user + system
    wall: float  # seconds
    peak_mib: float


def run_once(argv: list[str]) -> Run:
    """One run of `argv`, its output dropped; exits with the command's code if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code  # (waited for here: Popen must not wait again)
    if code != 0:
        sys.exit(f"alternate: {shlex.join(argv)} exited with {code}")
    return Run(usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024.0)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every benchmark says what it needs
        print(f"alternate.py needs two commands: --vs 'COMMAND B' -- COMMAND A ({message})", file=sys.stderr)
        sys.exit(2)


def ratios(a: list[float], b: list[float]) -> str:
    r = [x / y for x, y in zip(a, b, strict=True) if y > 0]
    return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})" if r else "-"


def main() -> None:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--pairs", type=int, default=7, help="runs of each command")
    p.add_argument("--vs", help="command B (the baseline), one string split as a shell splits words")
    p.add_argument("command", nargs=argparse.REMAINDER, help="command A, after --")
    args = p.parse_args()
    a_argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    b_argv = shlex.split(args.vs or "")
    if not a_argv or not b_argv:
        print("alternate.py needs two commands: --vs 'COMMAND B' -- COMMAND A", file=sys.stderr)
        sys.exit(2)
    a: list[Run] = []
    b: list[Run] = []
    try:
        for _ in range(args.pairs):
            a.append(run_once(a_argv))
            b.append(run_once(b_argv))
    except FileNotFoundError as exc:
        sys.exit(f"alternate: {exc.filename}: command not found")
    except KeyboardInterrupt:
        sys.exit(130)
    print(f"{args.pairs} pairs, load average {os.getloadavg()[0]:.1f}")
    print("| command | CPU s (median) | wall s (median) | peak MiB (median) |")
    print("|---|---|---|---|")
    for name, runs, argv in (("A", a, a_argv), ("B", b, b_argv)):
        print(f"| {name}: `{shlex.join(argv)}` | {statistics.median(r.cpu for r in runs):.3f} | "
              f"{statistics.median(r.wall for r in runs):.3f} | {statistics.median(r.peak_mib for r in runs):.1f} |")
    for x, y, name in ((a, b, "A ÷ B"), (b, a, "B ÷ A")):
        print(f"{name}, median of the pairs (min-max): CPU {ratios([r.cpu for r in x], [r.cpu for r in y])}, "
              f"wall {ratios([r.wall for r in x], [r.wall for r in y])}")


if __name__ == "__main__":
    main()
