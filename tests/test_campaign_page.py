"""The campaign page in a real headless browser (Debian's chromium) after a run through Kafka and Redis."""

from __future__ import annotations

import asyncio
import html
import os
import re
import shutil
import struct
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import redis

from bench.kafka_support import free_port, outputs, produce, redis_namespace, settings_for
from stream.campaigns import GROWTH_SMOOTHING
from stream.kafka_tools import KafkaRecord
from tests.test_ops import CAMPAIGNS, COPIES, campaign_lines, duplicates_per_representative, running, until

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

# Where the screenshot goes when set (to look at it); a temporary directory otherwise.
SCREENSHOT_DIR = os.environ.get("NEARDUP_TEST_SCREENSHOT_DIR")


def chromium() -> str:
    """Debian's chromium; in CI (CI=true) a missing browser fails the test instead of skipping it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None and Path("/usr/bin/chromium").exists():
        path = "/usr/bin/chromium"
    if path is None:
        message = "chromium is not installed (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


async def browse(browser: str, url: str, profile: Path, *args: str) -> tuple[bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--hide-scrollbars", f"--user-data-dir={profile}", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out, err


class Table(HTMLParser):
    """The rows of the rendered DOM's campaign table, and every element the DOM holds."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.cells: list[list[str]] = []
        self.spark_titles: list[str] = []
        self.headings: list[str] = []
        self.tags: list[str] = []
        self.meta_refresh: str | None = None
        self._cell: list[str] | None = None
        self._heading: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "data-size" in a:
            self.rows.append(a)
            self.cells.append([])
        elif tag == "td" and self.rows:
            self._cell = []
            if a.get("class") == "spark":
                self.spark_titles.append(a.get("title", ""))
        elif tag == "th":
            self._heading = []
        elif tag == "meta" and a.get("http-equiv") == "refresh":
            self.meta_refresh = a.get("content")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.cells[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "th" and self._heading is not None:
            self.headings.append("".join(self._heading))
            self._heading = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        elif self._heading is not None:
            self._heading.append(data)


def campaign_keys(url: str) -> dict[str, int]:
    """Every key of the campaign views under the URL's prefix, with its TTL in ms (-1: none)."""
    prefix = url.partition("prefix=")[2]
    client = redis.Redis.from_url(url.partition("?")[0])
    try:
        return {k.decode(): client.pttl(k) for k in client.scan_iter(match=f"{{{prefix}:*}}:c:*", count=1000)}
    finally:
        client.close()


@pytest.fixture
def index_url(redis_url: str) -> Iterator[str]:
    with redis_namespace(redis_url) as url:
        yield url


def test_campaign_page_in_headless_chromium(kafka_bootstrap: str, index_url: str, tmp_path: Path) -> None:
    browser = chromium()
    settings = settings_for(kafka_bootstrap, index_url, id_field="id", ts_field="ts", metrics_port=free_port())
    lines = campaign_lines()
    shots = Path(SCREENSHOT_DIR) if SCREENSHOT_DIR else tmp_path
    shot = shots / "campaigns.png"
    shot.unlink(missing_ok=True)

    async def scenario() -> tuple[bytes, bytes, list[KafkaRecord]]:
        await produce(settings, settings.input_topics[0], [(None, line, ()) for line in lines])
        async with running(settings) as (worker, _, base):
            await until(lambda: worker.stats.seen >= len(lines), 30, "routed")
            got = await outputs(settings, len(lines))
            dom, _ = await browse(browser, f"{base}/?refresh=30", tmp_path / "profile", "--dump-dom")
            await browse(browser, f"{base}/campaigns.html?refresh=0", tmp_path / "profile",
                         f"--screenshot={shot}", "--window-size=1280,420")
            link = re.search(r'href="(campaign\.html\?id=spam-b-0)"', dom.decode())
            assert link, "no link from the table to a campaign"
            detail, _ = await browse(browser, f"{base}/{html.unescape(link.group(1))}", tmp_path / "profile",
                                     "--dump-dom")
        return dom, detail, got

    dom, detail, got = asyncio.run(scenario())
    table = Table()
    table.feed(dom.decode())
    sizes = {row["data-id"]: int(row["data-size"]) for row in table.rows}
    # The table holds one row per representative with the number of its duplicates, largest first.
    assert sizes == dict(duplicates_per_representative(got)) == {f"{k}-0": n for k, n in COPIES.items()}
    assert [int(row["data-size"]) for row in table.rows] == sorted(COPIES.values(), reverse=True)
    assert table.meta_refresh == "30"
    # Hostile texts are shown as text: no element came from them (no script, no img), the markup reads as typed.
    assert "script" not in table.tags and "img" not in table.tags
    texts = {row["data-id"]: cells[-1] for row, cells in zip(table.rows, table.cells)}
    assert texts["spam-b-0"].startswith('<script>alert("pwned")</script> Cheap meds online')
    assert texts["spam-c-0"].startswith("<img src=x onerror=alert(1)> Work from home & earn")
    assert texts["spam-a-0"] == CAMPAIGNS["spam-a"]  # the first copy, its doubled spaces collapsed
    assert [cells[1] for cells in table.cells] == [str(n) for n in sorted(COPIES.values(), reverse=True)]
    # Copies in the last 10 minutes (all of them, the run took seconds), growth against the 10 minutes
    # before (none: a new wave), and a sparkline of the copies per minute, oldest first, whose busiest
    # minute is a full bar; its title lists the counts.
    assert table.headings[2:5] == ["10 min", "growth", "per minute"]
    for row, cells, title in zip(table.rows, table.cells, table.spark_titles, strict=True):
        size = int(row["data-size"])
        assert cells[2] == row["data-recent"] == str(size)
        assert float(row["data-growth"]) == pytest.approx((size + GROWTH_SMOOTHING) / GROWTH_SMOOTHING, abs=1e-3)
        per_minute = [int(n) for n in title.removeprefix("copies per minute, oldest first: ").split(", ")]
        assert len(per_minute) == 10 and sum(per_minute) == size
        assert len(cells[4]) == 10 and set(cells[4]) <= set("·▁▂▃▄▅▆▇█") and "█" in cells[4]
        assert [ch == "·" for ch in cells[4]] == [n == 0 for n in per_minute]
    # The campaign opened from its link: its latest copies, escaped, and its count.
    opened = detail.decode()
    assert 'data-id="spam-b-0"' in opened and f'data-size="{COPIES["spam-b"]}"' in opened
    assert opened.count("&lt;script&gt;") >= COPIES["spam-b"] and "<script" not in opened
    # Redis holds a handful of campaign keys, each expiring.
    keys = campaign_keys(index_url)
    assert 0 < len(keys) <= 5 + 2 and all(ttl > 0 for ttl in keys.values()), keys

    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 420)
    assert len(data) > 10_000  # a rendered page, not a blank one
