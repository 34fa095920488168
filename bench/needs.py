"""What a benchmark needs (data files, extras, tools, services), checked first: one line naming it, exit 2."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

EVAL_DATA = "the labelled eval stream (see shared/eval/README.md; give --stream and --truth)"


def _fail(script: str, what: str) -> None:
    name = Path(sys.argv[0]).name if sys.argv[0].endswith(".py") else Path(script).name  # the script run
    print(f"{name} needs {what}", file=sys.stderr)
    raise SystemExit(2)


def modules(script: str, *names: str, install: str) -> None:
    """Every module of `names` importable, else: which one, and the install command."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            _fail(script, f"the Python package {name}: pip install '{install}'")


def files(script: str, *paths: str | Path, what: str = EVAL_DATA) -> None:
    for path in paths:
        if not Path(path).is_file():
            _fail(script, f"{what}: {path} is missing")


def tool(script: str, name: str, install: str) -> None:
    if shutil.which(name) is None:
        _fail(script, f"the {name} program: {install}")


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        return False
    return True


def redis(script: str, url: str) -> None:
    """A Redis server answering at `url` (its first host), e.g. from docker/services.sh."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if parts.scheme.startswith(("redis", "rediss")) and not _reachable(host, port):
        _fail(script, f"a Redis server at {host}:{port} (start one: docker/services.sh start; or give its URL)")


def kafka(script: str, bootstrap: str) -> None:
    """A Kafka broker answering at one of the `bootstrap` servers."""
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    for server in servers:
        host, _, port = server.rpartition(":")
        if _reachable(host or "127.0.0.1", int(port or 9092)):
            return
    _fail(script, f"a Kafka broker at {bootstrap} (start one: docker/services.sh start; or set NEARDUP_TEST_KAFKA)")
