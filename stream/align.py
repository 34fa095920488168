"""Event-time alignment: which fetched records a worker decides next, lowest event time first, within a skew of its group.

Why: a consumer drains its partitions in whatever order the fetcher returns them, so with a backlog one
partition runs hours of event time ahead of another, the later copy of a message is decided first
(unique) and its true original, decided later, becomes its duplicate. Verdicts would depend on
scheduling. Kafka Streams orders a task's partitions by the timestamp of their head records and waits
`max.task.idle.ms` for empty ones; Flink pauses splits that run more than a drift ahead of their group's
watermark. `Aligner` does both for one worker, and `GroupMarks` extends it to the consumer group:

- Inside a worker, records are taken from the partition whose head record has the lowest event time
  (a merge: exact order, whatever the skew). A partition with nothing buffered holds the others back
  to its last event time (its next record is at least that old, partitions being in order), + `max_skew`
  when it has nothing left to fetch (live traffic), unless it is idle: nothing to fetch (no lag) for
  `idle_timeout`. So a quiet partition delays
  live traffic once by at most `idle_timeout`, and a lagging one (a backlog being fetched) is waited for.
- Across workers, each publishes its low mark (the event time of the next record it will decide) and
  the partitions it owns through `GroupMarks`; a worker takes only records at most `max_skew` ahead of
  the lowest mark of the others, and none until the live workers' claims cover the input once. The
  worker holding the lowest mark can always go on, so
  the group cannot deadlock; a dead worker's mark expires (its time to live), and a worker that owns
  nothing or only idle partitions publishes no low mark and holds nobody back.
- A record taken more than `max_skew` behind the highest event time its worker decided since its
  partitions were last assigned is late (a quiet partition woke up with old records, or a
  producer stamped it late): it is decided all the same, and the worker marks it (`neardup-late`
  header, a metric). Records read again after a rebalance (from the committed offsets) or after an
  aborted transaction are not late: a worker's high mark restarts with its assignment or its rewind, as
  its reading restarts from its offsets.

Pure and synchronous (the worker's loop feeds it and publishes its marks): no I/O but `RedisMarks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from stream.kafka_tools import KafkaRecord

Lane = tuple[str, int]  # topic, partition
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupView:
    """What the group's marks say to one worker: the lowest next event time another live worker holds
    (None: nobody holds this one back; its own partitions it orders exactly)."""

    low: float | None = None
    # Whether the live workers' claims cover the input's partitions once: if not, a worker's mark is
    # missing (it has just been assigned partitions and not said so yet) or stale, and nobody may go on.
    complete: bool = True
    # Whether this worker's own mark was gone (Redis lost its data, the marks were reset after the index lost
    # its data, or it expired): published as 0 meanwhile, it holds the group back until the worker has checked
    # the index and written back what it decided, then published again (`GroupMarks.publish`).
    rejoined: bool = False


@dataclass(frozen=True, slots=True)
class Taken:
    """A batch the aligner let go: its records in decision order, their event times and, for each, how far
    (seconds) it is behind the worker's highest event time, when more than `max_skew` (see the module doc)."""

    records: list[KafkaRecord]
    times: list[float]
    late: list[float]  # 0.0 where not late
    waiting: str = ""  # why nothing (more) was taken: "" (nothing buffered), "partition", "group"

    def __bool__(self) -> bool:
        return bool(self.records)


# How long a partition whose fetch position or end is not known yet (no fetch answered for it since it
# was assigned) is waited for before it counts as idle: a first fetch after an assignment takes a while.
UNKNOWN_GRACE = 10.0


@dataclass(slots=True)
class _Lane:
    records: deque[tuple[float, KafkaRecord]] = field(default_factory=deque)
    last: float | None = None  # event time of the last record buffered (the next is at least that)
    quiet_since: float | None = None  # since when it is empty with nothing left to fetch (or not known)
    known: bool = False  # whether its lag was ever known
    left: int | None = None  # records left to fetch beyond its buffer at the last `flow` (None: not known)
    paused: bool = False
    next_offset: int | None = None  # the offset after the last record buffered: one before it is a re-fetch
    chunk: int = 0  # the most records one fetch returned of it (`add`): its buffer holds two such at least


class Aligner:
    """The buffered records of a worker's partitions and the order it decides them in (see module doc).

    `lag(lane)` says how many records of a partition are left to fetch (None: not known yet); a lane is
    idle when it is empty, has no known lag and has been so for `idle_timeout` seconds. `ordered=False`
    takes records in arrival order and never waits (alignment off: for comparison).
    """

    def __init__(self, event_time: Callable[[KafkaRecord], float | None], *, max_skew: float, idle_timeout: float,
                 buffer: int, ordered: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.event_time = event_time  # None: the record has no event time (it will be dead-lettered)
        self.max_skew = max_skew
        self.idle_timeout = idle_timeout
        # Records buffered per partition before it is paused, or twice what one fetch returned of it if more: the
        # consumer drops what it fetched ahead of a paused partition, so a buffer smaller than one fetch would pause
        # and resume a partition on every fetch and fetch the same records again (a backlog of short messages:
        # 1 MB a fetch, 3,000 records, against 2 × max_batch).
        self.buffer = buffer
        self.ordered = ordered
        self.clock = clock
        self._lanes: dict[Lane, _Lane] = {}
        self._arrival: deque[tuple[Lane, float, KafkaRecord]] = deque()  # ordered=False only
        self._open: dict[int, float] = {}  # batches taken, not yet decided: id → lowest event time
        self._timeless: set[int] = set()  # buffered records with no event time of their own (by id())
        self.high: float | None = None  # the highest event time taken since the last assignment
        self.late = 0  # records taken late

    # -- feeding ---------------------------------------------------------------------------------
    def assign(self, lanes: Iterable[Lane]) -> None:
        """The partitions owned now. Those kept keep their buffered records: after an assignment the
        consumer fetches each partition again from its committed offset, and what comes again is known
        by its offset (`add`); what this worker no longer owns is dropped (its next owner reads it from
        the committed offset: everything routed before was committed before the partitions went)."""
        now = self.clock()
        owned = set(lanes)
        for key, lane in self._lanes.items():
            if key not in owned:
                self._timeless.difference_update(id(r) for _, r in lane.records)
        self._timeless.difference_update(id(a[2]) for a in self._arrival if a[0] not in owned)
        self._lanes = {lane: self._lanes.get(lane) or _Lane(quiet_since=now) for lane in sorted(owned)}
        self._arrival = deque(a for a in self._arrival if a[0] in owned)
        self.high = None

    def owns(self, lane: Lane) -> bool:
        return lane in self._lanes

    def rewind(self, lanes: Iterable[Lane]) -> None:
        """The consumer was sent back (a seek) on these partitions: what was buffered of them is dropped
        and comes again. As after an assignment, the high mark starts again: what comes again was decided
        once in a transaction that aborted, and gets the headers of the first time (not late against itself)."""
        self.high = None
        for key in lanes:
            lane = self._lanes.get(key)
            if lane is not None:
                self._timeless.difference_update(id(r) for _, r in lane.records)
                lane.records.clear()
                lane.next_offset = None
                # Its next record is one sent back, earlier than those buffered: until it comes again, the
                # partition may hold anything (as when just assigned), not what it held buffered, and is not idle.
                lane.last = None
                lane.quiet_since = None
        gone = set(lanes)
        self._timeless.difference_update(id(a[2]) for a in self._arrival if a[0] in gone)
        self._arrival = deque(a for a in self._arrival if a[0] not in gone)

    def add(self, records: Iterable[KafkaRecord]) -> None:
        """Records the consumer returned (of its current assignment, whether or not the rebalance callback
        has told `assign` yet: the consumer may return records of a new assignment before it): each is
        kept once, a record fetched again (an offset already buffered) is not."""
        chunks: dict[Lane, int] = {}
        for r in records:
            key = (r.topic, r.partition)
            chunks[key] = chunks.get(key, 0) + 1
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = _Lane()
            if lane.next_offset is not None and r.offset < lane.next_offset:
                continue
            lane.next_offset = r.offset + 1
            own = self.event_time(r)
            if own is None:
                # Dead-lettered: placed right after its partition's previous record, so it neither moves this
                # worker's clock nor waits; nothing is decided against its time.
                self._timeless.add(id(r))
                ts = lane.last if lane.last is not None else (self.high if self.high is not None else 0.0)
            else:
                ts = own
            if self.ordered:
                lane.records.append((ts, r))
            else:
                self._arrival.append((key, ts, r))
            if own is not None:
                lane.last = ts if lane.last is None else max(lane.last, ts)
            lane.quiet_since = None
        for key, n in chunks.items():
            lane = self._lanes[key]
            lane.chunk = max(lane.chunk, n)

    def buffered(self) -> int:
        return sum(len(lane.records) for lane in self._lanes.values()) + len(self._arrival)

    def flow(self, lag: Callable[[Lane], int | None]) -> tuple[list[Lane], list[Lane]]:
        """Partitions to pause (their buffer is full) and to resume (drained to half); also notes which
        empty partitions have nothing left to fetch (quiet, towards idle). Call on every loop."""
        now = self.clock()
        pause, resume = [], []
        total = len(self._arrival)  # unordered: one buffer for all, paused and resumed together
        for key, lane in self._lanes.items():
            lane.left = lag(key)
            n = len(lane.records) if self.ordered else total * (lane.paused or total >= self.buffer)
            limit = max(self.buffer, 2 * lane.chunk) if self.ordered else self.buffer
            if not lane.paused and n >= limit:
                lane.paused = True
                pause.append(key)
            elif lane.paused and n <= limit // 2:
                lane.paused = False
                resume.append(key)
            if n == 0 and not lane.paused:
                left = lane.left
                lane.known = lane.known or left is not None
                if not left:  # 0, or not known
                    if lane.quiet_since is None:
                        lane.quiet_since = now
                else:
                    lane.quiet_since = None  # a backlog being fetched: wait for it
        return pause, resume

    def lanes(self) -> list[Lane]:
        """The partitions owned now."""
        return list(self._lanes)

    def paused(self) -> list[Lane]:
        return [key for key, lane in self._lanes.items() if lane.paused]

    def lane_states(self) -> dict[Lane, tuple[int, str]]:
        """Per partition owned, the records buffered and what holds it (for a worker that explains why it
        takes nothing)."""
        now = self.clock()
        return {key: (len(lane.records), f"{len(lane.records)} buffered, last event time {lane.last}, next offset "
                      f"{lane.next_offset}{', paused' if lane.paused else ''}{', idle' if self._idle(lane, now) else ''}")
                for key, lane in self._lanes.items()}

    # -- taking ----------------------------------------------------------------------------------
    def _idle(self, lane: _Lane, now: float) -> bool:
        if lane.quiet_since is None or lane.records:
            return False
        return now - lane.quiet_since >= (self.idle_timeout if lane.known else max(self.idle_timeout, UNKNOWN_GRACE))

    def _dry_bound(self, lane: _Lane, last: float = -math.inf) -> float:
        """How far an empty, not idle partition lets the others go: its last event time (`last` if it has none;
        its next record is at least that), + max_skew only when it has nothing left to fetch (live traffic: its
        next record is not produced yet). One with records left to fetch, or not known to have none, is waited for."""
        last = lane.last if lane.last is not None else last
        return last + (self.max_skew if lane.left == 0 else 0.0)

    def _lane_bound(self, now: float) -> float:
        """How far records may go: the bound of every empty, not idle partition (`_dry_bound`)."""
        bound = math.inf
        for lane in self._lanes.values():
            if not lane.records and not self._idle(lane, now):
                bound = min(bound, self._dry_bound(lane))
        return bound

    def take(self, n: int, group: GroupView | None = None) -> Taken:
        """Up to `n` records in decision order: the lowest head event time first, none beyond the empty
        partitions' bound nor more than `max_skew` ahead of the group's low mark."""
        if not self.ordered:
            return self._take_arrival(n)
        if group is not None and not group.complete:
            return Taken([], [], [], "group")
        now = self.clock()
        lane_bound = self._lane_bound(now)
        group_bound = math.inf if group is None or group.low is None else group.low + self.max_skew
        heads = [(lane.records[0][0], i, lane) for i, lane in enumerate(self._lanes.values()) if lane.records]
        heapq.heapify(heads)
        records: list[KafkaRecord] = []
        times: list[float] = []
        late: list[float] = []
        # Against what this worker decided since its assignment: what the group decided would also count records
        # read again after a crash (their transaction aborted) as late, and a replay must look like the first time.
        high = self.high
        waiting = ""
        while heads and len(records) < n:
            ts, i, lane = heads[0]
            if ts > lane_bound:
                waiting = "partition"
                break
            if ts > group_bound:
                waiting = "group"
                break
            _, record = lane.records.popleft()
            if lane.records:
                heapq.heapreplace(heads, (lane.records[0][0], i, lane))
            else:
                heapq.heappop(heads)
                if not self._idle(lane, now):
                    lane_bound = min(lane_bound, self._dry_bound(lane, ts))
            records.append(record)
            times.append(ts)
            if id(record) in self._timeless:
                self._timeless.discard(id(record))
                late.append(0.0)
                continue
            behind = (high - ts) if high is not None else 0.0
            late.append(behind if behind > self.max_skew else 0.0)
            high = ts if high is None else max(high, ts)
            self.high = ts if self.high is None else max(self.high, ts)
        return self._taken(records, times, late, waiting)

    def _take_arrival(self, n: int) -> Taken:
        records: list[KafkaRecord] = []
        times: list[float] = []
        late: list[float] = []
        while self._arrival and len(records) < n:
            _, ts, record = self._arrival.popleft()
            self._timeless.discard(id(record))
            records.append(record)
            times.append(ts)
            late.append(0.0)
        return self._taken(records, times, late, "")

    def _taken(self, records: list[KafkaRecord], times: list[float], late: list[float], waiting: str) -> Taken:
        taken = Taken(records, times, late, waiting)
        if records:
            self.late += sum(1 for x in late if x)
            self._open[id(taken.records)] = min(times)
        return taken

    def decided(self, taken: Taken) -> None:
        """`taken` was decided (its verdicts are in the index): the low mark may pass it."""
        self._open.pop(id(taken.records), None)

    def dropped(self, taken: Taken) -> None:
        """`taken` will not be decided as it is (a rebalance took some of its partitions): forget it."""
        self._open.pop(id(taken.records), None)

    def retake(self, taken: Taken) -> Taken:
        """`taken` (what is left of a batch after `dropped`) counts as undecided again."""
        self._open[id(taken.records)] = min(taken.times)
        return taken

    def low_mark(self) -> float | None:
        """The event time of the next record this worker will decide: its undecided batches, the heads of
        its partitions and the last event time of those waited for; 0 while one of those has not shown a
        record yet (just assigned: it may hold anything, so the group waits for it, `UNKNOWN_GRACE` at
        most). None when it holds nothing back."""
        now = self.clock()
        marks = list(self._open.values())
        for lane in self._lanes.values():
            if lane.records:
                marks.append(lane.records[0][0])
            elif not self._idle(lane, now):
                marks.append(0.0 if lane.last is None else lane.last)
        marks.extend(ts for _, ts, _ in self._arrival)
        return min(marks) if marks else None


# -- the group's marks ---------------------------------------------------------------------------


class GroupMarks(Protocol):
    """Where a worker publishes its marks and reads the group's (`GroupView`)."""

    async def publish(self, low: float | None, owned: Iterable[Lane], every: Iterable[Lane]) -> GroupView:
        """This worker's low mark and the partitions it owns (of `every`, the input's); the group's view. If the
        mark it published before is gone, it is published as 0 instead (`GroupView.rejoined`): the index may have
        lost what this worker decided, and the group waits until it has written that back."""
        ...

    async def reset(self) -> None:
        """Forgets every worker's mark (the index lost its data): each worker's next publish rejoins, so the group
        goes on only once every live worker has written back what it decided (`GroupView.rejoined`)."""
        ...

    async def moved(self, timeout: float) -> GroupView | None:
        """Returns once another worker's mark or claims changed since the last `publish` read them, or after
        `timeout` seconds (a mark that expired, or marks that cannot be watched): the group's view if the
        change came with one newer than the last `publish`'s (no need to read them again), else None."""
        ...

    async def close(self) -> None: ...


class SoloMarks:
    """One worker alone (a memory:// index has no group): nobody else holds it back."""

    async def publish(self, low: float | None, owned: Iterable[Lane], every: Iterable[Lane]) -> GroupView:
        return GroupView(None)

    async def moved(self, timeout: float) -> GroupView | None:
        await asyncio.sleep(timeout)
        return None

    async def reset(self) -> None:
        pass

    async def close(self) -> None:
        pass


# How often a worker held back by the group reads the marks when it cannot watch them (`RedisMarks.moved`).
UNWATCHED_POLL = 0.001
MARKS_LUA = resources.files("stream").joinpath("lua/marks.lua").read_text(encoding="utf-8")


def _number(value: bytes | str | None) -> float | None:
    if value in (None, b"", ""):
        return None
    return float(value)  # type: ignore[arg-type]


def _text(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class RedisMarks:
    """The group's marks in a Redis hash beside the index (one key: `{prefix:namespace}:marks:<group>`),
    written and read in one script call (stream/lua/marks.lua), with the server's clock for expiry.

    The script publishes the marks on `<key>:moved` when what the others see changes, numbered by the order
    of the script's calls; a listener (a subscription of its own, opened with the first `publish`) keeps the
    newest, so that a worker held back wakes as soon as another worker moved (`moved`) and, if what it got
    is newer than its own last call (so it shows this worker's own claims as they are), takes it as a read
    of the marks without a round trip."""

    def __init__(self, url: str, *, namespace: str, group: str, member: str = "", ttl: float = 10.0) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.cluster import RedisCluster

        from filters.index.redis import RedisTarget, redact_url

        target = RedisTarget.parse(url)
        self.where = redact_url(url)
        self.key = f"{{{target.prefix}:{namespace}}}:marks:{group}"
        self.member = member or uuid.uuid4().hex[:12]
        self.ttl_ms = max(1, round(ttl * 1000))
        options: dict[str, Any] = {"decode_responses": False, "socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        self._client = (RedisCluster.from_url(target.client_url, **options) if target.cluster
                        else aioredis.Redis.from_url(target.client_url, **options))
        self._script = self._client.register_script(MARKS_LUA)
        self._listener: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._read = 0  # the number of this worker's last call of the script (or of the marks taken since)
        self._newest: tuple[int, bytes] = (0, b"")  # the newest marks published: their call's number, the marks
        self._every: list[Lane] = []
        self._warned = False
        self._marked = False  # a mark of this worker's is in the hash, as far as it knows (published, not left)

    async def publish(self, low: float | None, owned: Iterable[Lane], every: Iterable[Lane]) -> GroupView:
        from filters.index.redis import redis_errors

        self._every = list(every)
        claims = " ".join(f"{topic}/{partition}" for topic, partition in sorted(owned))
        with redis_errors(self.where):
            got = await self._script(keys=[self.key, f"{self.key}:n"],
                                     args=[self.member, _text(low), self.ttl_ms, claims, "1" if self._marked else ""])
        self._marked = bool(claims) or low is not None
        number = int(got[2])  # later than any marks taken from the channel before, unless ...
        if number < self._read:
            self._newest = (0, b"")  # ... the counter started again (Redis restarted with nothing saved)
        self._read = number  # (marks newer than this call, published while it was answered, are kept)
        if self._listener is None or self._listener.done():
            await self._listen()  # from now on: a move between this read and the subscription falls to the timeout
        return GroupView(_number(got[0]), covers(got[1], self._every), rejoined=bool(int(got[3])))

    async def moved(self, timeout: float) -> GroupView | None:
        if self._listener is None or self._listener.done():
            # Not watching (Redis was down, or the channel is not granted): read the marks again soon.
            await asyncio.sleep(min(timeout, UNWATCHED_POLL))
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._newest[0] <= self._read:  # this worker's own moves wake it too: not news
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None
            if self._listener.done():
                return None
        n, marks = self._newest
        self._read = n
        return self._view(marks)

    def _view(self, marks: bytes) -> GroupView:
        """The group's view from published marks (lines of "<worker>|<low mark>|<claims>"), as the script answers."""
        low: float | None = None
        claims: list[bytes] = []
        me = self.member.encode()
        for line in marks.split(b"\n"):
            rest, _, owned = line.rpartition(b"|")
            worker, _, mark = rest.rpartition(b"|")
            claims.append(owned)
            value = _number(mark)
            if worker != me and value is not None and (low is None or value < low):
                low = value
        return GroupView(low, covers(claims, self._every))

    async def _listen(self) -> bool:
        """Subscribes and keeps the newest marks published in a task; False if the subscription failed
        (`moved` then falls back to its timeout, and the next `publish` tries again)."""
        from redis.exceptions import RedisError

        channel = f"{self.key}:moved"
        self._newest = (0, b"")
        try:
            pubsub = self._client.pubsub()
            await pubsub.subscribe(channel)
        except (RedisError, OSError) as exc:
            if not self._warned:
                self._warned = True
                log.warning("event-time marks: cannot subscribe to %s (%s): a worker held back by the group reads "
                            "the marks every %g s instead (an ACL user needs the channel: &%s)", channel, exc,
                            UNWATCHED_POLL, channel)
            return False

        async def listen() -> None:
            try:
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if message is None:
                        continue
                    number, _, marks = bytes(message["data"]).partition(b"\n")
                    if int(number) > self._newest[0]:
                        self._newest = (int(number), marks)
                        self._wake.set()
            except (RedisError, OSError):
                pass  # Redis went away: publish subscribes again
            finally:
                self._wake.set()  # whoever waits reads the marks (or their error) now
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

        self._listener = asyncio.ensure_future(listen())
        return True

    async def reset(self) -> None:
        from filters.index.redis import redis_errors

        with redis_errors(self.where):
            await self._client.delete(self.key)

    async def close(self) -> None:
        from filters.errors import NeardupError
        from filters.index.redis import redis_errors

        self._marked = False
        try:
            with redis_errors(self.where):
                await self._script(keys=[self.key, f"{self.key}:n"], args=[self.member, "", self.ttl_ms, "", ""])  # leave
        except NeardupError:
            pass  # leaving is best effort: the mark expires anyway
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        await self._client.aclose()


def covers(claims: Sequence[bytes | str], every: Iterable[Lane]) -> bool:
    """Whether the workers' claims ("topic/partition ...", one per worker) cover `every` partition once."""
    seen: list[str] = []
    for claim in claims:
        seen.extend((claim.decode() if isinstance(claim, bytes) else claim).split())
    return len(seen) == len(set(seen)) and set(seen) == {f"{topic}/{partition}" for topic, partition in every}


def open_marks(index_url: str, *, namespace: str, group: str, member: str, ttl: float) -> GroupMarks:
    """Marks shared through the index's Redis (`redis://…`), or this worker's own (`memory://`)."""
    if index_url.startswith("memory:"):
        return SoloMarks()
    return RedisMarks(index_url, namespace=namespace, group=group, member=member, ttl=ttl)


def lanes_of(tps: Sequence[object]) -> list[Lane]:
    """aiokafka's TopicPartitions as lanes."""
    return [(tp.topic, tp.partition) for tp in tps]  # type: ignore[attr-defined]
