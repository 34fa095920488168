"""A newcomer's first hour with the installed `neardup`, run as a subprocess: one clear line and an exit code
for every mistake, gzip read as it is, Ctrl-C and SIGTERM with the summary so far, stdin answered promptly."""

from __future__ import annotations

import argparse
import gzip
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from stream.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
SPAM = "WIN a FREE iPhone now!!! call 555-0100 to claim your prize today"
COPY = "w i n a free iphone NOW, call 555-0199 to claim your prize today"


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def neardup(*args: str, stdin: bytes = b"", prelude: str = "") -> subprocess.CompletedProcess[bytes]:
    """`neardup ARGS` as a user runs it (`python -m stream.cli`, the entry point's module); `prelude` runs
    first in the same interpreter (to make an optional package missing)."""
    code = f"{prelude}\nimport sys\nfrom stream.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, env=env(),
                          cwd=REPO, timeout=60)


def one_line(run: subprocess.CompletedProcess[bytes]) -> str:
    err = run.stderr.decode()
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def jl(id: str, text: str, ts: float = 0.0) -> bytes:
    return orjson.dumps({"id": id, "text": text, "ts": ts})


def test_version() -> None:
    run = neardup("--version")
    assert run.returncode == 0 and run.stdout.decode().startswith("neardup ")


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "missing.jsonl", "no such file"),
    (lambda d: d, "is a directory"),
])
def test_an_input_that_is_not_a_file_of_records_is_one_line(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    run = neardup("filter", str(make(tmp_path)))
    assert run.returncode == 2 and message in one_line(run) and run.stdout == b""


def test_binary_input_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "image.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 20)
    run = neardup("filter", str(path))
    assert run.returncode == 2 and "binary input" in one_line(run) and run.stdout == b""


@pytest.mark.parametrize("name", ["in.jsonl.gz", "in.jsonl"])  # gzip known by its magic bytes, whatever the name
def test_gzip_input_is_read_transparently(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(gzip.compress(jl("a", SPAM) + b"\n" + jl("b", COPY, 1) + b"\n"))
    run = neardup("filter", str(path), "--duplicates", str(tmp_path / "d.jsonl"))
    assert run.returncode == 0, run.stderr
    assert run.stdout == jl("a", SPAM) + b"\n"
    assert orjson.loads((tmp_path / "d.jsonl").read_bytes())["duplicate_of"] == "a"
    piped = neardup("filter", "-", stdin=path.read_bytes())
    assert piped.returncode == 0 and piped.stdout == jl("a", SPAM) + b"\n"


def test_a_rejected_record_shows_its_reason_and_start_not_the_whole_record(tmp_path: Path) -> None:
    huge = b'{"id": "big", "text": ' + b"x" * 2_000_000 + b"\n"  # not JSON: a text that is not a string
    run = neardup("filter", "-", stdin=huge)
    assert run.returncode == 0
    (line,) = [x for x in run.stderr.decode().splitlines() if x.startswith("rejected ")]
    assert "invalid_json" in line and "[2,000,022 characters]" in line and len(line) < 600
    assert neardup("filter", "-", "--rejected", str(tmp_path / "r.jsonl"), stdin=huge).returncode == 0
    assert len(orjson.loads((tmp_path / "r.jsonl").read_bytes())["line"]) == 2_000_022  # whole in --rejected


@pytest.mark.parametrize(("prelude", "args", "needs"), [
    ("import sys; sys.modules['aiokafka'] = None", ["serve"], "'neardup serve' needs the Kafka extra"),
    ("import sys; sys.modules['aiokafka'] = None", ["tail", "some-topic"], "'neardup tail' needs the Kafka extra"),
    ("import sys; sys.modules['redis'] = None", ["filter", "-", "--index", "redis://127.0.0.1:6379/0"],
     "'neardup filter --index redis://' needs the Kafka extra (redis is missing)"),
])
def test_a_command_without_its_extra_says_what_to_install(prelude: str, args: list[str], needs: str) -> None:
    run = neardup(*args, stdin=jl("a", SPAM) + b"\n", prelude=prelude)
    line = one_line(run)
    assert run.returncode == 2 and needs in line and "pip install 'neardup[kafka]'" in line


def test_every_option_of_every_command_has_a_help_line() -> None:
    missing = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")
            elif not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS \
                    and not (action.help or "").strip():
                missing.append(f"{name}: {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "neardup")
    assert missing == []


def _live_filter() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "stream.cli", "filter", "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=REPO)


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout}s"
    return proc.stdout.readline()


def test_a_line_piped_in_is_answered_without_waiting_for_a_batch() -> None:
    proc = _live_filter()
    assert proc.stdin is not None
    try:
        time.sleep(2.0)  # the interpreter and the filter start
        sent = time.monotonic()
        proc.stdin.write(jl("a", SPAM) + b"\n")
        proc.stdin.flush()
        assert _read_line(proc, 5.0) == jl("a", SPAM) + b"\n"
        assert time.monotonic() - sent < 1.0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_writes_whole_lines_and_the_summary_so_far(sig: int, code: int) -> None:
    proc = _live_filter()
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(jl("a", SPAM) + b"\n" + jl("b", COPY) + b"\n" + jl("c", "lunch at noon tomorrow?") + b"\n")
    proc.stdin.flush()
    first = _read_line(proc, 10.0)
    time.sleep(0.3)
    proc.send_signal(sig)  # the pipe stays open: only the signal ends the run
    out = proc.stdout.read()  # through the reader that buffered `first`: what it read ahead is here
    err = proc.stderr.read()
    assert proc.wait(timeout=20) == code, err
    lines = (first + out).splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines) and [orjson.loads(x)["id"] for x in lines] == ["a", "c"]
    text = err.decode()
    assert "Traceback" not in text
    assert "interrupted (" in text and "in 3 = unique 2 + duplicate 1 + rejected 0" in text
