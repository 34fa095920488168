"""The campaign view for a moderator: new waves first, a campaign opened, few Redis keys, `top`'s prefix, Chinese text."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench.kafka_support import redis_namespace
from stream.campaigns import SAMPLES, CampaignDetail, MemoryCampaigns, RedisCampaigns, Sighting, growth_score
from stream.ops_http import FONT_STACK
from tests.test_campaign_page import browse, campaign_keys, chromium
from tests.test_cli import installed_neardup
from tests.test_ops import REPO, Clock, get, serving, sightings, store  # noqa: F401 (store: the fixture)


def test_growth_ranks_a_new_wave_above_an_old_big_campaign_that_size_ranks_first() -> None:
    """`old` runs steadily (5 copies a minute for 20 minutes: 50 in the last 10), `new` starts 2 minutes
    ago (30 copies). By size `old` leads, and also by copies in the last 10 minutes (50 > 30); by growth,
    the rate now against the rate before, `new` does."""
    clock = Clock()
    view = MemoryCampaigns(3600, minutes=10, clock=clock)
    for minute in range(20):
        batch = [Sighting("old", f"old {minute} {i}") for i in range(5)]
        if minute >= 18:
            batch += [Sighting("new", f"new {minute} {i}") for i in range(15)]
        view.record(batch)
        clock.now += 60
    clock.now -= 30  # within the last minute written
    assert [c.id for c in view.top(sort="size").campaigns] == ["old", "new"]
    by_id = {c.id: c for c in view.top().campaigns}
    assert (by_id["old"].recent, by_id["old"].before) == (50, 50)
    assert (by_id["new"].recent, by_id["new"].before) == (30, 0)
    assert by_id["old"].recent > by_id["new"].recent  # the former growth (copies in the window) ranked old first
    assert [c.id for c in view.top(sort="growth").campaigns] == ["new", "old"]
    assert by_id["old"].growth == pytest.approx(1.0) and by_id["new"].growth == pytest.approx(7.0)


def test_growth_score_is_smoothed() -> None:
    assert growth_score(10, 10) == 1.0
    assert growth_score(1, 0) < growth_score(20, 0)  # one copy is no wave
    assert growth_score(0, 30) < 1.0  # dying down


def test_a_campaign_opens_into_bounded_samples_first_last_and_its_series(
        store: MemoryCampaigns | RedisCampaigns) -> None:  # noqa: F811 (the fixture of tests.test_ops)
    store.record([Sighting("rep-1", f"copy {i}  of the wave") for i in range(SAMPLES + 5)])
    store.record(sightings(other=2))
    store.record([Sighting("rep-1", "the last copy")])
    detail = store.detail("rep-1")
    assert isinstance(detail, CampaignDetail)
    c = detail.campaign
    assert c.id == "rep-1" and c.size == SAMPLES + 6 and c.text == "copy 0 of the wave"
    # The latest copies, oldest first, at most SAMPLES of them.
    assert detail.samples == (*[f"copy {i} of the wave" for i in range(6, SAMPLES + 5)], "the last copy")
    assert len(detail.samples) == SAMPLES
    assert c.first_seen <= c.last_seen
    assert len(detail.series) == 2 * store.minutes and sum(detail.series) == c.size
    assert detail.series_start <= c.first_seen
    # The id stays the same while the campaign lives: the view and the detail agree, and so does a later read.
    assert "rep-1" in {x.id for x in store.top().campaigns}
    assert store.detail("rep-1") is not None and store.detail("rep-1").campaign.size == c.size  # type: ignore[union-attr]
    assert store.detail("nobody") is None
    assert CampaignDetail.from_dict(json.loads(json.dumps(detail.to_dict()))) == detail


def test_detail_endpoint_and_page_escape_and_link() -> None:
    mem = MemoryCampaigns(3600, minutes=5)
    hostile = '<script>alert("x")</script> 转发微博 win'
    mem.record([Sighting("a/b <i>", hostile), Sighting("a/b <i>", hostile + " 2")])
    with serving(mem) as base:
        status, body, _ = get(f"{base}/campaigns.html?refresh=0")
        assert status == 200 and 'href="campaign.html?id=a%2Fb+%3Ci%3E"' in body.decode()
        status, body, _ = get(f"{base}/campaigns/a%2Fb%20%3Ci%3E")
        assert status == 200
        detail = CampaignDetail.from_dict(json.loads(body))
        assert detail.campaign.size == 2 and detail.samples == (hostile, hostile + " 2")
        assert get(f"{base}/campaigns/nobody")[0] == 404
        status, body, headers = get(f"{base}/campaign.html?id=a%2Fb+%3Ci%3E")
        page = body.decode()
        assert status == 200 and "default-src 'none'" in headers["Content-Security-Policy"]
        assert "<script" not in page and "<i>" not in page and page.count("&lt;script&gt;") == 3  # first + 2 samples
        assert 'id="samples"' in page and "转发微博" in page
        assert get(f"{base}/campaign.html?id=nobody")[0] == 404


# -- Redis keys ---------------------------------------------------------------------------------------------


@pytest.mark.services
def test_redis_campaign_keys_do_not_grow_with_the_clusters_and_all_expire(redis_url: str) -> None:
    with redis_namespace(redis_url) as url:
        rs = RedisCampaigns(url, namespace="ns", window=600, minutes=10)
        try:
            for batch in range(10):  # 5,000 clusters
                rs.record([Sighting(f"rep-{batch}-{i}", f"text {i}") for i in range(500) for _ in range(2)])
            assert rs.top(5).total == 5000
            keys = campaign_keys(url)
            # size, last, first, text, samples and this minute's counts (a next minute adds one, up to 20).
            assert len(keys) <= 5 + 2, sorted(keys)
            assert all(0 < ttl <= (600 + 3600) * 1000 for ttl in keys.values()), keys
        finally:
            rs.close()


OTHERS = ["The train to Lyon leaves at seven from platform nine.", "我们明天下午三点在图书馆门口见面吧。",
          "Quarterly revenue rose eight percent on strong cloud demand.", "Remember to water the basil twice a week.",
          "这部电影的结局让人意想不到，强烈推荐。", "The museum reopens after a two year renovation of its roof.",
          "Can you send me the slides from this morning's meeting?", "Heavy snow is expected in the mountains tonight.",
          "新款手机的电池续航比上一代提升了百分之二十。", "The library extends its opening hours during exam season."]


def test_a_campaign_keeps_its_id_while_it_lives_and_goes_after_the_window() -> None:
    """A wave over 50 minutes, copies edited differently, among other messages, in batches: every copy names
    the same original (duplicates are not indexed, so none names another copy), so the campaign view shows
    one campaign under that id the whole time, its first copy's text and first seen fixed, its size growing;
    a window after its last copy it is gone, and a copy arriving later starts a campaign of its own."""
    from filters.config import FilterConfig
    from filters.engine import Message, NearDupFilter
    from tests.test_ops import Clock

    base = "Congratulations! You have won a 1000 dollar gift card, reply YES to claim it before Friday"
    edits = [base.upper(), base.replace("1000", "5000"), "URGENT " + base, base + " !!!", base.replace(" ", "  "),
             base.replace("Friday", "Monday"), "c o n g r a t u l a t i o n s " + base[16:], base.replace("o", "0")]
    clock = Clock(1_800_000_000.0)
    nd = NearDupFilter(FilterConfig(window=3600))
    view = MemoryCampaigns(3600, minutes=10, clock=clock)
    first_seen = None
    seen = 0
    for minute in range(0, 50, 5):
        batch = [Message(f"other-{minute}", OTHERS[minute // 5], clock.now)]
        if minute == 0:
            batch.insert(0, Message("orig", base, clock.now))
        batch += [Message(f"copy-{minute}-{i}", edits[(minute // 5 + i) % len(edits)], clock.now) for i in range(2)]
        verdicts = nd.check_batch(batch)
        reps = {v.duplicate_of for m, v in zip(batch, verdicts) if m.id.startswith("copy")}
        assert reps == {"orig"}, [(m.id, v) for m, v in zip(batch, verdicts)]
        view.record([Sighting(v.duplicate_of, m.text) for m, v in zip(batch, verdicts) if v.duplicate_of])
        seen += 2
        (campaign,) = view.top().campaigns
        assert (campaign.id, campaign.size, campaign.text) == ("orig", seen, edits[0])
        first_seen = campaign.first_seen if first_seen is None else first_seen
        assert campaign.first_seen == first_seen
        clock.now += 300
    clock.now += 3600
    assert view.top().campaigns == () and view.detail("orig") is None
    late = Message("copy-late", base, clock.now)
    (verdict,) = nd.check_batch([late])
    assert verdict.duplicate_of is None  # the original left the window: this copy is the new original


# -- `neardup top` with a wrong prefix ----------------------------------------------------------------------


def top_once(index: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEARDUP_")}
    env.update(PYTHONPATH=str(REPO))
    return subprocess.run([installed_neardup(), "top", "--once", "--index", index],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.services
def test_top_with_an_unknown_prefix_says_so_and_lists_the_prefixes_found(redis_url: str) -> None:
    with redis_namespace(redis_url) as url:
        prefix = url.partition("prefix=")[2]
        rs = RedisCampaigns(url, namespace="somens", window=600)
        try:
            rs.record(sightings(a=2))
            wrong = top_once(url.replace(f"prefix={prefix}", "prefix=nosuchprefix"))
            assert wrong.returncode == 1 and wrong.stdout == ""
            assert len(wrong.stderr.splitlines()) == 1, wrong.stderr
            assert "unknown prefix 'nosuchprefix'" in wrong.stderr and f"{prefix}:somens" in wrong.stderr
            # The right prefix with other filter settings (another namespace): named as such.
            other = top_once(url)
            assert other.returncode == 1 and len(other.stderr.splitlines()) == 1
            assert "filter settings" in other.stderr and f"{prefix}:somens" in other.stderr
        finally:
            rs.close()


# -- Chinese in the browser ------------------------------------------------------------------------------


def cjk_font_installed() -> bool:
    try:
        out = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True, timeout=30).stdout
    except FileNotFoundError:
        return False
    return bool(out.strip())


@pytest.fixture
def cjk_store() -> Iterator[MemoryCampaigns]:
    mem = MemoryCampaigns(3600, minutes=5)
    text = "曾庆红说，实现这样一个基本思路和总体要求，在思想上必须明确"
    mem.record([Sighting("pd-07092", text), Sighting("pd-07092", text + "。")])
    yield mem


def test_chinese_renders_with_a_cjk_font_not_boxes(cjk_store: MemoryCampaigns, tmp_path: Path) -> None:
    """The page names CJK fonts, and chromium draws the Chinese text with one: the printed PDF embeds a
    CJK font (a missing glyph would be drawn from the Latin font as an empty box)."""
    browser = chromium()
    if not cjk_font_installed():
        message = "no CJK font installed (apt-get install -y fonts-wqy-zenhei)"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    assert all(name in FONT_STACK for name in ('"Noto Sans CJK SC"', '"WenQuanYi Zen Hei"', '"Microsoft YaHei"'))
    with serving(cjk_store) as base:
        status, body, _ = get(f"{base}/campaigns.html?refresh=0")
        assert status == 200 and "Noto Sans CJK SC" in body.decode() and "曾庆红说" in body.decode()
        fonts = {}
        for name, url in (("list", f"{base}/campaigns.html?refresh=0"), ("detail", f"{base}/campaign.html?id=pd-07092")):
            pdf = tmp_path / f"{name}.pdf"
            asyncio.run(browse(browser, url, tmp_path / "profile", f"--print-to-pdf={pdf}", "--no-pdf-header-footer"))
            fonts[name] = {line.split(b"+", 1)[-1].decode(errors="replace")
                           for line in pdf.read_bytes().split(b"/BaseFont /")[1:]
                           for line in [line.split(b"\n", 1)[0].split(b"/", 1)[0].strip()]}
    cjk = ("WenQuanYi", "NotoSansCJK", "NotoSerifCJK", "SourceHan", "Droid", "AR PL", "UMing", "UKai")
    for name, used in fonts.items():
        assert any(any(c.lower() in f.lower() for c in cjk) for f in used), (name, used)


@pytest.mark.services
def test_redis_growth_reads_the_minutes_before_the_recent_ones(redis_url: str) -> None:
    """The Redis view's clock is the server's: the earlier minutes of `old` are written as a worker
    would have written them 15 minutes ago, then both rank as in the memory test."""
    with redis_namespace(redis_url) as url:
        rs = RedisCampaigns(url, namespace="ns", window=3600, minutes=10)
        client = redis.Redis.from_url(url.partition("?")[0])
        try:
            rs.record([Sighting("old", f"old {i}") for i in range(5)] + [Sighting("new", f"new {i}") for i in range(30)])
            now_minute = int(client.time()[0]) // 60
            earlier = rs.size_key.replace(":c:size", f":c:m:{now_minute - 15}")
            client.zincrby(earlier, 60, "old")
            client.pexpire(earlier, 60_000)
            client.zincrby(rs.size_key, 60, "old")
            by_id = {c.id: c for c in rs.top().campaigns}
            assert (by_id["old"].size, by_id["old"].recent, by_id["old"].before) == (65, 5, 60)
            assert (by_id["new"].size, by_id["new"].recent, by_id["new"].before) == (30, 30, 0)
            assert [c.id for c in rs.top(sort="size").campaigns] == ["old", "new"]
            assert [c.id for c in rs.top(sort="growth").campaigns] == ["new", "old"]
            detail = rs.detail("old")
            assert detail is not None and sum(detail.series) == 65
            assert detail.series[now_minute - 15 - int(detail.series_start) // 60] == 60
        finally:
            client.close()
            rs.close()
