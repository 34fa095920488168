"""Input of `neardup filter`: files and stdin as lines, gzip read transparently, binary refused, live stdin flushed when idle."""

from __future__ import annotations

import gzip
import io
import os
import queue
import sys
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from typing import IO

from filters.errors import NeardupError

GZIP_MAGIC = b"\x1f\x8b"
# Yielded by `Inputs.lines` when live input has paused: the runner routes the partial batch it holds
# (a real line is never empty: it has at least its newline or one byte).
IDLE = b""
IDLE_SECONDS = 0.05
_SNIFF = 8192  # a NUL byte in this much of the start means binary input (as grep decides)
# A file is read this much at a time: with the default buffer (the file system's block, 4 KiB) the dev stream
# took ≈ 3,500 read calls.
_READ_BYTES = 1 << 20


class InputError(NeardupError):
    """An input that cannot be read as lines: missing, a directory, unreadable, binary."""


def _binary(head: bytes, name: str) -> None:
    if b"\x00" in head[:_SNIFF]:
        raise InputError(f"{name}: binary input, not text or JSON lines")


class Inputs:
    """The lines of `paths` ('-' is stdin) in order. Every file is opened (and its start checked) at once, so a
    bad one is reported before any output. `done_bytes()`/`total_bytes` give progress (total is None when
    stdin is among the inputs). `stop()` ends the lines at the next line or idle tick."""

    def __init__(self, paths: Sequence[str], stack: ExitStack, stdin: IO[bytes] | None = None) -> None:
        self._paths = list(paths) or ["-"]
        self._stdin = stdin if stdin is not None else sys.stdin.buffer
        self._stopped = threading.Event()
        self._stop = False  # `_stopped.is_set()`, read once a line without a call
        self._files: list[tuple[str, IO[bytes] | None, IO[bytes] | None]] = []  # (name, lines, raw file)
        self._done = 0
        self._raw: IO[bytes] | None = None
        self._counted = 0
        total = 0
        for path in self._paths:
            if path == "-":
                self._files.append(("stdin", None, None))
                continue
            try:
                raw = stack.enter_context(open(path, "rb", buffering=_READ_BYTES))  # closed by the stack
                total += os.fstat(raw.fileno()).st_size
                head = raw.peek(_SNIFF)[:_SNIFF] if isinstance(raw, io.BufferedReader) else b""
            except IsADirectoryError:
                raise InputError(f"{path}: is a directory, not a file") from None
            except FileNotFoundError:
                raise InputError(f"{path}: no such file") from None
            except OSError as exc:
                raise InputError(f"{path}: cannot read: {exc.strerror}") from None
            lines: IO[bytes] = raw
            if head.startswith(GZIP_MAGIC):
                lines = stack.enter_context(gzip.open(raw, "rb"))  # type: ignore[arg-type]
                try:
                    head = lines.peek(_SNIFF)[:_SNIFF]  # type: ignore[attr-defined]
                except (OSError, EOFError) as exc:
                    raise InputError(f"{path}: broken gzip data: {exc}") from None
            _binary(head, path)
            self._files.append((path, lines, raw))
        self.total_bytes: int | None = None if any(f[1] is None for f in self._files) else total
        self.live = any(f[1] is None for f in self._files)

    def stop(self) -> None:
        self._stop = True
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def done_bytes(self) -> int:
        """Bytes of the input files read so far (compressed bytes for gzip)."""
        if self._raw is None:
            return self._done
        try:
            return self._done + self._raw.tell()
        except (OSError, ValueError):
            return self._done

    def lines(self) -> Iterator[bytes]:
        for name, lines, raw in self._files:
            if lines is None:
                yield from self._stdin_lines()
            else:
                self._raw = raw
                try:
                    for line in lines:
                        if self._stop:
                            return
                        yield line
                except (OSError, EOFError, zlib.error) as exc:
                    raise InputError(f"{name}: cannot read: {exc}") from None
                assert raw is not None
                self._done += os.fstat(raw.fileno()).st_size
                self._raw = None
            if self._stopped.is_set():
                return

    def _stdin_lines(self) -> Iterator[bytes]:
        try:
            fd = self._stdin.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            fd = None
        if fd is None:  # an in-memory stdin (tests): nothing live about it
            for lines in _decoded_lines(iter(lambda: self._stdin.read(65536), b""), "stdin"):
                yield from lines
            return
        # A live pipe: a reader thread, so that a pause in the input routes what has arrived (IDLE), and a
        # signal is noticed while nothing arrives. os.read on the descriptor holds no lock of the buffered
        # stdin object, so the thread left blocked at exit cannot hang the interpreter's shutdown.
        chunks: queue.Queue[list[bytes] | BaseException | None] = queue.Queue(maxsize=64)

        def read() -> None:
            try:
                for lines in _decoded_lines(iter(lambda: os.read(fd, 65536), b""), "stdin"):
                    chunks.put(lines)  # the lines of one read: one queue hand-over each, not one per line
            except BaseException as exc:  # handed to the main thread
                chunks.put(exc)
            chunks.put(None)

        threading.Thread(target=read, name="neardup-stdin", daemon=True).start()
        while not self._stopped.is_set():
            try:
                item = chunks.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                yield IDLE
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item


def _decoded_lines(chunks: Iterator[bytes], name: str) -> Iterator[list[bytes]]:
    """The lines of byte chunks, a list per chunk: gzip (by its magic bytes) decompressed as it streams, binary
    refused."""
    first = b""
    for chunk in chunks:
        first += chunk
        if len(first) >= 2:
            break
    if first.startswith(GZIP_MAGIC):
        inflate = zlib.decompressobj(wbits=31)

        def inflated() -> Iterator[bytes]:
            try:
                yield inflate.decompress(first)
                for chunk in chunks:
                    yield inflate.decompress(chunk)
                yield inflate.flush()
            except zlib.error as exc:
                raise InputError(f"{name}: broken gzip data: {exc}") from None

        source: Iterator[bytes] = inflated()
    else:
        source = _chain(first, chunks)
    pending = b""
    checked = 0
    for chunk in source:
        if checked < _SNIFF:
            _binary(chunk[: _SNIFF - checked], name)
            checked += len(chunk)
        pending += chunk
        if b"\n" not in chunk:
            continue
        *whole, pending = pending.split(b"\n")
        yield [line + b"\n" for line in whole]
    if pending:
        yield [pending]


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest
