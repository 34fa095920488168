"""The `neardup` command line: `filter`, `explain`, `eval`, and the Kafka commands from stream.commands."""

from __future__ import annotations

import argparse
import gzip
import logging
import os
import select
import signal
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from importlib import metadata
from typing import IO, BinaryIO

import orjson

from filters.config import METHODS, VERIFY_MODES, FilterConfig
from filters.engine import NearDupFilter, Verdict
from filters.errors import NeardupError
from filters.normalize import NormalizeOptions
from stream.codec import FORMATS, RecordFormat
from stream.collector import tune_collector
from stream.config import parse_duration
from stream.logs import LOG_FORMATS, setup_logging, warn_if_interpreted
from stream.runner import DUPLICATE, UNIQUE, RawRecord, Summary, Terminated, route_batch, run_filter


class FileSink:
    def __init__(self, stream: IO[bytes] | None) -> None:
        self._stream = stream

    def write(self, record: bytes) -> None:
        if self._stream is not None:
            self._stream.write(record + b"\n")

    def flush(self) -> None:
        if self._stream is not None:
            self._stream.flush()


def _add_filter_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("filter parameters")
    g.add_argument("--window", default="24h", help="sliding window of event time: 90s, 30m, 12h, 7d (default 24h)")
    g.add_argument("--index", default="memory://", help="candidate index: memory:// (default) or redis://host:port/db")
    g.add_argument("--methods", default=",".join(FilterConfig().methods),
                   help=f"candidate generators, comma-separated, of {', '.join(METHODS)}")
    g.add_argument("--verify", choices=VERIFY_MODES, default="sketch",
                   help="sketch (default: every candidate by the shingle sketch) or native (each method its own measure)")
    g.add_argument("--threshold", type=float, default=FilterConfig().threshold, help="Jaccard threshold")
    g.add_argument("--containment", type=float, default=FilterConfig().containment,
                   help="containment threshold (truncated copies, added ad lines)")
    g.add_argument("--mgram-keys", type=int, default=FilterConfig().mgram_keys,
                   help="m-gram keys sampled a message (all of them for short texts)")
    g.add_argument("--normalize", default="",
                   help="turn normalization steps off/on, e.g. '-pinyin,-mask_numbers' (or no-pinyin, !pinyin; "
                        "+step turns one on) "
                        f"(steps: {', '.join(NormalizeOptions.step_names())})")


def _config(args: argparse.Namespace) -> FilterConfig:
    steps: dict[str, bool] = {}
    for item in filter(None, (s.strip() for s in args.normalize.split(","))):
        off = item.startswith(("-", "!", "no-"))
        name = item.removeprefix("no-").lstrip("+-!")
        if name not in NormalizeOptions.step_names():
            raise NeardupError(f"unknown normalization step {name!r}")
        steps[name] = not off
    return FilterConfig(
        normalize=NormalizeOptions().with_steps(**steps),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        verify=args.verify,
        threshold=args.threshold,
        containment=args.containment,
        mgram_keys=args.mgram_keys,
        window=parse_duration(args.window),
    )


def _record_format(args: argparse.Namespace) -> RecordFormat:
    return RecordFormat(args.format, args.text_field, args.id_field, args.ts_field)


_GZIP_MAGIC = b"\x1f\x8b"
# Bytes looked at for NUL bytes: text (JSON lines or one message a line) has none, binary files do.
_SNIFF = 8192


class _Read:
    """Bytes read so far of the input files (for the progress line's percent)."""

    def __init__(self) -> None:
        self.bytes = 0


def _check_inputs(paths: Sequence[str]) -> int | None:
    """One clear error for an input that cannot be read, before anything is routed; the total size of
    the files when all are files (None with stdin)."""
    total: int | None = 0
    for path in paths or ["-"]:
        if path == "-":
            total = None
            continue
        if not os.path.exists(path):
            raise NeardupError(f"{path}: no such file")
        if os.path.isdir(path):
            raise NeardupError(f"{path}: is a directory, not a file of records")
        if not os.access(path, os.R_OK):
            raise NeardupError(f"{path}: permission denied")
        if total is not None:
            total += os.path.getsize(path)
    return total


def _opened(raw: BinaryIO, name: str) -> BinaryIO:
    """`raw`, or what it holds if it is gzip (by its magic bytes, whatever its name); refused if binary."""
    head = raw.peek(len(_GZIP_MAGIC))[: len(_GZIP_MAGIC)] if hasattr(raw, "peek") else b""
    stream: BinaryIO = raw
    if head == _GZIP_MAGIC:
        stream = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
    sniff = stream.peek(_SNIFF)[:_SNIFF] if hasattr(stream, "peek") else b""
    if b"\x00" in sniff:
        raise NeardupError(f"{name}: binary input (NUL bytes): neardup reads JSON lines or text, plain or gzip")
    return stream


def _stdin_lines(fd: int, stopped: threading.Event) -> Iterator[bytes]:
    """Lines of the standard input read from its file descriptor as they come (gzip too, by its magic
    bytes): never blocked for long in a read, so that a run stopped by a signal can end while a reader
    thread waits for input."""
    pending = b""
    first = True
    inflate = None
    while not stopped.is_set():
        if not select.select([fd], [], [], 0.1)[0]:
            continue
        chunk = os.read(fd, 1 << 16)
        if first and chunk:
            first = False
            if chunk.startswith(_GZIP_MAGIC):
                inflate = zlib.decompressobj(wbits=31)
            elif b"\x00" in chunk[:_SNIFF]:
                raise NeardupError("stdin: binary input (NUL bytes): neardup reads JSON lines or text, plain or gzip")
        data = chunk if inflate is None else inflate.decompress(chunk)
        if not chunk:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending and not stopped.is_set():
        yield pending


def _lines(paths: Sequence[str], stack: ExitStack, read: _Read, stopped: threading.Event) -> Iterator[bytes]:
    for path in paths or ["-"]:
        if path == "-":
            try:
                fd = sys.stdin.fileno()
            except (AttributeError, OSError, ValueError):  # not a real descriptor (an embedding, a test)
                stream = _opened(sys.stdin.buffer, "stdin")
            else:
                for line in _stdin_lines(fd, stopped):
                    read.bytes += len(line)
                    yield line
                continue
        else:
            stream = _opened(stack.enter_context(open(path, "rb")), path)
        try:
            for line in stream:
                read.bytes += len(line)
                yield line
        except (OSError, EOFError) as exc:  # a gzip stream cut short, or corrupt
            raise NeardupError(f"{'stdin' if path == '-' else path}: {exc}") from exc


def _progress(enabled: bool, total: int | None, read: _Read) -> tuple[object, object]:
    """On a terminal: messages, duplicates, rejected, the current rate and, for files, percent and ETA."""
    last = [0.0, 0.0]  # time and messages at the last line

    def show(s: Summary) -> None:
        now = time.monotonic()
        if enabled and now - last[0] > 0.2:
            rate = (s.seen - last[1]) / (now - last[0]) if last[0] else (s.seen / s.seconds if s.seconds else 0.0)
            last[0], last[1] = now, s.seen
            line = f"\r{s.seen:,} messages  {s.duplicate:,} duplicates  {s.rejected:,} rejected  {rate:,.0f}/s"
            if total and read.bytes:
                done_share = min(1.0, read.bytes / total)
                eta = s.seconds * (1 - done_share) / done_share if done_share else 0.0
                line += f"  {done_share:.0%}  ETA {eta:,.0f}s"
            sys.stderr.write(line + " ")
            sys.stderr.flush()

    def done() -> None:
        if enabled:
            sys.stderr.write("\r\033[K")

    return show, done


class BriefRejects:
    """Rejected records on stderr when no --rejected file is given: the reason and the first 200
    characters with the record's length, one line each (the whole record goes to --rejected)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, record: bytes) -> None:
        r = orjson.loads(record)
        line = r["line"]
        shown = line[:200].replace("\n", " ") + ("…" if len(line) > 200 else "")
        self._stream.write(f"rejected {r['position']} ({r['reason']}: {r['error'][:200]}): {shown} "
                           f"[{len(line):,} characters]\n")

    def flush(self) -> None:
        self._stream.flush()


def _log_summary(summary: Summary) -> None:
    checked = summary.unique + summary.duplicate
    logging.getLogger("neardup.filter").info(
        summary.text().replace("\n", "; "),
        extra={"in": summary.seen, "unique": summary.unique, "duplicate": summary.duplicate,
               "rejected": summary.rejected, "duplicate_ratio": round(summary.duplicate / checked, 6) if checked else 0.0,
               "seconds": round(summary.seconds, 3), "reasons": dict(summary.reasons), "methods": dict(summary.methods)})


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


# A live stream (stdin) routes what has arrived after this long without a new line, even if fewer than
# a batch: a line piped in is answered promptly.
STDIN_FLUSH_AFTER = 0.05


def cmd_filter(args: argparse.Namespace) -> int:
    setup_logging("info", args.log_format)
    warn_if_interpreted()
    total = _check_inputs(args.inputs)
    nd = NearDupFilter(_config(args), index=args.index)
    tune_collector()
    previous = signal.signal(signal.SIGTERM, _terminate)
    live = "-" in (args.inputs or ["-"])
    stopped = threading.Event()  # tells a reader thread on stdin that the run is over
    try:
        with ExitStack() as stack:
            def out(path: str | None, default: IO[bytes] | None) -> FileSink:
                if path is None:
                    return FileSink(default)
                if path == "-":
                    return FileSink(sys.stdout.buffer)
                return FileSink(stack.enter_context(open(path, "wb")))

            read = _Read()
            show, done = _progress(sys.stderr.isatty() and not args.quiet and args.log_format == "plain", total, read)
            summary = run_filter(
                nd,
                _lines(args.inputs, stack, read, stopped),
                unique=out(args.unique, sys.stdout.buffer),
                duplicates=out(args.duplicates, None),
                rejected=BriefRejects(sys.stderr) if args.rejected is None else out(args.rejected, None),
                fmt=_record_format(args),
                batch_size=args.batch_size,
                progress=show,  # type: ignore[arg-type]
                read_ahead=not live,  # stdin may be a live stream: no waiting for more
                flush_after=STDIN_FLUSH_AFTER if live else None,
            )
            done()  # type: ignore[operator]
    finally:
        stopped.set()
        signal.signal(signal.SIGTERM, previous)
    nd.index.close()
    if args.quiet:
        pass
    elif args.log_format == "json":
        _log_summary(summary)  # one JSON line
    else:
        if summary.interrupted:
            print(f"interrupted ({summary.interrupted}): what was routed so far is written", file=sys.stderr)
        print(summary.text(), file=sys.stderr)
    return {"": 0, "SIGINT": 130, "SIGTERM": 143}[summary.interrupted]


def cmd_explain(args: argparse.Namespace) -> int:
    from stream.explain import explain

    print(explain(args.a, args.b, _config(args)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from stream.evaluate import score

    nd = NearDupFilter(_config(args), index=args.index)
    fmt = RecordFormat()
    with open(args.truth, "rb") as f:
        truth = [orjson.loads(line) for line in f if line.strip()]
    verdicts: list[Verdict | None] = []
    started = time.perf_counter()
    with open(args.stream, "rb") as f:
        lines = [line for line in f if line.strip()]
    for i in range(0, len(lines), args.batch_size):
        batch = [RawRecord(line, str(i + j + 1), 0.0) for j, line in enumerate(lines[i : i + args.batch_size])]
        for r in route_batch(nd, batch, fmt):
            verdicts.append(r.verdict if r.kind in (UNIQUE, DUPLICATE) else None)
    report = score(truth, verdicts)
    report.seconds = time.perf_counter() - started
    nd.index.close()
    print(report.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neardup", description="Streaming near-duplicate text filter.")
    parser.add_argument("--version", action="version", version=f"neardup {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("filter", help="route JSONL/text records from files or stdin to unique/duplicates/rejected")
    p.add_argument("inputs", nargs="*", help="input files (default or '-': stdin)")
    p.add_argument("--unique", help="where unique records go (default stdout)")
    p.add_argument("--duplicates", help="where duplicates go, with duplicate_of/similarity/method "
                                        "(default: counted, not written)")
    p.add_argument("--rejected", help="where undecodable records go, with the error (default stderr)")
    p.add_argument("--format", choices=FORMATS, default="json", help="json (JSONL, default) or text (one per line)")
    p.add_argument("--text-field", default="text", help="JSON field holding the text (default text)")
    p.add_argument("--id-field", default="id", help="absent in a record: its line number")
    p.add_argument("--ts-field", default="ts", help="seconds since the epoch; absent: arrival time")
    p.add_argument("--batch-size", type=int, default=512, help="records routed together (default 512)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="plain",
                   help="plain (default: progress bar and summary as text) or json (the summary as one JSON line, "
                        "no progress bar)")
    _add_filter_options(p)
    p.set_defaults(func=cmd_filter)

    p = sub.add_parser("explain", help="show normalization, fingerprints, shared buckets and the verdict for A, B")
    p.add_argument("a", help="a message")
    p.add_argument("b", help="another message")
    _add_filter_options(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("eval", help="precision/recall/F1 on a labelled stream (see shared/eval/README.md)")
    p.add_argument("stream", help="JSON lines: id, text, ts (shared/eval/stream.jsonl)")
    p.add_argument("truth", help="JSON lines, one a stream line: id, cluster, ptype, gray (shared/eval/truth.jsonl)")
    p.add_argument("--batch-size", type=int, default=512, help="records routed together (default 512)")
    _add_filter_options(p)
    p.set_defaults(func=cmd_eval)

    try:
        from stream.commands import add_commands
    except ImportError:  # the Kafka extra is not installed: filter/explain/eval still work
        for name in KAFKA_COMMANDS:
            p = sub.add_parser(name, help=f"(needs the Kafka extra: pip install '{KAFKA_EXTRA}')", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(func=_needs_extra)
    else:
        add_commands(sub)
    return parser


KAFKA_COMMANDS = ("serve", "produce", "tail", "top", "config")
KAFKA_EXTRA = "neardup[kafka]"


def _needs_extra(args: argparse.Namespace) -> int:
    raise NeardupError(f"'neardup {args.command}' needs the Kafka extra: pip install '{KAFKA_EXTRA}'")


def _version() -> str:
    try:
        return metadata.version("neardup")
    except metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown (not installed)"


def _glue_normalize_value(argv: Sequence[str]) -> list[str]:
    """`--normalize -pinyin` → `--normalize=-pinyin`: argparse reads a separate value that starts with
    '-' as an option of its own ("expected one argument"), and the documented form starts with '-'."""
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "--":
            out.append(arg)
            out.extend(args)
        elif arg == "--normalize" and (value := next(args, None)) is not None:
            out.append(f"--normalize={value}")
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_glue_normalize_value(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args))
    except NeardupError as exc:
        if getattr(args, "log_format", None) == "json":
            setup_logging("error", "json")
            logging.getLogger("neardup").error(str(exc), extra={"error": type(exc).__name__})
        else:
            print(f"neardup: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # an optional dependency (redis for --index redis://, ...)
        if exc.name and exc.name.split(".")[0] in ("redis", "hiredis", "aiokafka", "faust", "prometheus_client",
                                                   "aiohttp"):
            index = str(getattr(args, "index", "") or "")
            what = f"{args.command} --index {index.split(':', 1)[0]}://" if args.command in ("filter", "eval") \
                else args.command
            print(f"neardup: 'neardup {what}' needs the Kafka extra ({exc.name} is missing): "
                  f"pip install '{KAFKA_EXTRA}'", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:  # Ctrl-C outside the routing loop (which stops cleanly by itself)
        print("neardup: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
