"""`neardup top`: the campaign view live in the terminal (plain ANSI), from the index's Redis or a worker's HTTP server."""

from __future__ import annotations

import os
import sys
import time
import unicodedata
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import IO
from urllib.parse import urlencode

import orjson

from filters.errors import ConfigError, NeardupError, ServiceError
from stream.campaigns import CampaignStore, CampaignView
from stream.ops_http import ago, sparkline

CLEAR = "\x1b[H\x1b[2J"
BOLD, DIM, RED, RESET = "\x1b[1m", "\x1b[2m", "\x1b[31m", "\x1b[0m"

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


def render(view: CampaignView, width: int, color: bool) -> str:
    """The view as text lines for a terminal `width` cells wide."""
    b, d, r, z = (BOLD, DIM, RED, RESET) if color else ("", "", "", "")
    when = time.strftime("%H:%M:%S", time.localtime(view.now))
    shown = f"top {len(view.campaigns)} of {view.total}" if view.total > len(view.campaigns) else str(view.total)
    lines = [f"{b}neardup top{z} · {shown} duplicate clusters in the window · sorted by {view.sort} · {when}"]
    m = view.minutes
    head = f"{'#':>3} {'size':>7} {f'{m}min':>6} {'per minute':<{m}} {'first':>8} {'last':>8}  {'representative':<16}  text"
    lines.append(f"{d}{fit(head, width)}{z}")
    fixed = 3 + 1 + 7 + 1 + 6 + 1 + m + 1 + 8 + 1 + 8 + 2 + 16 + 2
    for rank, c in enumerate(view.campaigns, 1):
        text = fit(safe(c.text), max(10, width - fixed)).rstrip()
        lines.append(f"{rank:>3} {b}{c.size:>7}{z} {c.growth:>6} {r}{sparkline(c.per_minute)}{z} "
                     f"{ago(view.now - c.first_seen).removesuffix(' ago'):>8} "
                     f"{ago(view.now - c.last_seen).removesuffix(' ago'):>8}  {fit(safe(c.id), 16)}  {text}")
    if not view.campaigns:
        lines.append(f"{d}no duplicate clusters in the window yet{z}")
    return "\n".join(lines) + "\n"


def run_top(fetch: Fetch, *, limit: int, sort: str, interval: float, once: bool,
            out: IO[str] | None = None, color: bool | None = None, width: int | None = None) -> int:
    """Print the view once, or redraw it every `interval` seconds until interrupted."""
    stream = out or sys.stdout
    tty = stream.isatty()
    if color is None:
        color = tty and "NO_COLOR" not in os.environ

    def columns() -> int:
        if width:
            return width
        return os.get_terminal_size(stream.fileno()).columns if tty else 120

    if once:
        stream.write(render(fetch(limit, sort), columns(), color))
        return 0
    try:
        while True:
            try:
                text = render(fetch(limit, sort), columns(), color)
            except NeardupError as exc:  # keep watching through an outage
                text = f"neardup top: {exc}\n(retrying every {interval:g}s)\n"
            stream.write(CLEAR + text if tty else text + "\n")
            stream.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
