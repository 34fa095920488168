"""Benchmark: the instructions each Redis master executes per message (valgrind's callgrind), the spread layout
on 1, 3 and 6 masters against the slot layout on one: a count that does not move with the machine's load, for
machines where the masters share the cores (`bench/spread_scale.py` measures their CPU time).

    python bench/spread_instructions.py [--stream STREAM] [--masters 1,3,6] [--warm 4000] [--messages 4000]
                                        [--port 7400] [--runs 1]

Per layout and number of masters: that many redis-server processes under callgrind, a Redis Cluster of their
own (slots split evenly, on ports from --port, data in a temporary directory); one index decides the first
--warm messages of the development stream (unmeasured), then the next --messages in batches of 512, as one
worker does. Around those: `callgrind_control -z` (counts zeroed) and `-d` (dumped) on every master. Printed:
each master's instructions per message measured (less what it runs idle meanwhile: its cron and the
cluster bus, counted for a few seconds before), their mean, the mean ÷ the slot layout's master (the
scale: a third at 3 masters is a perfect split of the slot layout's work), the total. callgrind makes Redis
about 50 times slower, not different: the counts are the instructions Redis runs, without the time a
shared core adds to each (cache misses, switches), which is why they can differ from CPU seconds.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

try:
    import redis
except ModuleNotFoundError as exc:  # one line naming what to install, not a traceback
    print(f"spread_instructions.py needs the Python package {exc.name}: pip install 'neardup[kafka]'",
          file=sys.stderr)
    raise SystemExit(2) from None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import needs  # noqa: E402
from bench.spread_scale import BATCH, decide, engine_at, first_messages  # noqa: E402
from filters.engine import Message  # noqa: E402

DEFAULT_STREAM = ROOT.parent / "shared" / "eval" / "stream.jsonl"
SLOTS = 16384
IDLE = 5.0  # seconds of idle counting per cluster


class Masters:
    """`n` redis-server processes under callgrind, one cluster: started, formed, counted, stopped."""

    def __init__(self, n: int, port: int, workdir: Path) -> None:
        self.ports = list(range(port, port + n))
        self.dir = workdir
        self.procs = [subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/cg-{p}.out", "redis-server",
             "--port", str(p), "--save", "", "--appendonly", "no", "--dir", str(workdir),
             "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{p}.conf", "--cluster-node-timeout", "60000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in self.ports]
        self.clients = [redis.Redis(port=p, socket_timeout=120) for p in self.ports]
        for c in self.clients:
            self._wait(c.ping, "answer")
        for i, c in enumerate(self.clients):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // n, (i + 1) * SLOTS // n - 1)
        for c in self.clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        for c in self.clients:
            self._wait(lambda c=c: b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
                       and int(c.execute_command("CLUSTER", "INFO").split(b"cluster_known_nodes:")[1].split()[0]) == n,
                       "form a cluster")

    @staticmethod
    def _wait(ok: object, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok():  # type: ignore[operator]
                    return
            except redis.RedisError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"spread_instructions.py: redis-server under callgrind did not {what} in {timeout:.0f}s")

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def zero(self) -> None:
        for p in self.procs:
            subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)

    def counts(self) -> list[int]:
        """Instructions each master executed since `zero`."""
        out = []
        for port, p in zip(self.ports, self.procs, strict=True):
            for f in glob.glob(f"{self.dir}/cg-{port}.out*"):
                Path(f).unlink()
            subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            dumps = sorted(glob.glob(f"{self.dir}/cg-{port}.out*"))
            total = 0
            for line in Path(dumps[-1]).read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
            out.append(total)
        return out

    def stop(self) -> None:
        for c in self.clients:
            try:
                c.shutdown(nosave=True)
            except redis.RedisError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def measure(n: int, layout: str, messages: list[Message], warm: int, port: int) -> list[float]:
    """Instructions per message measured, each master."""
    with tempfile.TemporaryDirectory(prefix="neardup-ir-") as tmp:
        servers = Masters(n, port, Path(tmp))
        try:
            engine = engine_at(f"{servers.url}?layout={layout}&prefix=ir-{uuid.uuid4().hex[:6]}&socket_timeout=120",
                               "ir")
            decide(engine, messages, 0, warm)
            # What a master runs idle (its cron, the cluster bus), per second: taken out of the measured window's
            # counts, which would otherwise grow with callgrind's slowness and the number of masters.
            servers.zero()
            t0 = time.monotonic()
            time.sleep(IDLE)
            idle = [c / (time.monotonic() - t0) for c in servers.counts()]
            servers.zero()
            t0 = time.monotonic()
            decide(engine, messages, warm, len(messages))
            seconds = time.monotonic() - t0
            counts = [c - rate * seconds for c, rate in zip(servers.counts(), idle, strict=True)]
            engine.index.close()
        finally:
            servers.stop()
    return [c / (len(messages) - warm) for c in counts]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stream", type=Path, default=DEFAULT_STREAM)
    p.add_argument("--masters", default="1,3,6", help="comma-separated numbers of masters of the spread layout")
    p.add_argument("--warm", type=int, default=4000)
    p.add_argument("--messages", type=int, default=4000)
    p.add_argument("--port", type=int, default=7400, help="the first of the masters' ports (each +1)")
    p.add_argument("--runs", type=int, default=1)
    args = p.parse_args()
    needs.files(__file__, args.stream)
    needs.tool(__file__, "redis-server", install="apt-get install redis-server")
    needs.tool(__file__, "valgrind", install="apt-get install valgrind")
    counts = [int(n) for n in args.masters.split(",") if n]
    messages = [Message(*m) for m in first_messages(args.stream, args.warm + args.messages)]
    slot: list[float] = []
    spread: dict[int, list[list[float]]] = {n: [] for n in counts}
    for run in range(args.runs):
        slot.extend(measure(1, "slot", messages, args.warm, args.port))
        for n in counts:
            spread[n].append(measure(n, "spread", messages, args.warm, args.port))
        print(f"  run {run + 1} done", file=sys.stderr, flush=True)
    base = statistics.median(slot)
    print(f"{args.messages} messages measured after {args.warm} (the development stream), one index, batches of "
          f"{BATCH}; instructions a message (thousands), medians of {args.runs} run(s)\n")
    print("| layout | masters | each master | mean per master | ÷ the slot layout's master | total |")
    print("|---|---|---|---|---|---|")
    print(f"| slot | 1 | {base / 1e3:.1f} | {base / 1e3:.1f} | – | {base / 1e3:.1f} |")
    for n in counts:
        each = [statistics.median(run[i] for run in spread[n]) for i in range(n)]
        mean = statistics.fmean(each)
        print(f"| spread | {n} | {', '.join(f'{x / 1e3:.1f}' for x in each)} | {mean / 1e3:.1f} | "
              f"{mean / base:.2f} (busiest {max(each) / base:.2f}) | {sum(each) / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
