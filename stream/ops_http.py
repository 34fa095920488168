"""The worker's HTTP endpoints: /metrics, /health, /ready, /campaigns[/<id>] (JSON) and the campaign pages (/, /campaign.html).

Served by aiohttp on the worker's own event loop. Message texts are hostile input: the page escapes
every text it shows, runs no script at all, and says so in its Content-Security-Policy, so that even
an escaping mistake could not run one.
"""

from __future__ import annotations

import html
import time
from typing import Any, Protocol
from urllib.parse import urlencode

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from filters.errors import NeardupError
from stream.campaigns import SORTS, CampaignDetail, CampaignView

DEFAULT_LIMIT = 50
MAX_LIMIT = 1000
DEFAULT_REFRESH = 5  # seconds between page reloads
SPARK = "▁▂▃▄▅▆▇█"
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class Endpoints(Protocol):
    """What the server asks of the worker side (`stream.ops.Ops`)."""

    async def metrics_text(self) -> bytes: ...

    async def health(self) -> tuple[bool, dict[str, Any]]: ...

    async def ready(self) -> tuple[bool, dict[str, Any]]: ...

    async def campaigns(self, limit: int, sort: str) -> CampaignView: ...

    async def campaign(self, campaign_id: str) -> CampaignDetail | None: ...


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be an integer") from None
    if not low <= value <= high:
        raise web.HTTPBadRequest(text=f"{name} must be between {low} and {high}")
    return value


def _query(request: web.Request) -> tuple[int, str]:
    sort = request.query.get("sort", "size")
    if sort not in SORTS:
        raise web.HTTPBadRequest(text=f"sort must be one of {', '.join(SORTS)}")
    return _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT), sort


def build_app(ops: Endpoints) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        body = await ops.metrics_text()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        ok, body = await ops.health()
        return _json(body, 200 if ok else 503)

    async def ready(_: web.Request) -> web.Response:
        ok, body = await ops.ready()
        return _json(body, 200 if ok else 503)

    async def campaigns_json(request: web.Request) -> web.Response:
        limit, sort = _query(request)
        try:
            view = await ops.campaigns(limit, sort)
        except NeardupError as exc:
            return _json({"error": str(exc)}, 503)
        return _json(view.to_dict())

    async def campaigns_page(request: web.Request) -> web.Response:
        limit, sort = _query(request)
        refresh = _int_param(request, "refresh", DEFAULT_REFRESH, 0, 3600)
        try:
            page = render_page(await ops.campaigns(limit, sort), refresh=refresh, limit=limit)
            status = 200
        except NeardupError as exc:
            page = render_error(str(exc), refresh=refresh)
            status = 503
        return web.Response(text=page, status=status, content_type="text/html", charset="utf-8",
                            headers=PAGE_HEADERS)

    async def campaign_json(request: web.Request) -> web.Response:
        campaign_id = request.match_info["id"]
        try:
            detail = await ops.campaign(campaign_id)
        except NeardupError as exc:
            return _json({"error": str(exc)}, 503)
        if detail is None:
            return _json({"error": f"no campaign {campaign_id!r} in the window"}, 404)
        return _json(detail.to_dict())

    async def campaign_page(request: web.Request) -> web.Response:
        campaign_id = request.query.get("id", "")
        try:
            detail = await ops.campaign(campaign_id) if campaign_id else None
            page = render_detail(detail, campaign_id)
            status = 200 if detail is not None else 404
        except NeardupError as exc:
            page = render_error(str(exc), refresh=0)
            status = 503
        return web.Response(text=page, status=status, content_type="text/html", charset="utf-8",
                            headers=PAGE_HEADERS)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/campaigns", campaigns_json)
    app.router.add_get("/campaigns/{id}", campaign_json)
    app.router.add_get("/campaigns.html", campaigns_page)
    app.router.add_get("/campaign.html", campaign_page)
    app.router.add_get("/", campaigns_page)
    return app


async def start_server(ops: Endpoints, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `ops` on host:port (port 0: any free port); returns the runner (`await runner.cleanup()`
    stops it) and the bound port. Raises OSError when the port is taken."""
    runner = web.AppRunner(build_app(ops), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = port
    server = getattr(site, "_server", None)  # aiohttp exposes the bound port only through the server
    if server is not None and server.sockets:
        bound = server.sockets[0].getsockname()[1]
    return runner, int(bound)


# -- the page ----------------------------------------------------------------------------------------


def sparkline(counts: tuple[int, ...]) -> str:
    """Copies per minute as bars scaled to the busiest minute; a minute without copies is a dot."""
    top = max(counts, default=0)
    return "".join(SPARK[(n * (len(SPARK) - 1) + top - 1) // top] if n > 0 else "·" for n in counts)


def ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.1f}d ago"


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


# Message texts are often Chinese, Japanese or Korean: name CJK fonts (Noto CJK, WenQuanYi, Source Han,
# and the usual macOS and Windows ones) after the Latin ones, so that a browser without a CJK default
# still finds glyphs instead of drawing empty boxes.
FONT_STACK = ('system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC","Noto Sans CJK JP",'
              '"Noto Sans CJK KR","Source Han Sans SC","WenQuanYi Zen Hei","WenQuanYi Micro Hei","PingFang SC",'
              '"Hiragino Sans","Microsoft YaHei","Yu Gothic","Malgun Gothic",sans-serif')
MONO_STACK = f'ui-monospace,"DejaVu Sans Mono",monospace,{FONT_STACK.removeprefix("system-ui,")}'

_STYLE = """
body{font:14px/1.4 FONTS;margin:1.5em;color:#1d2330;background:#fafbfc}
h1{font-size:1.3em;margin:0 0 .3em} p.meta{color:#5a6375;margin:0 0 1em}
a{color:#2458c4} a.on{font-weight:bold;text-decoration:none;color:#1d2330}
table{border-collapse:collapse;width:100%;background:#fff;box-shadow:0 1px 2px #0002}
th,td{padding:.35em .6em;border-bottom:1px solid #e3e6eb;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600;white-space:nowrap} td.num{text-align:right;font-variant-numeric:tabular-nums}
td.spark{font-family:MONO;color:#c0392b;white-space:pre;letter-spacing:1px}
td.id{font-family:MONO;white-space:nowrap;max-width:16em;overflow:hidden;text-overflow:ellipsis}
td.text{word-break:break-word} p.empty{color:#5a6375}
ol.samples li{margin:.3em 0;word-break:break-word} dl{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em}
dt{color:#5a6375}
""".replace("MONO", MONO_STACK).replace("FONTS", FONT_STACK)


def render_page(view: CampaignView, *, refresh: int = DEFAULT_REFRESH, limit: int = DEFAULT_LIMIT) -> str:
    """The campaign page. Every text from messages goes through html.escape (quote=True)."""
    e = html.escape
    links = " · ".join(
        f'<a class="on" href="?sort={s}&amp;limit={limit}&amp;refresh={refresh}">{label}</a>' if s == view.sort
        else f'<a href="?sort={s}&amp;limit={limit}&amp;refresh={refresh}">{label}</a>'
        for s, label in (("size", "size"), ("growth", "growth"), ("last", "last seen")))
    rows = []
    for rank, c in enumerate(view.campaigns, 1):
        per_minute = ", ".join(str(n) for n in c.per_minute)
        href = f"campaign.html?{e(urlencode({'id': c.id}))}"
        rows.append(
            f'<tr data-id="{e(c.id)}" data-size="{c.size}" data-recent="{c.recent}" data-growth="{c.growth:.3f}">'
            f'<td class="num">{rank}</td><td class="num size">{c.size}</td><td class="num recent">{c.recent}</td>'
            f'<td class="num growth" title="{c.recent} copies in the last {view.minutes} min, {c.before} in the '
            f'{view.minutes} before">×{c.growth:.1f}</td>'
            f'<td class="spark" title="copies per minute, oldest first: {per_minute}">{sparkline(c.per_minute)}</td>'
            f'<td title="{_utc(c.first_seen)}">{ago(view.now - c.first_seen)}</td>'
            f'<td title="{_utc(c.last_seen)}">{ago(view.now - c.last_seen)}</td>'
            f'<td class="id" title="{e(c.id)}"><a href="{href}">{e(c.id)}</a></td><td class="text">{e(c.text)}</td></tr>')
    refresh_tag = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    table = (
        '<table id="campaigns"><thead><tr><th>#</th><th>size</th>'
        f'<th title="copies in the last {view.minutes} minutes">{view.minutes} min</th>'
        f'<th title="rate of the last {view.minutes} minutes against the {view.minutes} before (smoothed)">growth</th>'
        "<th>per minute</th><th>first seen</th><th>last seen</th>"
        "<th>representative</th><th>text (first copy)</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
        if rows else '<p class="empty">No duplicate clusters in the window yet.</p>')
    shown = f"top {len(view.campaigns)} of {view.total}" if view.total > len(view.campaigns) else f"{view.total}"
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{refresh_tag}<title>neardup · campaigns</title><style>{_STYLE}</style></head><body>"
        "<h1>Duplicate campaigns</h1>"
        f'<p class="meta"><span id="total">{shown}</span> clusters in the {_duration(view.window)} window · '
        f"sorted by {links} · {_utc(view.now)}"
        f"{f' · refreshes every {refresh}s' if refresh else ''}</p>{table}</body></html>")


def render_error(message: str, *, refresh: int = DEFAULT_REFRESH) -> str:
    refresh_tag = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh_tag}'
            f"<title>neardup · campaigns</title><style>{_STYLE}</style></head><body><h1>Duplicate campaigns</h1>"
            f'<p class="meta">The campaign view is unavailable: {html.escape(message)}</p></body></html>')


def render_detail(detail: CampaignDetail | None, campaign_id: str) -> str:
    """One campaign opened: first and last seen, size, growth, its copies per minute, the latest copies."""
    e = html.escape
    head = ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>neardup · campaign {e(campaign_id)}</title><style>{_STYLE}</style></head><body>"
            '<p><a href="campaigns.html">← all campaigns</a></p>')
    if detail is None:
        return (f"{head}<h1>Campaign {e(campaign_id)}</h1>"
                '<p class="empty">No such campaign in the window (it may have expired).</p></body></html>')
    c = detail.campaign
    series = ", ".join(str(n) for n in detail.series)
    samples = "".join(f"<li>{e(t)}</li>" for t in detail.samples)
    return (
        f'{head}<h1>Campaign <span class="id">{e(c.id)}</span></h1>'
        f'<dl id="campaign" data-id="{e(c.id)}" data-size="{c.size}">'
        f"<dt>copies</dt><dd>{c.size}</dd>"
        f'<dt>first seen</dt><dd title="{_utc(c.first_seen)}" id="first">{_utc(c.first_seen)}</dd>'
        f'<dt>last seen</dt><dd title="{_utc(c.last_seen)}" id="last">{_utc(c.last_seen)}</dd>'
        f"<dt>growth</dt><dd>×{c.growth:.1f} ({c.recent} copies in the last {len(c.per_minute)} min, "
        f"{c.before} in the {len(c.per_minute)} before)</dd>"
        f'<dt>per minute</dt><dd class="spark" id="series" title="copies per minute from {_utc(detail.series_start)}, '
        f'oldest first: {series}">{sparkline(detail.series)}</dd>'
        f'<dt>first copy</dt><dd class="text">{e(c.text)}</dd></dl>'
        f"<h2>Latest copies ({len(detail.samples)})</h2>"
        f'<ol class="samples" id="samples">{samples}</ol></body></html>')
