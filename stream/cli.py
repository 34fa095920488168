"""The `neardup` command line: `filter`, `explain`, `eval`, and the Kafka commands from stream.commands."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any, NoReturn

from filters.config import FilterConfig
from filters.engine import NearDupFilter, Verdict
from filters.errors import NeardupError
from stream.codec import FORMATS, RecordFormat
from stream.collector import tune_collector
from stream.config import FILTER, add_settings_arguments, settings_from_args
from stream.inputs import InputError, Inputs
from stream.logs import LOG_FORMATS, setup_logging, warn_if_interpreted
from stream.runner import DUPLICATE, FILE_BATCH, UNIQUE, RawRecord, Summary, route_batch, run_filter

SHOWN_CHARS = 200  # of a rejected record, on stderr


class FileSink:
    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._write = stream.write

    def write(self, record: bytes) -> None:
        self._write(record + b"\n")

    def write_many(self, records: list[bytes]) -> None:
        # One write a batch: under `python -u` / PYTHONUNBUFFERED stdout has no buffer, one system call each.
        if records:
            self._write(b"\n".join([*records, b""]))  # (the last line's end joined in: no copy of the whole)

    def flush(self) -> None:
        self._stream.flush()


def _add_filter_options(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p, (FILTER,))


def _config(args: argparse.Namespace) -> FilterConfig:
    """The FilterConfig from flags > NEARDUP_* environment > --config/$NEARDUP_CONFIG file > FilterConfig's defaults."""
    return settings_from_args(args).filter_config()


def _record_format(args: argparse.Namespace) -> RecordFormat:
    return RecordFormat(args.format, args.text_field, args.id_field, args.ts_field)


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A one-line progress display on a terminal: percent of the input bytes read, the current rate (over the
    last seconds, not since start) and the time left; nothing at all when disabled (stderr not a terminal)."""

    def __init__(self, enabled: bool, inputs: Inputs) -> None:
        self.enabled, self.inputs = enabled, inputs
        self._last = 0.0
        # (time, messages, bytes) of recent updates; the start is one, so the first line has a rate and an ETA
        self._marks: list[tuple[float, int, int]] = [(time.monotonic(), 0, 0)]

    def show(self, s: Summary) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.2:
            return
        self._last = now
        done = self.inputs.done_bytes()
        self._marks = [m for m in self._marks if now - m[0] <= 5.0] + [(now, s.seen, done)]
        t0, seen0, done0 = self._marks[0]
        span = now - t0
        rate = (s.seen - seen0) / span if span > 0 else 0.0
        parts = [f"{s.seen:,} messages", f"{s.duplicate:,} duplicates", f"{s.rejected:,} rejected", f"{rate:,.0f}/s"]
        total = self.inputs.total_bytes
        if total:
            parts.insert(0, f"{min(done / total, 1.0):6.1%}")
            byte_rate = (done - done0) / span if span > 0 else 0.0
            if byte_rate > 0:
                parts.append(f"ETA {_eta((total - done) / byte_rate)}")
        sys.stderr.write("\r\033[K" + "  ".join(parts))
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


class RejectNotices:
    """Rejected records on stderr, one short line each: the reason and the start of the record with its length
    (a 2 MB line must not flood the terminal); the full record goes to --rejected. After `limit` lines, only
    the summary counts them."""

    def __init__(self, enabled: bool, limit: int = 20) -> None:
        self.enabled, self.limit, self.shown = enabled, limit, 0

    def __call__(self, position: str, reason: str, raw: bytes) -> None:
        if not self.enabled:
            return
        self.shown += 1
        if self.shown > self.limit:
            if self.shown == self.limit + 1:
                sys.stderr.write("neardup: more rejected records: counted in the summary, written to --rejected\n")
            return
        text = raw.rstrip(b"\r\n").decode("utf-8", "replace")
        start = text[:SHOWN_CHARS].replace("\n", " ")
        size = len(raw.rstrip(b"\r\n"))
        more = f"... ({size:,} bytes)" if len(text) > SHOWN_CHARS else ""
        sys.stderr.write(f"neardup: rejected record {position} ({reason}): {start}{more}\n")


def _log_summary(summary: Summary) -> None:
    checked = summary.unique + summary.duplicate
    logging.getLogger("neardup.filter").info(
        summary.text().replace("\n", "; "),
        extra={"in": summary.seen, "unique": summary.unique, "duplicate": summary.duplicate,
               "rejected": summary.rejected, "duplicate_ratio": round(summary.duplicate / checked, 6) if checked else 0.0,
               "seconds": round(summary.seconds, 3), "reasons": dict(summary.reasons), "methods": dict(summary.methods)})


class _Interrupted:
    """SIGINT/SIGTERM during `filter`: the input ends at the next line (or idle tick of a live stdin), what was read
    is routed, the outputs are flushed (whole lines) and the summary printed; the exit code is 128 + signal.
    A second signal stops at once."""

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self.signum = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Interrupted:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (embedded use): no signal handling
                pass
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        self.inputs.stop()

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def cmd_filter(args: argparse.Namespace) -> int:
    setup_logging("info", args.log_format)
    warn_if_interpreted()
    settings = settings_from_args(args)
    with ExitStack() as stack:
        inputs = Inputs(args.inputs, stack)  # every input checked before the index is opened or output written

        def out(path: str | None) -> FileSink | None:
            """None: not written (duplicates and rejected records are then counted only, never made)."""
            if path is None:
                return None
            if path == "-":
                return FileSink(sys.stdout.buffer)
            try:
                return FileSink(stack.enter_context(open(path, "wb")))
            except OSError as exc:
                raise InputError(f"{path}: cannot write: {exc.strerror}") from None

        sinks = (out(args.unique) or FileSink(sys.stdout.buffer), out(args.duplicates), out(args.rejected))
        nd = NearDupFilter(settings.filter_config(), index=settings.index)
        stack.callback(nd.index.close)
        tune_collector()
        progress = Progress(sys.stderr.isatty() and not args.quiet and args.log_format == "plain", inputs)
        notices = RejectNotices(not args.quiet and args.log_format == "plain")
        with _Interrupted(inputs) as interrupted:
            summary = run_filter(
                nd,
                inputs.lines(),
                unique=sinks[0],
                duplicates=sinks[1],
                rejected=sinks[2],
                fmt=_record_format(args),
                batch_size=args.batch_size,
                progress=progress.show,
                read_ahead=not inputs.live,  # stdin may be a live stream: no waiting for more
                on_rejected=lambda r: notices(r.raw.fallback_id, r.error.reason if r.error else "?", r.raw.value),
            )
            progress.done()
    if args.quiet:
        pass
    elif args.log_format == "json":
        _log_summary(summary)  # one JSON line
    else:
        print(summary.text(), file=sys.stderr)
    if interrupted.signum:
        if not args.quiet and args.log_format == "plain":
            print(f"neardup: interrupted by {signal.Signals(interrupted.signum).name}: the summary is of what was "
                  "read so far", file=sys.stderr)
        return 128 + interrupted.signum
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from stream.explain import explain

    print(explain(args.a, args.b, _config(args)))
    return 0


SAMPLE_NAMES = ("sample.jsonl", "sample_truth.jsonl")


def sample_paths() -> tuple[Path, Path]:
    """The labelled sample of a clone: beside the code (editable install) or, after `pip install .`, whose
    code lives in site-packages, in the clone the command runs from."""
    dirs = [Path(__file__).resolve().parents[1] / "tests" / "data", Path.cwd() / "tests" / "data"]
    for d in dirs:
        if all((d / name).is_file() for name in SAMPLE_NAMES):
            return d / SAMPLE_NAMES[0], d / SAMPLE_NAMES[1]
    raise NeardupError(f"the labelled sample ships in a clone of the repository (tests/data/{SAMPLE_NAMES[0]}): "
                       "run from the clone's top directory, or give STREAM TRUTH")


def cmd_eval(args: argparse.Namespace) -> int:
    from stream.eval_report import length_table, score_lengths, worst
    from stream.evaluate import read_truth, score

    if args.sample:
        stream_path, truth_path = map(str, sample_paths())
    elif args.stream and args.truth:
        stream_path, truth_path = args.stream, args.truth
    else:
        raise NeardupError("eval needs a labelled stream: neardup eval STREAM.jsonl TRUTH.jsonl (truth format in "
                           "docs/cli.md), or neardup eval --sample (the sample in a clone's tests/data/)")
    settings = settings_from_args(args)
    nd = NearDupFilter(settings.filter_config(), index=settings.index)
    fmt = RecordFormat()
    with ExitStack() as stack:
        truth = read_truth(Inputs([truth_path], stack).lines(), truth_path)
        lines = [line for line in Inputs([stream_path], stack).lines() if line.strip()]
    if len(truth) != len(lines):
        raise NeardupError(f"{truth_path} has {len(truth)} rows but {stream_path} has {len(lines)} records: "
                           "the truth needs one row per record, in the same order")
    verdicts: list[Verdict | None] = []
    texts: list[str] = []  # for recall by length; a rejected record counts as empty
    ids: list[str] = []  # for the worst misses and false positives: what a verdict's duplicate_of names
    started = time.perf_counter()
    for i in range(0, len(lines), args.batch_size):
        batch = [RawRecord(line, str(i + j + 1), 0.0) for j, line in enumerate(lines[i : i + args.batch_size])]
        for r in route_batch(nd, batch, fmt):
            verdicts.append(r.verdict if r.kind in (UNIQUE, DUPLICATE) else None)
            texts.append(r.decoded.message.text if r.decoded is not None else "")
            ids.append(r.decoded.message.id if r.decoded is not None else "")
    report = score(truth, verdicts)
    report.seconds = time.perf_counter() - started
    nd.index.close()
    print(report.table())
    print()
    print(length_table(score_lengths(truth, texts, verdicts)))
    if args.misses or args.fps:
        print()
        stream = [{"id": id, "text": text} for id, text in zip(ids, texts)]
        print(worst(stream, truth, verdicts, settings.filter_config(), args.misses, args.fps, args.kind))
    return 0


def _version() -> str:
    from importlib import metadata  # only for --version: importing it costs every other run ≈ 20 ms

    try:
        return metadata.version("neardup")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """`--version`, as argparse's "version" action, but the version is looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"neardup {_version()}")
        parser.exit()


class OneLineParser(argparse.ArgumentParser):
    """A refused option is one line on stderr and exit code 2: the usage of `top` or `serve` is 40 lines,
    which buried the message saying what to write instead. Subcommands' parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; given one of `CORE_COMMANDS`, with that command's parser alone (what parsing it
    needs: building the others' ≈ 400 options was most of a short `neardup filter`'s set-up)."""
    parser = OneLineParser(prog="neardup", description="Streaming near-duplicate text filter.")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in _CORE.items():
        if command in (None, name):
            add(sub)
    if command not in CORE_COMMANDS:
        from stream.commands import add_commands  # needs only the core: the Kafka extra is imported when run

        add_commands(sub)
    return parser


def _add_filter(sub: Any) -> None:
    p = sub.add_parser("filter", help="route JSONL/text records from files or stdin to unique/duplicates/rejected",
                       description="Route records to unique (stdout), duplicates and rejected. Inputs may be "
                                   "gzip-compressed. Settings also come from NEARDUP_* variables and --config.")
    p.add_argument("inputs", nargs="*", help="input files, plain or gzip (default or '-': stdin)")
    p.add_argument("--unique", help="where unique records go (default stdout)")
    p.add_argument("--duplicates", help="where duplicates go, with duplicate_of/similarity/method "
                                        "(default: counted, not written)")
    p.add_argument("--rejected", help="where undecodable records go, whole, with the error (default: not written; "
                                      "stderr shows each one's reason and start)")
    p.add_argument("--format", choices=FORMATS, default="json", help="json (JSONL, default) or text (one per line)")
    p.add_argument("--text-field", default="text", help="JSON field holding the text (default text)")
    p.add_argument("--id-field", default="id", help="JSON field holding the id (default id); absent: the line number")
    p.add_argument("--ts-field", default="ts", help="JSON field of seconds since the epoch (default ts); "
                                                    "absent: arrival time")
    p.add_argument("--batch-size", type=_positive_int, default=FILE_BATCH,
                   help=f"records routed together (default {FILE_BATCH})")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress, rejected notices or summary")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="plain",
                   help="plain (default: progress bar and summary as text) or json (the summary as one JSON line, "
                        "no progress bar)")
    _add_filter_options(p)
    p.set_defaults(func=cmd_filter)


def _add_explain(sub: Any) -> None:
    p = sub.add_parser("explain", help="show normalization, fingerprints, shared buckets and the verdict for A, B")
    p.add_argument("a", help="the first text")
    p.add_argument("b", help="the second text (its verdict after A is shown)")
    _add_filter_options(p)
    p.set_defaults(func=cmd_explain)


def _add_eval(sub: Any) -> None:
    p = sub.add_parser("eval", help="precision/recall/F1 on a labelled stream (truth format: docs/cli.md)")
    p.add_argument("stream", nargs="?", help="JSONL stream of {id, text, ts} records")
    p.add_argument("truth", nargs="?", help="JSONL truth, one {id, cluster, corpus, ptype, gray} row per record")
    p.add_argument("--sample", action="store_true", help="the labelled sample in the clone's tests/data/")
    p.add_argument("--batch-size", type=_positive_int, default=FILE_BATCH,
                   help=f"records routed together (default {FILE_BATCH})")
    p.add_argument("--misses", type=_count, default=0, metavar="N",
                   help="list the N nearest misses, each with the rule that refused it (default 0)")
    p.add_argument("--fps", type=_count, default=0, metavar="N",
                   help="list the N weakest false positives, each with what it matched (default 0)")
    p.add_argument("--kind", metavar="PTYPE",
                   help="list only the misses and false positives of this perturbation kind (the truth's ptype)")
    _add_filter_options(p)
    p.set_defaults(func=cmd_eval)


_CORE: dict[str, Callable[[Any], None]] = {"filter": _add_filter, "explain": _add_explain, "eval": _add_eval}
CORE_COMMANDS = tuple(_CORE)  # this module's commands: the others are stream.commands' (Kafka, Redis)


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {text}")
        return value

    return parse


_positive_int = _at_least(1)
_count = _at_least(0)


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


# Modules of the extras, and which extra brings them.
_EXTRA_OF = {"aiokafka": "kafka", "faust": "kafka", "prometheus_client": "kafka", "aiohttp": "kafka",
             "redis": "kafka", "hiredis": "kafka", "kafka": "kafka"}


def _missing_extra(exc: ModuleNotFoundError, args: argparse.Namespace) -> str | None:
    root = (exc.name or "").split(".")[0]
    if root not in _EXTRA_OF:
        return None
    what = f"neardup {args.command}"
    if args.command in ("filter", "explain", "eval", "top") and root in ("redis", "hiredis"):
        what += " --index redis://"
    return f"{what} needs the Kafka extra: pip install 'neardup[kafka]'"


def main(argv: Sequence[str] | None = None) -> int:
    argv = _glue_normalize_value(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv and argv[0] in CORE_COMMANDS else None).parse_args(argv)
    try:
        return int(args.func(args))
    except NeardupError as exc:
        if getattr(args, "log_format", None) == "json":
            setup_logging("error", "json")
            logging.getLogger("neardup").error(str(exc), extra={"error": type(exc).__name__})
        else:
            print(f"neardup: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        message = _missing_extra(exc, args)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside `filter`'s loop
        return 130


if __name__ == "__main__":
    sys.exit(main())
