"""The `neardup` command line: `filter`, `explain`, `eval`, and the Kafka commands from stream.commands."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import IO

import orjson

from filters.config import METHODS, VERIFY_MODES, FilterConfig
from filters.engine import NearDupFilter, Verdict
from filters.errors import NeardupError
from filters.normalize import NormalizeOptions
from stream.codec import FORMATS, RecordFormat
from stream.collector import tune_collector
from stream.config import parse_duration
from stream.logs import LOG_FORMATS, setup_logging, warn_if_interpreted
from stream.runner import DUPLICATE, UNIQUE, RawRecord, Summary, route_batch, run_filter


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
    g.add_argument("--verify", choices=VERIFY_MODES, default="sketch")
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


def _lines(paths: Sequence[str], stack: ExitStack) -> Iterator[bytes]:
    for path in paths or ["-"]:
        stream = sys.stdin.buffer if path == "-" else stack.enter_context(open(path, "rb"))
        yield from stream


def _progress(enabled: bool) -> tuple[object, object]:
    last = [0.0]

    def show(s: Summary) -> None:
        now = time.monotonic()
        if enabled and now - last[0] > 0.2:
            last[0] = now
            rate = s.seen / s.seconds if s.seconds else 0
            sys.stderr.write(f"\r{s.seen:,} messages  {s.duplicate:,} duplicates  "
                             f"{s.rejected:,} rejected  {rate:,.0f}/s ")
            sys.stderr.flush()

    def done() -> None:
        if enabled:
            sys.stderr.write("\r\033[K")

    return show, done


def _log_summary(summary: Summary) -> None:
    checked = summary.unique + summary.duplicate
    logging.getLogger("neardup.filter").info(
        summary.text().replace("\n", "; "),
        extra={"in": summary.seen, "unique": summary.unique, "duplicate": summary.duplicate,
               "rejected": summary.rejected, "duplicate_ratio": round(summary.duplicate / checked, 6) if checked else 0.0,
               "seconds": round(summary.seconds, 3), "reasons": dict(summary.reasons), "methods": dict(summary.methods)})


def cmd_filter(args: argparse.Namespace) -> int:
    setup_logging("info", args.log_format)
    warn_if_interpreted()
    nd = NearDupFilter(_config(args), index=args.index)
    tune_collector()
    with ExitStack() as stack:
        def out(path: str | None, default: IO[bytes] | None) -> FileSink:
            if path is None:
                return FileSink(default)
            if path == "-":
                return FileSink(sys.stdout.buffer)
            return FileSink(stack.enter_context(open(path, "wb")))

        show, done = _progress(sys.stderr.isatty() and not args.quiet and args.log_format == "plain")
        summary = run_filter(
            nd,
            _lines(args.inputs, stack),
            unique=out(args.unique, sys.stdout.buffer),
            duplicates=out(args.duplicates, None),
            rejected=out(args.rejected, sys.stderr.buffer),
            fmt=_record_format(args),
            batch_size=args.batch_size,
            progress=show,  # type: ignore[arg-type]
            read_ahead="-" not in (args.inputs or ["-"]),  # stdin may be a live stream: no waiting for more
        )
        done()  # type: ignore[operator]
    nd.index.close()
    if args.quiet:
        pass
    elif args.log_format == "json":
        _log_summary(summary)  # one JSON line
    else:
        print(summary.text(), file=sys.stderr)
    return 0


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
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("filter", help="route JSONL/text records from files or stdin to unique/duplicates/rejected")
    p.add_argument("inputs", nargs="*", help="input files (default or '-': stdin)")
    p.add_argument("--unique", help="where unique records go (default stdout)")
    p.add_argument("--duplicates", help="where duplicates go, with duplicate_of/similarity/method "
                                        "(default: counted, not written)")
    p.add_argument("--rejected", help="where undecodable records go, with the error (default stderr)")
    p.add_argument("--format", choices=FORMATS, default="json", help="json (JSONL, default) or text (one per line)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--id-field", default="id", help="absent in a record: its line number")
    p.add_argument("--ts-field", default="ts", help="seconds since the epoch; absent: arrival time")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="plain",
                   help="plain (default: progress bar and summary as text) or json (the summary as one JSON line, "
                        "no progress bar)")
    _add_filter_options(p)
    p.set_defaults(func=cmd_filter)

    p = sub.add_parser("explain", help="show normalization, fingerprints, shared buckets and the verdict for A, B")
    p.add_argument("a")
    p.add_argument("b")
    _add_filter_options(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("eval", help="precision/recall/F1 on a labelled stream (see shared/eval/README.md)")
    p.add_argument("stream")
    p.add_argument("truth")
    p.add_argument("--batch-size", type=int, default=512)
    _add_filter_options(p)
    p.set_defaults(func=cmd_eval)

    try:
        from stream.commands import add_commands
    except ImportError:  # the Kafka extra is not installed: filter/explain/eval still work
        pass
    else:
        add_commands(sub)
    return parser


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
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
