"""The spread layout of the Redis index on real Redis and Redis Clusters: keys and URLs, its scripts held to
the protocol's model, what a record gets when a worker dies mid-claim, and races of workers on 3 and 6
masters (the contract suite runs on it too: tests/test_index_contract.py)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import struct
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis

from filters.config import FilterConfig
from filters.engine import Message, NearDupFilter
from filters.errors import ConfigError, IndexLost, IndexUnavailable
from filters.index import Candidate, Entry, Memo, Query, Stored
from filters.index import claims as cl
from filters.index.backends import open_index
from filters.index.redis_codec import encode_entry, field_of, parse_records
from filters.index.redis_spread import _CLAIM, SLOTS, SpreadIndex, _Transaction, _View, key_slot, shard_tags
from filters.records import Verdict
from stream.changelog import IndexGuard, Journal
from stream.codec import RecordFormat
from stream.runner import RawRecord, route_batch
from stream.testing import ListChangelog
from tests.test_claim_model import Shard
from tests.test_index_contract import drop_namespace, with_query
from tests.test_redis_index import SAMPLE, PausedLookup, _spam, cluster_url, drop_cluster_namespace, race

WINDOW = 3600.0


def spread_url(base: str, prefix: str, **options: str) -> str:
    return with_query(base, prefix=prefix, layout="spread", **options)


@pytest.fixture
def make(redis_url: str, prefix: str) -> Iterator[Callable[..., SpreadIndex]]:
    """Spread indexes on one Redis, under the test's prefix."""
    made: list[SpreadIndex] = []

    def make(namespace: str = "ns", window: float = WINDOW, bucket_cap: int = 8, cls: type[SpreadIndex] = SpreadIndex,
             **options: str) -> SpreadIndex:
        index = cls(spread_url(redis_url, prefix, **options), window=window, bucket_cap=bucket_cap, namespace=namespace)
        made.append(index)
        return index

    yield make
    for index in made:
        index.close()


# --- keys and URLs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3, 64, 256])
def test_shard_tags_cut_the_slots_evenly(shards: int) -> None:
    """Shard k's slot is the middle of the k-th of `shards` equal parts: masters holding equal ranges of slots
    (what `redis-cli --cluster create` gives 3 or 6 masters) hold as many shards, to one."""
    tags = shard_tags("neardup", "ns", shards)
    slots = [key_slot(tag.encode()) for tag in tags]
    assert slots == [(2 * k + 1) * SLOTS // (2 * shards) for k in range(shards)]
    for masters in (3, 6):
        held = [sum(m * SLOTS // masters <= slot < (m + 1) * SLOTS // masters for slot in slots) for m in range(masters)]
        assert max(held) - min(held) <= 1, held
    assert len(set(tags)) == shards and tags == shard_tags("neardup", "ns", shards)  # deterministic


@pytest.mark.parametrize("url", ["redis://h/0?layout=bogus", "redis://h/0?shards=4", "redis://h/0?claim_ttl=2",
                                 "redis://h/0?layout=spread&shards=0", "redis://h/0?layout=spread&shards=2000",
                                 "redis://h/0?layout=spread&shards=x", "redis://h/0?layout=spread&claim_ttl=0",
                                 "redis://h/0?layout=spread&claim_ttl=nan"])
def test_bad_spread_options_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        open_index(url, window=60, bucket_cap=4, namespace="n")


def test_the_url_chooses_the_layout(redis_url: str, prefix: str) -> None:
    index = open_index(spread_url(redis_url, prefix, shards="8", claim_ttl="2.5"), window=60, bucket_cap=4,
                       namespace="n")
    try:
        assert isinstance(index, SpreadIndex) and (index.shards, index.claim_ttl) == (8, 2.5)
    finally:
        index.close()
    slot = open_index(with_query(redis_url, prefix=prefix), window=60, bucket_cap=4, namespace="n")
    try:
        assert not isinstance(slot, SpreadIndex)
    finally:
        slot.close()


def test_keys_spread_over_the_shards_carry_prefix_and_namespace_and_all_have_ttls(
        make: Callable[..., SpreadIndex], redis_url: str, prefix: str) -> None:
    config = FilterConfig()
    engine = NearDupFilter(config, index=make(shards="16"))
    verdicts = engine.check_batch([engine.message(line.decode(), str(i), 1000.0 + i)
                                   for i, line in enumerate(SAMPLE.read_bytes().splitlines()[:200])])
    assert sum(v.duplicate for v in verdicts) > 5
    with redis.Redis.from_url(redis_url) as client:
        keys = [k.decode() for k in client.scan_iter(match=f"{{{prefix}:*", count=1000)]
        assert keys and all(client.pttl(k) > 0 for k in keys)
    tags = {k[1 : k.index("}")] for k in keys}
    assert tags <= set(shard_tags(prefix, "ns", 16)) and len(tags) == 16
    assert not [k for k in keys if ":c" in k]  # no claim state left: every claim was decided


# --- the scripts are the model's nodes ------------------------------------------------------------------


def _blob(id: str, ts: float) -> bytes:
    return encode_entry(Entry(id, ts, 7, 3, np.arange(4, dtype=np.uint32)))


def _records(value: bytes | None) -> list[tuple[float, str]]:
    return [(ts, id) for ts, _, id in parse_records(value or b"")]


def _by_field(columns: list[list[bytes | None]]) -> list[list[tuple[float, str]]]:
    return [[r for column in columns for r in _records(column[j])] for j in range(len(columns[0]))]


def _same(op: cl.Op, real: Any, model: Any) -> bool:
    if isinstance(op, cl.Claim):
        return bool(real == model)
    if isinstance(op, cl.Read):  # per field, its records over the slices read
        return _by_field(real) == _by_field(model)
    assert isinstance(real, cl.Home) and isinstance(model, cl.Home)
    return real.state == model.state and real.notes == model.notes and (real.blob is None or real.blob == model.blob)


@pytest.mark.parametrize("seed", range(6))
def test_the_scripts_do_what_the_model_of_the_protocol_does(make: Callable[..., SpreadIndex], redis_url: str,
                                                           seed: int) -> None:
    """Random sequences of every op of the protocol, on one shard of real Redis (spread_home.lua,
    spread_claim.lua, reads) and on the model's `Shard` (tests/test_claim_model.py): the same replies,
    and the same records in every bucket. A claim compares with what a lookup of its fields saw at some
    earlier step (the slices' marks, and the fields of a slice whose mark moved or was not read), or with
    nothing."""
    rng = random.Random(seed)
    index = make(shards="1", claim_ttl="3600")
    ts = 5.0
    index._hwm = ts
    model = Shard()
    looks: dict[str, tuple[tuple[bytes, ...], list[list[bytes | None]], dict[bytes, bytes | None],
                           dict[tuple[int, int], int]]] = {}
    ids = ["a", "b", "c", "d"]
    fields = [b"b" + k.to_bytes(8, "big") for k in range(5)]
    looked = index._slices(ts, ts + index.window)  # what a lookup reads: up to the slice after its high-water mark's
    for _ in range(120):
        id = rng.choice(ids)
        kind = rng.choice(["create", "look", "claim", "claim", "read", "state", "note", "commit", "poll", "refresh",
                           "abort"])
        op: cl.Op
        if kind == "create":
            op = cl.Create(0, id, ts, _blob(id, ts))
        elif kind == "look":  # what a lookup of `id` sees of its fields now, on each side (the slices' marks first)
            chosen = tuple(rng.sample(fields, rng.randint(1, 3)))
            with redis.Redis.from_url(redis_url) as client:
                marks = {(0, s): int(client.hget(index._slice_key(0, s), "w") or 0) for s in looked
                         if rng.random() < 0.8}  # a mark not read: every field is compared
            [columns] = index._ops([cl.Read(0, chosen)])
            looks[id] = (chosen, columns, {f: model.buckets.get(f) for f in chosen}, marks)
            continue
        elif kind == "claim":
            look = looks.get(id) if rng.random() < 0.8 else None
            if look is None:
                chosen = tuple(rng.sample(fields, rng.randint(1, 3)))
                index._view, seen = _View(), None
            else:
                chosen, columns, seen, marks = look
                index._view = _View(looked, columns, {f: j for j, f in enumerate(chosen)}, looked={id: 0},
                                    slice_marks=marks)
            op = cl.Claim(0, id, ts, chosen, look is not None)
            [real] = index._ops([op])
            assert real == model.apply(op, 0.0, 3_600_000.0, seen), (op, look)
            continue
        elif kind == "read":
            op = cl.Read(0, tuple(rng.sample(fields, 3)))
        elif kind == "state":
            op = cl.State(0, id, ts)
        elif kind == "note":
            op = cl.Note(0, id, ts, (ts, rng.choice(ids)))
        elif kind == "commit":
            op = cl.Commit(0, id, ts, rng.randint(0, 2))
        else:
            op = {"poll": cl.Poll, "refresh": cl.Refresh, "abort": cl.Abort}[kind](0, id, ts)
        [real] = index._ops([op])
        expected = model.apply(op, 0.0, 3_600_000.0)
        assert _same(op, real, expected), (op, real, expected)
    [values] = index._ops([cl.Read(0, tuple(fields))])
    assert _by_field(values) == [_records(model.buckets.get(f)) for f in fields]


@pytest.mark.parametrize("seed", range(4))
def test_a_round_of_ops_for_several_ids_in_one_call_does_what_the_model_does(make: Callable[..., SpreadIndex],
                                                                            seed: int) -> None:
    """A round's home ops of distinct ids go to a shard in one call of spread_home.lua (the creates, and the
    commits, of a round take its short way; other mixes the general one): each op's reply is the model's."""
    rng = random.Random(seed)
    index = make(shards="1", claim_ttl="3600")
    ts = 5.0
    index._hwm = ts
    model = Shard()
    ids = [f"m{i}" for i in range(8)]
    for _ in range(40):
        chosen = rng.sample(ids, rng.randint(1, 6))
        kinds = [rng.choice(["create", "commit"])] * len(chosen) if rng.random() < 0.6 else \
            [rng.choice(["create", "commit", "note", "poll", "refresh", "abort", "state"]) for _ in chosen]
        ops: list[cl.Op] = []
        for id, kind in zip(chosen, kinds):
            if kind == "create":
                ops.append(cl.Create(0, id, ts, _blob(id, ts)))
            elif kind == "commit":
                ops.append(cl.Commit(0, id, ts, rng.randint(0, 1)))
            elif kind == "note":
                ops.append(cl.Note(0, id, ts, (ts, rng.choice(ids))))
            elif kind == "state":
                ops.append(cl.State(0, id, ts))
            else:
                ops.append({"poll": cl.Poll, "refresh": cl.Refresh, "abort": cl.Abort}[kind](0, id, ts))
        real = index._ops(ops)
        for op, got in zip(ops, real, strict=True):
            expected = model.apply(op, 0.0, 3_600_000.0)
            assert _same(op, got, expected), (op, got, expected)


def test_a_commit_reads_the_state_alone_which_names_its_claim_by_event_time(make: Callable[..., SpreadIndex],
                                                                         redis_url: str) -> None:
    """The state of a pending claim carries its entry's event time: a commit of another claim of the id (another
    event time, in the same slice) finds it gone and leaves the pending one as it is; a state of the older
    format ('P' <deadline> <notes>, without the event time) is read as the same with its entry's."""
    index = make(shards="1", claim_ttl="3600")
    index._hwm = 6.0
    [created] = index._ops([cl.Create(0, "a", 5.0, _blob("a", 5.0))])
    assert created.state == cl.PENDING
    assert index._ops([cl.Commit(0, "a", 6.0, 0)])[0].state == cl.GONE
    assert index._ops([cl.State(0, "a", 5.0)])[0].state == cl.PENDING
    assert index._ops([cl.Commit(0, "a", 5.0, 0)])[0].state == cl.COMMITTED
    assert index._ops([cl.Commit(0, "a", 5.0, 0)])[0].state == cl.COMMITTED  # committed: its entry is read
    key = index._slice_key(0, index._slice(5.0))
    note = struct.pack("<dI", 4.0, 1) + b"z"
    with redis.Redis.from_url(redis_url) as client:
        for id, deadline in (("b", 1e15), ("c", 0.0)):
            client.hset(key, mapping={f"e{id}": _blob(id, 5.0), f"c{id}": b"P" + struct.pack(">d", deadline) + note})
    [state] = index._ops([cl.State(0, "b", 5.0)])
    assert state.state == cl.PENDING and state.notes == ((4.0, "z"),)
    [committed] = index._ops([cl.Commit(0, "b", 5.0, 0)])
    assert committed.state == cl.PENDING and committed.notes == ((4.0, "z"),)  # a note it has not seen
    [refreshed] = index._ops([cl.Refresh(0, "b", 5.0)])
    assert refreshed.state == cl.PENDING and refreshed.notes == ((4.0, "z"),)
    assert index._ops([cl.Commit(0, "b", 5.0, 1)])[0].state == cl.COMMITTED
    assert index._ops([cl.Poll(0, "c", 5.0)])[0].state == cl.GONE  # its deadline passed


def test_an_inserts_memos_go_with_the_home_calls(make: Callable[..., SpreadIndex]) -> None:
    """An insert's memos are written by spread_home.lua, in the calls of its first round trip (or in calls of
    their own, one a shard): a replay of the duplicate finds its verdict; no other command writes them."""
    index = make(shards="4")
    sent: list[Any] = []
    execute = index._nodes.execute

    def spy(commands: Sequence[tuple[int, Sequence[Any]]], scripts: dict[bytes, str], resent: set[int] | None = None
            ) -> list[Any]:
        sent.extend("MULTI" if isinstance(c, _Transaction) else c[0] for _, c in commands)  # the records' HSETs
        return execute(commands, scripts, resent)

    index._nodes.execute = spy  # type: ignore[method-assign]
    entry = Entry("u", 5.0, 7, 3, np.arange(4, dtype=np.uint32))
    index.lookup([Query("u", 5.0, (1, 2)), Query("d1", 5.0, (1, 2)), Query("d2", 5.0, (3,))], 8)
    memos = [(Verdict("d1", True, "u", 0.9, "sketch"), 5.0), (Verdict("d2", True, "u", 0.8, "sketch"), 5.0)]
    sent.clear()
    assert index.insert([(entry, (1, 2))], memos) == [None]
    assert "HSET" not in sent and "HINCRBY" not in sent
    sent.clear()
    index.insert([], [(Verdict("d3", True, "u", 0.7, "sketch"), 5.0)])
    assert sent == ["EVALSHA"]
    looked = index.lookup([Query(id, 5.0, (9,)) for id in ("d1", "d2", "d3")], 8)
    assert [(v.id, v.duplicate_of) for v, _ in looked] == [("d1", "u"), ("d2", "u"), ("d3", "u")]  # type: ignore[union-attr]
    assert index.stats()["memos"] == 3


def test_claims_are_written_at_once_unless_another_writer_wrote_there_since_the_lookup(
        make: Callable[..., SpreadIndex]) -> None:
    """A claim whose lookup's slices still have the marks it read is written by spread_append.lua (the values
    made by the client); after another writer's records in its shard, by spread_claim.lua, which finds it
    unchanged if none of its own buckets got a record, else changed: the other claim is returned."""
    a, b = make(shards="1"), make(shards="1")
    sent: list[str] = []
    execute = a._nodes.execute

    def spy(commands: Sequence[tuple[int, Sequence[Any]]], scripts: dict[bytes, str], resent: set[int] | None = None
            ) -> list[Any]:
        sent.extend("append" if isinstance(c, _Transaction) else "claim" if c[:2] == ("EVALSHA", _CLAIM.sha) else ""
                    for _, c in commands)
        return execute(commands, scripts, resent)

    a._nodes.execute = spy  # type: ignore[method-assign]

    def entry(id: str, ts: float) -> Entry:
        return Entry(id, ts, 7, 3, np.arange(4, dtype=np.uint32))

    a.lookup([Query("x", 5.0, (1, 2, 3))], 8)
    assert a.insert([(entry("x", 5.0), (1, 2, 3))]) == [None]
    assert "append" in sent and "claim" not in sent
    sent.clear()
    a.lookup([Query("y", 6.0, (4, 5, 6))], 8)
    b.lookup([Query("z", 6.0, (7, 8))], 8)
    assert b.insert([(entry("z", 6.0), (7, 8))]) == [None]
    assert a.insert([(entry("y", 6.0), (4, 5, 6))]) == [None]  # z wrote in the shard, not in y's buckets
    assert [s for s in sent if s] == ["append", "claim"]
    a.lookup([Query("v", 7.0, (10, 11, 12))], 8)
    b.lookup([Query("w", 7.0, (11, 13))], 8)
    assert b.insert([(entry("w", 7.0), (11, 13))]) == [None]
    [taken] = a.insert([(entry("v", 7.0), (10, 11, 12))])
    assert taken is not None and [c.entry.id for c in taken] == ["w"]
    [columns] = a._ops([cl.Read(0, (field_of(11),))])
    assert sorted(id for column in columns for _, _, id in parse_records(column[0] or b"")) == ["v", "w"]


def test_an_append_whose_gate_does_not_let_it_write_leaves_the_slice_as_it_was(make: Callable[..., SpreadIndex],
                                                                             redis_url: str) -> None:
    """spread_append.lua's transaction blocks the slices it writes to before its gate runs: when the gate finds a
    mark moved, or is missing from the node's script cache, the HSETs write nothing and each slice is put back as
    it was (its fields, its TTL; no holding key, no string left), and the claims go to spread_claim.lua; a gate
    that finds every mark lets them write (and then is in the cache)."""
    a, b = make(shards="1"), make(shards="1")
    key = a._slice_key(0, a._slice(5.0))
    gates: list[tuple[Any, bool]] = []  # per transaction: its gate's reply, the slice unchanged by it
    execute = a._nodes.execute

    def spy(commands: Sequence[tuple[int, Sequence[Any] | _Transaction]], scripts: dict[bytes, str],
            resent: set[int] | None = None) -> list[Any]:
        if not any(isinstance(c, _Transaction) for _, c in commands):
            return execute(commands, scripts, resent)
        with redis.Redis.from_url(redis_url) as client:
            before = client.hgetall(key)
            replies = execute(commands, scripts, resent)
            after = client.hgetall(key)
            assert client.type(key) == b"hash" and client.pttl(key) > 0
            assert not list(client.scan_iter(match=f"{{{a.tags[0]}}}:held:*"))
        [reply] = [r for (_, c), r in zip(commands, replies, strict=True) if isinstance(c, _Transaction)]
        gates.append((reply[2], before == after))
        return replies

    a._nodes.execute = spy  # type: ignore[method-assign]

    def entry(id: str, ts: float) -> Entry:
        return Entry(id, ts, 7, 3, np.arange(4, dtype=np.uint32))

    a.lookup([Query("x", 5.0, (1, 2, 3))], 8)
    assert a.insert([(entry("x", 5.0), (1, 2, 3))]) == [None]
    assert gates == [(1, False)]  # written
    a.lookup([Query("y", 5.0, (4, 5))], 8)
    b.lookup([Query("z", 5.0, (6,))], 8)
    assert b.insert([(entry("z", 5.0), (6,))]) == [None]
    assert a.insert([(entry("y", 5.0), (4, 5))]) == [None]
    assert gates[1] == (0, True)  # a mark moved: nothing written by the transaction
    with redis.Redis.from_url(redis_url) as client:
        client.script_flush()
    a.lookup([Query("v", 5.0, (7, 8))], 8)
    assert a.insert([(entry("v", 5.0), (7, 8))]) == [None]
    assert isinstance(gates[2][0], redis.exceptions.NoScriptError) and gates[2][1]
    a.lookup([Query("w", 5.0, (9,))], 8)
    assert a.insert([(entry("w", 5.0), (9,))]) == [None]
    assert gates[3] == (1, False)
    [columns] = a._ops([cl.Read(0, tuple(field_of(k) for k in range(1, 10)))])
    assert [sorted(id for column in columns for _, _, id in parse_records(column[j] or b"")) for j in range(9)] == \
        [["x"]] * 3 + [["y"]] * 2 + [["z"]] + [["v"]] * 2 + [["w"]]


def test_a_pending_claim_past_its_deadline_is_aborted_by_a_poll(make: Callable[..., SpreadIndex]) -> None:
    index = make(shards="1", claim_ttl="0.2")
    index._hwm = 5.0
    [created] = index._ops([cl.Create(0, "a", 5.0, _blob("a", 5.0))])
    [polled] = index._ops([cl.Poll(0, "a", 5.0)])
    assert created.state == polled.state == cl.PENDING
    time.sleep(0.25)
    [polled] = index._ops([cl.Poll(0, "a", 5.0)])
    [state] = index._ops([cl.State(0, "a", 5.0)])
    assert polled.state == state.state == cl.GONE


# --- the engine on the spread layout -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["redis", "cluster"])
def test_route_batch_decides_like_the_memory_index(request: pytest.FixtureRequest, where: str) -> None:
    """The shipped sample, with bad records among good ones, batch after batch and one record at a time."""
    base = request.getfixturevalue("redis_url") if where == "redis" else cluster_url(
        request.getfixturevalue("redis_cluster_url"))
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    lines = SAMPLE.read_bytes().splitlines()
    batch = [RawRecord(line, str(i), float(i)) for i, line in enumerate(lines)]
    config = FilterConfig()
    expected = [(r.kind, r.verdict) for r in route_batch(NearDupFilter(config), batch, RecordFormat())]
    indexes = [open_index(spread_url(base, prefix), window=config.window, bucket_cap=config.bucket_cap,
                          namespace=namespace) for namespace in ("batch", "single")]
    try:
        together = [(r.kind, r.verdict) for r in route_batch(NearDupFilter(config, index=indexes[0]), batch,
                                                             RecordFormat())]
        one_by_one = NearDupFilter(config, index=indexes[1])
        alone = [(r.kind, r.verdict) for raw in batch for r in route_batch(one_by_one, [raw], RecordFormat())]
    finally:
        for index in indexes:
            index.close()
        (drop_namespace if where == "redis" else drop_cluster_namespace)(base, prefix)
    assert together == expected and alone == expected


# --- a worker that dies mid-claim ------------------------------------------------------------------------------


class _Died(Exception):
    pass


class _DiesAfterItsRecords(SpreadIndex):
    """A worker killed after its claims' records are written, before it commits (kill -9 mid-claim)."""

    def _round(self, round_: cl.Round) -> list[Any]:
        replies = super()._round(round_)
        if any(isinstance(op, cl.Claim) for op in round_.ops):
            raise _Died()
        return replies


def _text(copy: int) -> str:
    return _spam(7, copy)


def _check(index: SpreadIndex, copy: int, id: str, ts: float) -> Any:
    return NearDupFilter(FilterConfig(), index=index).check(_text(copy), id=id, ts=ts)


def _pending(redis_url: str, prefix: str) -> list[bytes]:
    with redis.Redis.from_url(redis_url) as client:
        return [f for key in set(client.scan_iter(match=f"{{{prefix}:*:s:*")) for f in client.hkeys(key)
                if f.startswith(b"c")]


_EDGE = 86_400.0 * 19_676  # a slice boundary of the default 24 h window (slices are a window long)
_OFFER = "Limited offer: claim your free cruise tickets now at example dot com, reply STOP to opt out"


@pytest.mark.parametrize("race", [True, False], ids=["racing", "one-after-the-other"])
def test_near_duplicates_racing_across_a_slice_boundary_are_never_both_unique(
        make: Callable[..., SpreadIndex], race: bool) -> None:
    """a, just before a slice boundary, is looked up; b, its copy just after it, is decided whole by another worker
    while a's lookup is on its way. a's lookup read the slices up to its own high-water mark's, but b's record went
    to the next one: a's claim must still meet it (the lookup reads the next slice and its mark too, and a claim
    observes every slice the lookup read), so a is b's duplicate, as if b had come first."""
    first, second = (NearDupFilter(FilterConfig(), index=make(window=86_400.0)) for _ in range(2))
    a, b = Message("a", _OFFER, _EDGE - 1), Message("b", _OFFER, _EDGE + 1)
    got: list[Verdict] = []

    def meanwhile() -> bool:  # a's lookup is on its way
        if not got:
            got.append(second.decide([b], second.prepare([b.text]))[0])
        return True

    if not race:
        meanwhile()
    [va] = first.decide([a], first.prepare([a.text]), meanwhile=meanwhile)
    assert not got[0].duplicate
    assert va.duplicate and va.duplicate_of == "b"


def test_a_claim_observes_every_slice_its_lookup_read(make: Callable[..., SpreadIndex]) -> None:
    """An unrelated message z just after the boundary makes a's lookup read the next slice; b, a's copy there, is
    written while a's claim round is on its way: the claim finds the slice's mark moved, and its observation reads
    that slice again too (not only the slices of a's own high-water mark), so a is b's duplicate."""
    other = "Minutes of the quarterly budget meeting: attendance, the treasurer's report and the vote on the roof"
    first, second, third = (NearDupFilter(FilterConfig(), index=make(window=86_400.0)) for _ in range(3))
    z = Message("z", other, _EDGE + 5)
    assert not third.decide([z], third.prepare([z.text]))[0].duplicate
    a, b = Message("a", _OFFER, _EDGE - 1), Message("b", _OFFER, _EDGE + 1)
    calls, got = [0], list[Verdict]()

    def meanwhile() -> bool:  # a's second round trip is on its way
        calls[0] += 1
        if calls[0] < 2:
            return False
        got.append(second.decide([b], second.prepare([b.text]))[0])
        return True

    [va] = first.decide([a], first.prepare([a.text]), meanwhile=meanwhile)
    assert first.index._view.slices == (19_674, 19_675, 19_676)
    assert got and not got[0].duplicate
    assert va.duplicate and va.duplicate_of == "b"


def test_a_dead_workers_claim_holds_a_later_near_duplicate_until_it_expires_then_the_record_is_a_duplicate(
        make: Callable[..., SpreadIndex], redis_url: str, prefix: str) -> None:
    """A dies with its claim pending; B, a near-duplicate after it in the order, waits for it until its
    deadline (claim_ttl), aborts it and is unique; A's record, redelivered, is a duplicate of B."""
    with pytest.raises(_Died):
        _check(make(cls=_DiesAfterItsRecords, claim_ttl="0.6"), 0, "a", 1000.0)
    assert len(_pending(redis_url, prefix)) == 1
    t0 = time.monotonic()
    b = _check(make(claim_ttl="0.6"), 1, "b", 1001.0)
    waited = time.monotonic() - t0
    assert not b.duplicate and 0.3 < waited < 5.0, waited
    again = _check(make(claim_ttl="0.6"), 0, "a", 1000.0)
    assert again.duplicate and again.duplicate_of == "b"
    assert _pending(redis_url, prefix) == []


def test_a_redelivered_record_takes_its_pending_claim_over(make: Callable[..., SpreadIndex], redis_url: str,
                                                           prefix: str) -> None:
    """A dies with its claim pending; its record, redelivered before the claim expires, takes the claim
    over (no wait) and is unique; a later near-duplicate is its duplicate."""
    with pytest.raises(_Died):
        _check(make(cls=_DiesAfterItsRecords, claim_ttl="30"), 0, "a", 1000.0)
    t0 = time.monotonic()
    again = _check(make(claim_ttl="30"), 0, "a", 1000.0)
    assert not again.duplicate and time.monotonic() - t0 < 2.0
    b = _check(make(claim_ttl="30"), 1, "b", 1001.0)
    assert b.duplicate and b.duplicate_of == "a"
    assert _pending(redis_url, prefix) == []


def test_an_earlier_near_duplicate_notes_a_dead_claim_and_goes_on_and_the_redelivery_releases_it(
        make: Callable[..., SpreadIndex], redis_url: str, prefix: str) -> None:
    """A dies with its claim pending; B, before it in the order, notes it and commits at once (it never waits
    for a later claim); A's record, redelivered, is a duplicate of B and releases the claim it left."""
    with pytest.raises(_Died):
        _check(make(cls=_DiesAfterItsRecords, claim_ttl="30"), 0, "a", 1000.0)
    t0 = time.monotonic()
    b = _check(make(claim_ttl="30"), 1, "b", 999.0)
    assert not b.duplicate and time.monotonic() - t0 < 2.0
    again = _check(make(claim_ttl="30"), 0, "a", 1000.0)
    assert again.duplicate and again.duplicate_of == "b"
    assert _pending(redis_url, prefix) == []


# --- racing workers ----------------------------------------------------------------------------------------------


class _PausedSpread(PausedLookup, SpreadIndex):
    """Holds every worker between its lookup and its claims until all have looked up (`race`)."""


class _CheckThenInsert(_PausedSpread):
    """The design the race test must catch: look up, verify, then write the entry committed at once
    (`restore`'s unchecked write) without claiming."""

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        self._restore_entries(entries)
        super().insert([], memos)
        return [None] * len(entries)


@pytest.fixture(params=["3-masters", "6-masters"])
def spread_cluster(request: pytest.FixtureRequest) -> Iterator[str]:
    base = cluster_url(request.getfixturevalue("redis_cluster_url" if request.param == "3-masters"
                                               else "redis_cluster6_url"))
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    yield spread_url(base, prefix)
    drop_cluster_namespace(base, prefix)


@pytest.mark.parametrize("paused", [True, False], ids=["paused-between-lookup-and-claim", "free-running"])
def test_four_workers_racing_on_a_spread_cluster_make_exactly_one_unique(spread_cluster: str, paused: bool) -> None:
    """Four workers (threads, an index each) check their copy of each of 60 spam waves at the same moment;
    every wave's buckets spread over every master."""
    uniques = race(spread_cluster, racy=False, paused=paused, workers=4, clusters=60, index=_PausedSpread)
    assert uniques == [1] * len(uniques)


def test_the_race_test_catches_check_then_insert_on_a_spread_cluster(redis_cluster_url: str) -> None:
    base = cluster_url(redis_cluster_url)
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    try:
        uniques = race(spread_url(base, prefix), racy=True, paused=True, workers=4, clusters=30, index=_CheckThenInsert)
    finally:
        drop_cluster_namespace(base, prefix)
    assert sum(u > 1 for u in uniques) >= 15, uniques


# --- failover and resharding under racing workers ----------------------------------------------------------

REPO = SAMPLE.parents[2]


@dataclass(frozen=True)
class Node:
    id: str
    port: int
    master: bool
    of: str | None  # a replica's master


def cluster_nodes(port: int) -> list[Node]:
    text = _cli("-p", str(port), "CLUSTER", "NODES")
    nodes = []
    for line in text.strip().splitlines():
        id, address, flags, of, *_ = line.split()
        if "fail" in flags or "noaddr" in flags:
            continue
        nodes.append(Node(id, int(address.split("@")[0].rsplit(":", 1)[1]), "master" in flags,
                          None if of == "-" else of))
    return nodes


def _cli(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(["redis-cli", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def wait_healthy(port: int, timeout: float = 30.0) -> None:
    """Until every node agrees on the configuration and every slot is served (`redis-cli --cluster check`)."""
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(["redis-cli", "--cluster", "check", f"127.0.0.1:{port}"], capture_output=True,
                              text=True, timeout=30)
        if "[OK] All nodes agree" in done.stdout and "[ERR]" not in done.stdout and "[WARNING]" not in done.stdout:
            return
        assert time.monotonic() < deadline, done.stdout[-3000:]
        time.sleep(0.2)


def _port(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def manual_failover(port: int) -> str:
    """`CLUSTER FAILOVER` on a master's replica: the replica takes over once it has all the master's writes."""
    nodes = cluster_nodes(port)
    master = next(n for n in nodes if n.master and any(r.of == n.id for r in nodes))
    replica = next(r for r in nodes if r.of == master.id)
    _cli("-p", str(replica.port), "CLUSTER", "FAILOVER")
    deadline = time.monotonic() + 30
    while not next(n for n in cluster_nodes(replica.port) if n.id == replica.id).master:
        assert time.monotonic() < deadline, "the replica did not take over"
        time.sleep(0.1)
    wait_healthy(replica.port)
    return f"CLUSTER FAILOVER: {replica.port} took over from {master.port}"


def kill_a_master(port: int) -> str:
    """kill -9 a master; its replica is promoted once the node timeout (2 s) passes; the killed node is
    then started again (`docker/services.sh start cluster-ha`) and rejoins as a replica."""
    nodes = cluster_nodes(port)
    master = next(n for n in nodes if n.master and n.port != port and any(r.of == n.id for r in nodes))
    state = Path(os.environ.get("NEARDUP_STATE") or Path.home() / ".cache" / "neardup" / "services")
    pid = int((state / f"redis-cluster-{master.port}" / "redis.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    replica = next(r for r in nodes if r.of == master.id)
    while not any(n.id == replica.id and n.master for n in cluster_nodes(replica.port)):
        assert time.monotonic() - t0 < 30, "the replica was not promoted"
        time.sleep(0.1)
    promoted = time.monotonic() - t0
    done = subprocess.run(["bash", str(REPO / "docker" / "services.sh"), "start", "cluster-ha"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    wait_healthy(replica.port)
    return f"kill -9 of master {master.port}: replica {replica.port} promoted after {promoted:.1f} s"


def reshard(port: int) -> str:
    """512 slots moved from one master to another (keys with them, MIGRATE), then moved back."""
    masters = [n for n in cluster_nodes(port) if n.master]
    source, target = masters[0], masters[1]
    t0 = time.monotonic()
    _cli("--cluster", "reshard", f"127.0.0.1:{port}", "--cluster-from", source.id, "--cluster-to", target.id,
         "--cluster-slots", "512", "--cluster-yes", timeout=120)
    wait_healthy(port)
    _cli("--cluster", "rebalance", f"127.0.0.1:{port}", timeout=120)
    wait_healthy(port)
    return f"512 slots moved {source.port} -> {target.port} and back in {time.monotonic() - t0:.1f} s"


def race_through(url: str, change: Callable[[int], str], *, workers: int = 4, waves: int = 30) -> dict[str, Any]:
    """`workers` threads, an index each, check their copy of each spam wave at the same moment; a batch that
    fails as `IndexUnavailable` is retried after 0.2 s (the worker's `block` policy). After `waves` // 3
    waves, `change` alters the cluster (in a thread of its own); the waves go on until it is over, and
    `waves` more after it."""
    config = FilterConfig()
    namespace = f"race-{uuid.uuid4().hex[:10]}"
    indexes = [SpreadIndex(url, window=config.window, bucket_cap=config.bucket_cap, namespace=namespace)
               for _ in range(workers)]
    verdicts: list[list[Any]] = [[] for _ in range(workers)]
    retried = [0] * workers
    errors: list[BaseException] = []
    what: list[str] = []
    state = {"wave": -1, "go": True, "after": 0}

    def changed() -> None:
        try:
            what.append(change(_port(url)))
        except BaseException as exc:
            errors.append(exc)

    changing = threading.Thread(target=changed)

    def next_wave() -> None:  # run once per wave, by the barrier, before the workers go on
        state["wave"] += 1
        if state["wave"] == waves // 3:
            changing.start()
        if changing.ident is not None and not changing.is_alive():
            state["after"] += 1
        state["go"] = state["after"] <= waves and not errors and state["wave"] < 100 * waves

    start = threading.Barrier(workers, action=next_wave)

    def work(w: int) -> None:
        engine = NearDupFilter(config, index=indexes[w])
        try:
            while True:
                start.wait(timeout=120)
                c = state["wave"]
                if not state["go"]:
                    return
                deadline = time.monotonic() + 90
                while len(verdicts[w]) == c:
                    try:
                        verdicts[w].append(engine.check(_spam(c, w), id=f"c{c}-w{w}", ts=1_700_000_000 + c))
                    except IndexUnavailable:
                        retried[w] += 1
                        assert time.monotonic() < deadline, "the index stayed unavailable"
                        time.sleep(0.2)
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if changing.ident is not None:
        changing.join()
    redirects: Counter[str] = Counter()
    for index in indexes:
        redirects.update(index._nodes.redirects)
        index.close()
    if errors:
        raise errors[0]
    clusters = len(verdicts[0])
    uniques = [sum(not verdicts[w][c].duplicate for w in range(workers)) for c in range(clusters)]
    ids = {v.id for row in verdicts for v in row if not v.duplicate}
    for row in verdicts:
        for c, v in enumerate(row):
            assert not v.duplicate or (v.duplicate_of in ids and v.duplicate_of.startswith(f"c{c}-")), v
    return {"uniques": uniques, "retried": sum(retried), "redirects": redirects, "change": what}


def _pending_on(port: int, prefix: str) -> list[bytes]:
    """The claim states left in the namespace, on every node that says it is a master (right after a
    failover, one node's CLUSTER NODES may still call the old master one)."""
    found = []
    for node in cluster_nodes(port):
        with redis.Redis(port=node.port) as client:
            if client.execute_command("ROLE")[0] != b"master":
                continue
            for key in set(client.scan_iter(match=f"{{{prefix}:*:s:*", count=1000)):  # SCAN may name a key twice
                found += [f for f in client.hkeys(key) if f.startswith(b"c")]
    return found


@pytest.mark.parametrize("change", [manual_failover, kill_a_master, reshard], ids=lambda f: f.__name__)
def test_racing_workers_through_a_failover_or_a_resharding(redis_cluster_ha_url: str, change: Callable[[int], str]) -> None:
    """A master failing over (its replica takes over, or is promoted after a kill -9) or 512 slots moving
    between masters, mid-run, under four racing workers: batches caught by it fail as `IndexUnavailable`
    and are retried, taking over what their first attempt claimed. Every message decided, exactly one
    unique per wave, every duplicate names a unique, no claim left pending."""
    base = cluster_url(redis_cluster_ha_url)
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    try:
        got = race_through(spread_url(base, prefix, claim_ttl="1"), change)
        assert got["uniques"] == [1] * len(got["uniques"]), got
        assert _pending_on(_port(base), prefix) == []
        assert got["retried"] or got["redirects"], got  # the change did reach the workers mid-run
        print(got["change"], f"{len(got['uniques'])} waves, {got['retried']} batches retried,",
              f"redirects followed: {dict(got['redirects'])}")
    finally:
        drop_cluster_namespace(base, prefix)


# --- the fence: a changelogged spread index and its rebuild ----------------------------------------------------


def _drop_shard(base: str, index: SpreadIndex, shard: int) -> None:
    """What a master restarted empty does to one shard: its keys are gone (its meta hash, the marker with it)."""
    client: Any = (redis.RedisCluster.from_url(base.replace("+cluster", "")) if "+cluster" in base
                   else redis.Redis.from_url(base))
    with client:
        nodes = client.get_primaries() if "+cluster" in base else [None]
        for node in nodes:
            options = {"target_nodes": node} if node is not None else {}
            for key in list(client.scan_iter(match=f"{{{index.tags[shard]}}}*", **options)):
                client.unlink(key)


class _DiesBeforeItsRecords(SpreadIndex):
    """A restore that dies (its connection killed, its worker gone) after a chunk's entries are written at their
    homes, before their bucket records are."""

    def _ops(self, ops: Sequence[cl.Op]) -> list[Any]:
        raise IndexUnavailable("connection lost (the test)")


@pytest.mark.parametrize("where", ["redis", "cluster"])
def test_a_changelogged_spread_index_decides_nothing_while_a_shard_lacks_its_marker_and_is_rebuilt_whole(
        request: pytest.FixtureRequest, where: str) -> None:
    """Fenced (a worker with the changelog), the spread index decides no batch while some shard lacks the marker:
    never built, or one shard's data lost (its master restarted empty); a rebuild that died before it wrote its
    entries' records leaves no trace. Each time the guard rebuilds it from the changelog, and it decides as an
    index that never lost anything (the memory index) does."""
    base = request.getfixturevalue("redis_url") if where == "redis" else cluster_url(
        request.getfixturevalue("redis_cluster_url"))
    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    url = spread_url(base, prefix)
    cfg = FilterConfig()
    rng = random.Random(5)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "du", "ar", "en", "il", "om", "ub", "zy"]
    texts = [" ".join("".join(rng.choice(syllables) for _ in range(3)) for _ in range(14)) for _ in range(40)]
    first = [Message(f"a{i}", t, 1000.0 + i) for i, t in enumerate(texts)]
    later = [Message(f"b{i}", t + " !!", 2000.0 + i) for i, t in enumerate(texts)]  # a near-duplicate each
    last = [Message(f"c{i}", t + " ??", 3000.0 + i) for i, t in enumerate(texts)]  # another
    memory = NearDupFilter(cfg)
    want_first, want_later, want_last = (memory.check_batch(batch) for batch in (first, later, last))
    assert all(v.duplicate for v in want_later + want_last)
    index = SpreadIndex(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace="ns", fenced=True)
    dying = _DiesBeforeItsRecords(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace="ns", fenced=True)
    journal = Journal(index)
    nd = NearDupFilter(cfg, index=journal)
    read = ListChangelog()

    def seen(verdicts: list[Verdict]) -> list[tuple[str, bool, str | None]]:
        return [(v.id, v.duplicate, v.duplicate_of) for v in verdicts]

    async def go() -> None:
        guard = IndexGuard(url, namespace="ns", window=cfg.window, member="t")
        try:
            with pytest.raises(IndexLost, match="holds no marker"):
                nd.check_batch(first)  # never built
            assert await guard.ensure(read, index.restore) is True
            assert seen(nd.check_batch(first)) == seen(want_first)
            read.entries.extend(journal.take())
            _drop_shard(base, index, index._home("a0"))  # a shard's data lost
            with pytest.raises(IndexLost, match="holds no marker in 1 of its 64 shards"):
                nd.check_batch(later)
            assert await guard.marker() is None
            assert await guard.ensure(read, index.restore) is True
            assert seen(nd.check_batch(later)) == seen(want_later)
            for shard in range(index.shards):  # every shard's data lost (FLUSHALL)
                _drop_shard(base, index, shard)
            with pytest.raises(IndexUnavailable):  # a rebuild that dies half way
                await guard.ensure(read, dying.restore)
            with pytest.raises(IndexLost):
                nd.check_batch(last)
            assert await guard.ensure(read, index.restore) is True  # the next one
            assert seen(nd.check_batch(last)) == seen(want_last)
        finally:
            await guard.close()

    try:
        asyncio.run(go())
    finally:
        index.close()
        dying.close()
        (drop_namespace if where == "redis" else drop_cluster_namespace)(base, prefix)
        (drop_namespace if where == "redis" else drop_cluster_namespace)(base, f"{prefix}:ns")


@pytest.mark.parametrize("step", ["_homes", "_round"])
def test_a_changelogged_spread_index_decides_nothing_on_what_a_loss_after_its_lookup_took(
        redis_url: str, prefix: str, step: str) -> None:
    """The lookup checks every shard's marker in its first read; the masters lose their data after it, before
    the read of the candidates' homes (`_homes`) or a round of the claims (`_round`). Those read the markers
    of their shards in the same pipeline: `IndexLost`, not candidates read as gone and the batch decided
    unique against the lost index. Without the loss, every near-duplicate is found."""
    url = spread_url(redis_url, prefix)
    cfg = FilterConfig()
    rng = random.Random(3)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "du", "ar", "en", "il", "om"]
    texts = [" ".join("".join(rng.choice(syllables) for _ in range(3)) for _ in range(12)) for _ in range(20)]

    async def read(write: Callable[[Stored], Awaitable[int]]) -> int:
        return 0

    async def decide(lose: bool) -> list[Verdict]:
        namespace = uuid.uuid4().hex[:8]
        guard = IndexGuard(url, namespace=namespace, window=cfg.window, member="t")
        first, later = (SpreadIndex(url, window=cfg.window, bucket_cap=cfg.bucket_cap, namespace=namespace,
                                    fenced=True) for _ in "ab")
        try:
            await guard.ensure(read, first.restore)
            NearDupFilter(cfg, index=first).check_batch([Message(f"a{i}", t, 1000.0 + i) for i, t in enumerate(texts)])
            nd = NearDupFilter(cfg, index=later)
            nd.check_batch([Message("warm", "nothing like the others at all", 1500.0)])  # its marker taken
            if lose:
                went = getattr(later, step)

                def after_a_loss(*args: Any) -> Any:
                    for shard in range(later.shards):
                        _drop_shard(redis_url, later, shard)
                    setattr(later, step, went)
                    return went(*args)

                setattr(later, step, after_a_loss)
            batch = [Message(f"b{i}", t + " !!", 2000.0 + i) for i, t in enumerate(texts)]
            if step == "_round":  # new texts: no candidates, a claim round for each
                other = random.Random(4)
                batch = [Message(f"c{i}", " ".join("".join(other.choice(syllables[::-1]) for _ in range(4))
                                                   for _ in range(12)), 2000.0 + i) for i in range(20)]
            return nd.check_batch(batch)
        finally:
            first.close()
            later.close()
            await guard.close()

    found = asyncio.run(decide(False))
    assert all(v.duplicate for v in found) if step == "_homes" else not any(v.duplicate for v in found)
    with pytest.raises(IndexLost):
        asyncio.run(decide(True))


def test_a_changelogged_spread_index_keeps_its_marker_in_every_shard_while_it_is_used(redis_url: str,
                                                                                        prefix: str) -> None:
    """A shard's meta hash (its marker) is written by the ids whose home it is: with a stream too quiet for every
    shard to be some id's home within window + grace, the lookups keep them all (with a TTL), so the marker
    stays while workers route and no rebuild is made of a loss that did not happen."""
    window = 2.0
    url = spread_url(redis_url, prefix, grace="1")
    cfg = FilterConfig(window=window)
    index = SpreadIndex(url, window=window, bucket_cap=8, namespace="ns", fenced=True)
    nd = NearDupFilter(cfg, index=index)
    read = ListChangelog()  # empty

    async def go() -> None:
        guard = IndexGuard(url, namespace="ns", window=window, member="t")
        try:
            assert await guard.ensure(read, index.restore) is True
            t0 = time.time()
            i = 0
            while time.time() - t0 < 2 * (window + 1):  # twice the TTL: 20 messages for 64 shards
                nd.check_batch([Message(f"m{i}", f"message number {i} of a quiet stream", time.time())])
                i += 1
                await asyncio.sleep(0.3)
            assert await guard.marker() is not None
            assert await guard.ensure(read, index.restore) is False
        finally:
            await guard.close()

    try:
        asyncio.run(go())
        with redis.Redis.from_url(redis_url) as client:
            metas = [f"{{{tag}}}:meta" for tag in index.tags]
            assert all(0 < client.pttl(meta) <= 3000 for meta in metas)
    finally:
        index.close()
