"""`neardup top`: the campaign view live in the terminal (plain ANSI), from the index's Redis or a worker's HTTP server.

Interactive when stdin is a terminal: single key presses (cbreak mode) change the sort or redraw at
once, and the terminal is restored however `top` ends (q, Ctrl-C, SIGTERM, an error).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import termios
import threading
import time
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import IO
from urllib.parse import urlencode

import orjson

from filters.errors import ConfigError, NeardupError, ServiceError
from stream.campaigns import CampaignStore, CampaignView
from stream.ops_http import ago, sparkline

CLEAR = "\x1b[H\x1b[2J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
BOLD, DIM, RED, REVERSE, RESET = "\x1b[1m", "\x1b[2m", "\x1b[31m", "\x1b[7m", "\x1b[0m"
SORT_KEYS = {"s": "size", "g": "growth", "l": "last"}  # key -> sort
SORT_LABELS = {"size": "size", "growth": "growth", "last": "last seen"}
REFRESH_KEY, QUIT_KEY = "r", "q"

Fetch = Callable[[int, str], CampaignView]


def from_store(store: CampaignStore) -> Fetch:
    return store.top


def from_http(base: str, timeout: float = 5.0) -> Fetch:
    """The view from a worker's `/campaigns` (the only way to see a memory:// worker's campaigns)."""
    base = base.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--from must be an http(s) URL, got {base!r}")

    def fetch(limit: int, sort: str) -> CampaignView:
        url = f"{base}/campaigns?{urlencode({'limit': limit, 'sort': sort})}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return CampaignView.from_dict(orjson.loads(response.read()))
        except urllib.error.HTTPError as exc:
            raise ServiceError(f"{url}: HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ServiceError(f"{url}: {exc}") from exc
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ServiceError(f"{url}: not a campaign view: {exc}") from exc

    return fetch


def _cells(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def safe(text: str) -> str:
    """Message text fit for a terminal: control and format characters (ESC sequences, bidi overrides,
    zero-width) become spaces, so hostile text cannot move the cursor or recolour the screen."""
    return "".join(ch if ch.isprintable() else " " for ch in text)


def fit(text: str, cells: int) -> str:
    """`text` cut to at most `cells` terminal cells (wide CJK characters take two), padded with spaces."""
    out: list[str] = []
    used = 0
    for ch in text:
        w = _cells(ch)
        if used + w > cells:
            while out and used + 1 > cells:  # room for the ellipsis
                used -= _cells(out.pop())
            if used + 1 <= cells:
                out.append("…")
                used += 1
            break
        out.append(ch)
        used += w
    return "".join(out) + " " * max(0, cells - used)


def _styled(segments: list[tuple[str, str]], width: int, color: bool) -> str:
    """(text, ANSI style) segments cut together to `width` cells; styles only with `color`."""
    out: list[str] = []
    left = width
    for text, style in segments:
        if left <= 0:
            break
        cut = fit(text, left).rstrip(" ") if sum(_cells(ch) for ch in text) > left else text
        left -= sum(_cells(ch) for ch in cut)
        out.append(f"{style}{cut}{RESET}" if color and style and cut else cut)
    return "".join(out)


def header(view: CampaignView, width: int, color: bool, keys: bool = False) -> str:
    """The first line: what is shown, the sort, the time, and with `keys` the keys that work."""
    when = time.strftime("%H:%M:%S", time.localtime(view.now))
    shown = f"top {len(view.campaigns)} of {view.total}" if view.total > len(view.campaigns) else str(view.total)
    segments = [("neardup top", BOLD), (f" · {shown} duplicate clusters · sorted by {SORT_LABELS.get(view.sort, view.sort)}", "")]
    if keys:
        segments.append((" · keys", ""))
        for key, sort in SORT_KEYS.items():
            label = SORT_LABELS[sort]
            segments.append((" ", ""))
            segments.append((f"[{key}]{label.removeprefix(key)}", REVERSE if sort == view.sort else ""))
        segments.append((f" [{REFRESH_KEY}]efresh [{QUIT_KEY}]uit", ""))
    segments.append((f" · {when}", ""))
    return _styled(segments, width, color)


def render(view: CampaignView, width: int, color: bool, keys: bool = False) -> str:
    """The view as text lines for a terminal `width` cells wide (`keys`: list the keys in the header)."""
    d, r, b, z = (DIM, RED, BOLD, RESET) if color else ("", "", "", "")
    lines = [header(view, width, color, keys)]
    m = view.minutes
    spark = max(m, len("per minute"))
    head = (f"{'#':>3} {'size':>7} {f'{m}min':>6} {'growth':>6} {'per minute':<{spark}} {'first':>8} {'last':>8}  "
            f"{'representative':<16}  text")
    lines.append(f"{d}{fit(head, width)}{z}")
    fixed = 3 + 1 + 7 + 1 + 6 + 1 + 6 + 1 + spark + 1 + 8 + 1 + 8 + 2 + 16 + 2
    for rank, c in enumerate(view.campaigns, 1):
        text = fit(safe(c.text), max(10, width - fixed)).rstrip()
        growth = f"×{c.growth:.1f}"
        lines.append(f"{rank:>3} {b}{c.size:>7}{z} {c.recent:>6} {growth:>6} {r}{sparkline(c.per_minute):<{spark}}{z} "
                     f"{ago(view.now - c.first_seen).removesuffix(' ago'):>8} "
                     f"{ago(view.now - c.last_seen).removesuffix(' ago'):>8}  {fit(safe(c.id), 16)}  {text}")
    if not view.campaigns:
        lines.append(f"{d}no duplicate clusters in the window yet{z}")
    return "\n".join(lines) + "\n"


def run_top(fetch: Fetch, *, limit: int, sort: str, interval: float, once: bool,
            out: IO[str] | None = None, keys: IO[str] | None = None, color: bool | None = None,
            width: int | None = None) -> int:
    """Print the view once, or redraw it every `interval` seconds until interrupted. With `keys`
    (default: stdin) a terminal, its key presses change the sort, redraw or quit (`SORT_KEYS`, r, q)."""
    stream = out or sys.stdout
    tty = stream.isatty()
    if color is None:
        color = tty and "NO_COLOR" not in os.environ
    keys = sys.stdin if keys is None else keys
    key_fd = keys.fileno() if not once and keys is not None and keys.isatty() else None
    interactive = key_fd is not None

    def columns() -> int:
        if width:
            return width
        return (os.get_terminal_size(stream.fileno()).columns or 120) if tty else 120  # a new pty says 0

    def draw(current: str) -> None:
        try:
            text = render(fetch(limit, current), columns(), color, keys=interactive)
        except NeardupError as exc:  # keep watching through an outage
            hint = f"; {REFRESH_KEY}: now, {QUIT_KEY}: quit" if interactive else ""
            text = f"neardup top: {exc}\n(retrying every {interval:g}s{hint})\n"
        stream.write(CLEAR + text if tty else text + "\n")
        stream.flush()

    if once:
        stream.write(render(fetch(limit, sort), columns(), color))
        return 0
    try:
        if key_fd is None:
            while True:
                draw(sort)
                time.sleep(interval)
        with cbreak(key_fd), sigterm_exits():
            if tty:
                stream.write(HIDE_CURSOR)
            try:
                current: str | None = sort
                while current is not None:
                    draw(current)
                    current = wait_for_key(key_fd, interval, current)
            finally:
                if tty:
                    stream.write(SHOW_CURSOR)
                    stream.flush()
    except KeyboardInterrupt:
        pass
    return 0


def wait_for_key(fd: int, interval: float, sort: str) -> str | None:
    """Wait up to `interval` seconds for keys on `fd`: the sort to draw next (the same one when the
    time is up or `r` was pressed), or None for `q`. Keys that mean nothing are ignored."""
    deadline = time.monotonic() + interval
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break
        data = os.read(fd, 64)
        if not data:  # the terminal hung up: no keys any more, only the timer
            time.sleep(max(0.0, deadline - time.monotonic()))
            break
        if data.startswith(b"\x1b"):  # an arrow or function key's escape sequence, not a letter
            continue
        pressed = [chr(c) for c in data if chr(c) in SORT_KEYS or chr(c) in (REFRESH_KEY, QUIT_KEY)]
        if QUIT_KEY in pressed:
            return None
        if pressed:
            last = pressed[-1]
            return SORT_KEYS.get(last, sort)
    return sort


@contextmanager
def cbreak(fd: int) -> Iterator[None]:
    """The terminal on `fd` in cbreak mode: each key arrives at once and unechoed, Ctrl-C still
    interrupts; its previous settings come back however the block ends."""
    saved = termios.tcgetattr(fd)
    mode = termios.tcgetattr(fd)
    mode[3] &= ~(termios.ECHO | termios.ICANON)  # lflags
    mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, mode)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """SIGTERM raises SystemExit (status 143) so that `finally` blocks restore the terminal; the
    previous handler comes back afterwards. Only the main thread can set handlers: elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
