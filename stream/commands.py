"""The Kafka subcommands of `neardup`: serve, produce, tail, top, config (registered by `add_commands`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from filters.errors import NeardupError, ServiceError
from stream.config import (
    FILTER,
    KAFKA,
    WORKER,
    Settings,
    add_settings_arguments,
    parse_duration,
    settings_from_args,
)
from stream.logs import setup_logging, warn_if_interpreted


def _logging(level: str, fmt: str = "plain") -> None:
    setup_logging(level, fmt)


def check_index(settings: Settings) -> None:
    """A shared index that cannot be reached at start is an error within seconds, with its URL: the worker
    would otherwise consume nothing and wait, blocked, on the first batch."""
    if settings.index.startswith("memory:"):
        return
    from filters.index.backends import open_index

    config = settings.filter_config()
    try:
        index = open_index(settings.index, window=config.window, bucket_cap=config.bucket_cap,
                           namespace=config.digest())
        try:
            index.stats()
        finally:
            index.close()
    except ServiceError as exc:
        raise NeardupError(f"cannot reach the index: {exc}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from stream.ops import serve

    settings = settings_from_args(args)
    _logging(settings.log_level, settings.log_format)
    warn_if_interpreted()
    check_index(settings)
    import asyncio  # here, not at the top: `neardup filter` builds this parser too, and never runs a loop

    asyncio.run(serve(settings))
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    import asyncio

    from stream.kafka_tools import ensure_topics, produce_lines

    settings = settings_from_args(args)
    _logging(settings.log_level, settings.log_format)

    async def run() -> int:
        if settings.create_topics:
            await ensure_topics(settings, [args.topic])
        if args.file == "-":
            return await produce_lines(settings, sys.stdin.buffer, args.topic, key_field=args.key_field,
                                       limit=args.limit)
        with open(args.file, "rb") as f:
            return await produce_lines(settings, f, args.topic, key_field=args.key_field, limit=args.limit)

    count = asyncio.run(run())
    print(f"produced {count} records to {args.topic}", file=sys.stderr)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from stream.kafka_tools import missing_topics, read_topics, record_json

    settings = settings_from_args(args)
    _logging(settings.log_level, settings.log_format)
    out = sys.stdout.buffer

    async def run() -> None:
        # Subscribed to, a missing topic would be created empty by a broker with auto.create.topics.enable
        # (a typo, silently): wait for it instead (serve creates its outputs when it starts), at most --timeout.
        deadline = time.monotonic() + (args.timeout if args.timeout is not None else math.inf)
        while missing := await missing_topics(settings, args.topics):
            if time.monotonic() >= deadline:
                raise NeardupError(f"no topic {', '.join(missing)} on Kafka at {settings.kafka_bootstrap}")
            await asyncio.sleep(0.5)
        async for record in read_topics(settings, args.topics, from_beginning=args.from_beginning,
                                        max_records=args.max, idle_timeout=args.timeout):
            out.write(record_json(record) + b"\n")
            out.flush()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


def _duration(text: str) -> float:
    """An argparse type: a duration with its unit (2s, 500ms, 1m)."""
    try:
        return parse_duration(text)
    except NeardupError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_top(args: argparse.Namespace) -> int:
    from stream.campaigns import open_campaigns
    from stream.top import from_http, from_store, run_top

    settings = settings_from_args(args)
    _logging(settings.log_level, settings.log_format)
    if args.source:
        return run_top(from_http(args.source), limit=args.limit, sort=args.sort, interval=args.interval,
                       once=args.once)
    if settings.index.startswith("memory:"):
        raise NeardupError("a memory:// index keeps its campaigns inside the serve process: "
                           "use --from http://HOST:PORT (its metrics port)")
    store = open_campaigns(settings.index, namespace=settings.filter_config().digest(), window=settings.window,
                           minutes=settings.campaign_minutes)
    try:
        if wrong := store.unknown_view():
            print(f"neardup top: {wrong}", file=sys.stderr)
            return 1
        return run_top(from_store(store), limit=args.limit, sort=args.sort, interval=args.interval, once=args.once)
    finally:
        store.close()


def cmd_config(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    print(settings.describe())
    return 0


def add_commands(subparsers: Any) -> None:
    """Register serve, produce, tail, top and config on `subparsers` (from `parser.add_subparsers()`)."""
    p = subparsers.add_parser("serve", help="run the Kafka worker: input topics → unique / duplicate / dead-letter",
                              description="Consume the input topics in batches, route every record to the unique, "
                                          "duplicate or dead-letter topic (verdict in headers), commit after the "
                                          "outputs are acknowledged. Use a redis:// index (shared, survives "
                                          "restarts); memory:// is for trying out.")
    add_settings_arguments(p, (KAFKA, WORKER, FILTER))
    p.add_argument("--exactly-once", dest="processing_guarantee", action="store_const", const="exactly_once",
                   default=None, help="same as --processing-guarantee exactly_once")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("produce", help="load a JSONL file into a topic, one record per line")
    p.add_argument("file", help="JSONL file ('-': stdin)")
    p.add_argument("--topic", required=True, help="the topic to write to")
    p.add_argument("--key-field", default="", help="JSON field whose value becomes the record key")
    p.add_argument("--limit", type=int, default=None, help="produce at most this many lines")
    add_settings_arguments(p, (KAFKA,))
    p.set_defaults(func=cmd_produce)

    p = subparsers.add_parser("tail", help="print records of topics as JSON lines")
    p.add_argument("topics", nargs="+", metavar="TOPIC", help="topics to read")
    p.add_argument("--from-beginning", action="store_true", help="start at the earliest offset (default: new records)")
    p.add_argument("--max", type=int, default=None, help="stop after this many records")
    p.add_argument("--timeout", type=_duration, default=None, help="stop after this long without a record, e.g. 30s")
    add_settings_arguments(p, (KAFKA,))
    p.set_defaults(func=cmd_tail)

    p = subparsers.add_parser("top", help="the duplicate clusters (spam campaigns) of the window, live",
                              description="Show the campaign view: duplicate clusters of the current window with "
                                          "size, growth per minute, first/last seen and the text of the first copy. "
                                          "Reads the index's Redis (the same --index, --window and --methods as "
                                          "serve: they name the namespace), or a worker's HTTP server (--from). "
                                          "Keys (when stdin is a terminal): s size, g growth, l last seen, "
                                          "r refresh now, q quit.")
    p.add_argument("--sort", default="size", choices=("size", "growth", "last"),
                   help="size (default), growth (copies in the last minutes) or last (last seen)")
    p.add_argument("--limit", type=int, default=20, help="clusters shown (default 20)")
    p.add_argument("--interval", type=_duration, default=2.0, help="time between refreshes, e.g. 2s, 500ms (default 2s)")
    p.add_argument("--once", action="store_true", help="print the view once and exit")
    p.add_argument("--from", dest="source", metavar="URL", default=None,
                   help="read a worker's /campaigns, e.g. http://127.0.0.1:9464 (needed for a memory:// index)")
    add_settings_arguments(p, (WORKER, FILTER))
    p.set_defaults(func=cmd_top)

    p = subparsers.add_parser("config", help="print the effective settings, their sources, secrets masked")
    add_settings_arguments(p, (KAFKA, WORKER, FILTER))
    p.set_defaults(func=cmd_config)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m stream.commands …`: the Kafka commands on their own."""
    parser = argparse.ArgumentParser(prog="neardup")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except NeardupError as exc:
        print(f"neardup: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("aiokafka", "faust", "redis", "hiredis", "prometheus_client",
                                                    "aiohttp"):
            raise
        print(f"neardup {args.command} needs the Kafka extra: pip install 'neardup[kafka]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
