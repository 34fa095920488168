"""The claim protocol of the spread index (filters/index/claims.py) explored as a model: the workers' half is
the real `Resolver`; the nodes are a pure-Python model of the Lua scripts (held to them by
tests/test_spread_index.py); a scheduler interleaves every op of every worker at random, advances the
nodes' clock (claims expire), kills workers mid-claim and redelivers their messages.

Asserted after every run: every message decided once (nothing lost, nobody stuck), no home left pending,
the uniques are exactly the committed homes, a duplicate names a unique, and the verdicts are serializable: some order of
the messages decides each as it was decided, one at a time (no two uniques are near-duplicates of each
other, nor in a longer cycle) — hence exactly one unique per cluster of mutual near-duplicates.
"""

from __future__ import annotations

import os
import random
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from filters.index import claims as cl
from filters.index.redis_codec import SEQ, parse_records, rank_records

_RECORD = struct.Struct("<dI")


def record(ts: float, id: str, seq: int) -> bytes:
    raw = id.encode()
    return _RECORD.pack(ts, len(raw)) + raw + SEQ.pack(seq)


def field_name(bucket: int) -> bytes:
    return b"b" + bucket.to_bytes(8, "big")


# --- the nodes: a model of filters/index/lua/spread_*.lua ----------------------------------------------


@dataclass
class HomeRecord:
    blob: bytes
    deadline: float | None  # None: committed
    notes: list[cl.Order] = field(default_factory=list)


class Shard:
    """One shard's keys: bucket fields and homes. Each method is one op, atomic (a script call)."""

    def __init__(self) -> None:
        self.buckets: dict[bytes, bytes] = {}
        self.homes: dict[str, HomeRecord] = {}
        self.seq = 0

    def home(self, id: str) -> cl.Home:
        h = self.homes.get(id)
        if h is None:
            return cl.Home(cl.GONE)
        if h.deadline is None:
            return cl.Home(cl.COMMITTED, h.blob)
        return cl.Home(cl.PENDING, h.blob, tuple(h.notes))

    def apply(self, op: cl.Op, now: float, ttl: float, seen: dict[bytes, bytes | None] | None = None) -> Any:
        if isinstance(op, cl.Create):
            h = self.homes.get(op.id)
            if h is not None and h.deadline is None:
                return self.home(op.id)
            if h is None:
                self.homes[op.id] = HomeRecord(op.blob, now + ttl)
            else:
                h.deadline = now + ttl  # a claim of the same id taken over: its notes stay
            return self.home(op.id)
        if isinstance(op, cl.Claim):  # `seen`: the claimant's lookup values (a field: its length, last 8 bytes)
            changed = not op.check or any(_tail(self.buckets.get(f)) != _tail(seen.get(f)) for f in op.fields)
            self.seq += 1
            rec = record(op.ts, op.id, self.seq)
            for f in op.fields:
                self.buckets[f] = self.buckets.get(f, b"") + rec
            return cl.CLAIM_CHANGED if changed else cl.CLAIM_SAME
        if isinstance(op, cl.Read):
            return [[self.buckets.get(f) for f in op.fields]]  # one slice
        if isinstance(op, cl.State):
            return self.home(op.id)
        h = self.homes.get(op.id)  # type: ignore[union-attr]
        pending = h is not None and h.deadline is not None
        if isinstance(op, cl.Note):
            if pending:
                assert h is not None
                h.notes.append(op.by)
        elif isinstance(op, cl.Commit):
            if pending and len(h.notes) <= op.seen:  # type: ignore[union-attr]
                h.deadline = None  # type: ignore[union-attr]
        elif isinstance(op, cl.Poll):
            if pending and h.deadline < now:  # type: ignore[union-attr, operator]
                del self.homes[op.id]
        elif isinstance(op, cl.Refresh):
            if pending:
                h.deadline = now + ttl  # type: ignore[union-attr]
        elif isinstance(op, cl.Abort):
            if pending:
                del self.homes[op.id]
        else:
            raise AssertionError(op)
        return self.home(op.id)  # type: ignore[union-attr]


def _tail(value: bytes | None) -> tuple[int, bytes]:
    return (len(value), value[-8:]) if value else (0, b"")


# --- the scenario -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Msg:
    id: str
    ts: float
    keys: tuple[int, ...]
    group: int  # messages of one group verify as near-duplicates (if they share enough keys)
    floor: int  # the fewest keys a candidate must share


@dataclass
class Scenario:
    messages: list[Msg]
    shards: int
    batches: list[list[list[str]]]  # per worker, its batches of message ids
    ttl: float  # claim_ttl, in the model's milliseconds
    similar_pairs: frozenset[frozenset[str]] = frozenset()  # extra similarity across groups

    def msg(self, id: str) -> Msg:
        return next(m for m in self.messages if m.id == id)

    def similar(self, a: str, b: str) -> bool:
        ma, mb = self.msg(a), self.msg(b)
        return ma.group == mb.group or frozenset((a, b)) in self.similar_pairs

    def shared(self, a: str, b: str) -> int:
        return len(set(self.msg(a).keys) & set(self.msg(b).keys))

    def near(self, a: str, b: str, shared: int | None = None) -> bool:
        """`a` is a duplicate of `b` (the engine's rule: similar, sharing at least a's floor of keys)."""
        n = self.shared(a, b) if shared is None else shared
        return self.similar(a, b) and n >= self.msg(a).floor


def scenarios(max_messages: int = 7) -> st.SearchStrategy[Scenario]:
    @st.composite
    def build(draw: st.DrawFn) -> Scenario:
        n = draw(st.integers(2, max_messages))
        groups = draw(st.integers(1, 3))
        buckets = draw(st.integers(2, 8))
        messages = []
        for i in range(n):
            keys = tuple(sorted(draw(st.sets(st.integers(0, buckets - 1), min_size=1, max_size=4))))
            messages.append(Msg(f"m{i}", float(draw(st.integers(0, 3))), keys, draw(st.integers(0, groups - 1)),
                                draw(st.integers(1, 2))))
        ids = [m.id for m in messages]
        pairs = draw(st.sets(st.tuples(st.sampled_from(ids), st.sampled_from(ids)), max_size=2))
        workers = draw(st.integers(2, 4))
        order = draw(st.permutations(ids))
        owner = [draw(st.integers(0, workers - 1)) for _ in order]
        batches: list[list[list[str]]] = [[] for _ in range(workers)]
        for id, w in zip(order, owner):
            if batches[w] and len(batches[w][-1]) < 2 and draw(st.booleans()):
                batches[w][-1].append(id)
            else:
                batches[w].append([id])
        return Scenario(messages, draw(st.integers(1, 3)), [b for b in batches if b],
                        float(draw(st.sampled_from([5, 20, 60, 400]))),
                        frozenset(frozenset(p) for p in pairs if p[0] != p[1]))
    return build()


# --- the workers ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    id: str
    duplicate_of: str | None


class World:
    """The nodes, the clock and the record of what happened."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.shards = [Shard() for _ in range(scenario.shards)]
        self.now = 0.0
        self.commits: dict[str, int] = {}  # id -> the step its commit took effect
        self.seen: dict[str, dict[bytes, bytes | None]] = {}  # claimant -> what its lookup read of its fields
        self.step = 0

    def shard_of(self, bucket: int) -> int:
        return bucket % len(self.shards)

    def home_of(self, id: str) -> int:
        return sum(id.encode()) % len(self.shards)

    def apply(self, op: cl.Op) -> Any:
        shard = self.shards[op.shard]
        before = shard.home(op.id).state if isinstance(op, cl.Commit) else None
        reply = shard.apply(op, self.now, self.s.ttl, self.seen.get(op.id) if isinstance(op, cl.Claim) else None)
        if isinstance(op, cl.Commit) and before == cl.PENDING and reply.state == cl.COMMITTED:
            self.commits[op.id] = self.step
        return reply


class ModelChecks:
    """`claims.Checks` by the scenario's relation (the engine's verification, in the model)."""

    def __init__(self, world: World, claimants: Sequence[cl.Claimant]) -> None:
        self.world, self.claimants = world, claimants

    def similar(self, i: int, id: str, ts: float, blob: bytes) -> bool:
        return self.world.s.similar(self.claimants[i].id, id)

    def near(self, i: int, seen: cl.Seen, blob: bytes) -> Any:
        return seen.id if self.world.s.near(self.claimants[i].id, seen.id, seen.shared) else None

    def rank(self, i: int, columns: list[list[bytes | None]]) -> tuple[list[cl.Seen], set[str]]:
        c = self.claimants[i]
        found = rank_records(columns, list(range(len(c.fields))), c.id, 1, 1 << 30, -float("inf"), 1 << 30)
        seen = self.world.seen.get(c.id) if c.looked else None  # a record is new if its field did not hold it
        before = {(f, seq, id) for f, v in (seen or {}).items() for _, seq, id in parse_records(v or b"")}
        new = {id for j, f in enumerate(c.fields) for column in columns for _, seq, id in parse_records(column[j] or b"")
               if seen is None or (f, seq, id) not in before}
        return [cl.Seen(id, ts, shared, first) for id, shared, first, ts in found], new


Batch = Any  # a generator of rounds (lists of ops) that returns the batch's verdicts


def process(world: World, ids: list[str], resolver_class: type[cl.Resolver]) -> Batch:
    """One batch of one worker, as the spread index decides it: a lookup (one read per shard, then the
    homes of what it found), the batch against itself and what it found, the claims, the verdicts."""
    s = world.s
    msgs = [s.msg(id) for id in ids]
    fields = {m.id: tuple(field_name(k) for k in m.keys) for m in msgs}
    # The lookup: per shard, the batch's bucket fields there (atomic per shard, not across).
    by_shard: dict[int, list[bytes]] = {}
    for m in msgs:
        for k in m.keys:
            by_shard.setdefault(world.shard_of(k), []).append(field_name(k))
    reads = [cl.Read(sh, tuple(dict.fromkeys(fs))) for sh, fs in by_shard.items()]
    own = [cl.State(world.home_of(id), id, s.msg(id).ts) for id in ids]
    replies = yield [*reads, *own]
    values: dict[bytes, bytes | None] = {}
    for op, reply in zip(reads, replies):
        values.update(zip(op.fields, reply[0]))
    own_home = {op.id: reply for op, reply in zip(own, replies[len(reads):])}
    found: dict[str, list[cl.Seen]] = {}
    for m in msgs:
        column = [values[f] for f in fields[m.id]]
        ranked = rank_records([column], list(range(len(column))), m.id, 1, 1 << 30, -float("inf"), 1 << 30)
        found[m.id] = [cl.Seen(id, ts, shared, first) for id, shared, first, ts in ranked if id not in ids]
    others = sorted({seen.id: seen for seen_list in found.values() for seen in seen_list}.values(), key=lambda x: x.id)
    states = [cl.State(world.home_of(o.id), o.id, o.ts) for o in others]
    replies = yield states
    home = {op.id: reply for op, reply in zip(states, replies)}
    # The batch in order: a replay, a duplicate of a committed candidate, of an earlier one of the batch,
    # or a claimant (with the pending claims its lookup found).
    verdicts: dict[str, Verdict] = {}
    claimants: list[cl.Claimant] = []
    for m in msgs:
        if own_home[m.id].state == cl.COMMITTED:
            verdicts[m.id] = Verdict(m.id, None)
            continue
        dup = next((o.id for o in found[m.id] if home[o.id].state == cl.COMMITTED and s.near(m.id, o.id, o.shared)),
                   None)
        if dup is None:
            dup = next((c.id for c in claimants if s.near(m.id, c.id)), None)
        if dup is not None:
            verdicts[m.id] = Verdict(m.id, dup)
            continue
        groups: dict[int, list[bytes]] = {}
        for k in m.keys:
            groups.setdefault(world.shard_of(k), []).append(field_name(k))
        world.seen[m.id] = {f: values[f] for f in fields[m.id]}
        claimants.append(cl.Claimant(
            m.id, m.ts, m.id.encode(), fields[m.id], tuple((sh, tuple(fs)) for sh, fs in groups.items()),
            world.home_of(m.id), world.home_of, True, [o for o in found[m.id] if home[o.id].state == cl.PENDING]))
    # A duplicate now whose own home a previous attempt left pending releases it.
    stale = [cl.Abort(world.home_of(id), id, s.msg(id).ts) for id, v in verdicts.items()
             if v.duplicate_of is not None and own_home[id].state == cl.PENDING]
    if stale:
        yield stale
    resolver = resolver_class(claimants, ModelChecks(world, claimants), own=set(ids), clock=lambda: world.now / 1000,
                              ttl=s.ttl / 1000)
    run = resolver.run()
    try:
        round_ = next(run)
        while True:
            if round_.delay:
                yield ("sleep", round_.delay * 1000)
            round_ = run.send((yield round_.ops))
    except StopIteration as done:
        outcomes = done.value
    for c, outcome in zip(claimants, outcomes):
        verdicts[c.id] = Verdict(c.id, None if outcome.yielded is None else outcome.yielded[0])
    # A duplicate of an earlier message of the batch that yielded names what that one yielded to.
    for id in ids:
        target = verdicts[id].duplicate_of
        while target in verdicts and verdicts[target].duplicate_of is not None:
            target = verdicts[target].duplicate_of
        verdicts[id] = Verdict(id, target)
    return [verdicts[id] for id in ids]


@dataclass
class Worker:
    batches: list[list[str]]
    resolver_class: type[cl.Resolver]
    batch: Batch | None = None
    ids: list[str] = field(default_factory=list)
    ops: list[cl.Op] = field(default_factory=list)  # the round in flight: ops not executed yet
    replies: list[Any] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # where each reply goes
    sent: int = 0
    wake: float = 0.0
    dead: bool = False


def explore(scenario: Scenario, rng: random.Random, *, resolver_class: type[cl.Resolver] = cl.Resolver,
            crashes: int = 1, max_steps: int = 50_000, world: World | None = None) -> tuple[World, dict[str, Verdict]]:
    """Runs the scenario's workers with ops interleaved at random; returns the world and the verdicts."""
    world = world or World(scenario)
    workers = [Worker([list(b) for b in batches], resolver_class) for batches in scenario.batches]
    verdicts: dict[str, Verdict] = {}

    def advance(w: Worker, replies: list[Any] | None) -> None:
        """Starts w's next batch or gives its batch the replies of its last round; sets its next ops."""
        while True:
            try:
                if w.batch is None:
                    if not w.batches:
                        w.ops = []
                        return
                    w.ids = w.batches.pop(0)
                    w.batch = process(world, w.ids, resolver_class)
                    out = next(w.batch)
                else:
                    out = w.batch.send(replies)
            except StopIteration as done:
                for v in done.value:
                    verdicts[v.id] = v
                w.batch, replies = None, None
                continue
            if isinstance(out, tuple):  # ("sleep", ms)
                w.wake = world.now + out[1]
                replies = None
                continue
            w.ops, w.replies, w.sent = list(out), [None] * len(out), 0
            w.order = list(range(len(out)))
            rng.shuffle(w.order)  # the ops of a round reach their nodes in any order
            if not out:
                replies = []
                continue
            return

    for w in workers:
        advance(w, None)
    steps = 0
    while True:
        live = [w for w in workers if not w.dead and w.sent < len(w.ops)]
        if not live:
            break
        steps += 1
        assert steps < max_steps, "no progress: a claim waits forever"
        ready = [w for w in live if w.wake <= world.now]
        roll = rng.random()
        if not ready or roll < 0.05:  # time passes: sometimes long enough for claims to expire
            world.now = max(world.now + rng.choice([1.0, 1.0, scenario.ttl / 2, scenario.ttl * 2]),
                            min(w.wake for w in live) if not ready else 0.0)
            continue
        w = rng.choice(ready)
        if crashes and roll < 0.065 and w.batch is not None:  # kill -9: its batch goes to a new worker
            crashes -= 1
            w.dead = True
            workers.append(Worker([w.ids, *w.batches], resolver_class))
            advance(workers[-1], None)
            continue
        at = w.order[w.sent]
        world.step += 1
        world.now += 0.25
        w.replies[at] = world.apply(w.ops[at])
        w.sent += 1
        if w.sent == len(w.ops):
            advance(w, w.replies)
    return world, verdicts


def check(scenario: Scenario, world: World, verdicts: dict[str, Verdict]) -> None:
    """The guarantees (see the module's docstring)."""
    s = scenario
    assert set(verdicts) == {m.id for m in s.messages}, "a message was never decided"
    homes = {id: h for shard in world.shards for id, h in shard.homes.items()}
    assert not [id for id, h in homes.items() if h.deadline is not None], "a home was left pending"
    uniques = {id for id, v in verdicts.items() if v.duplicate_of is None}
    assert uniques == set(homes), (uniques, set(homes))
    for id, v in verdicts.items():
        if v.duplicate_of is not None:
            assert v.duplicate_of in uniques, (id, v)
    # Serializable: some order of the uniques decides each as unique, i.e. a unique that is a near-duplicate
    # of another comes before it, and these "before" edges make no cycle (of two mutual near-duplicates,
    # one only is unique).
    before = {u: {v for v in uniques if v != u and s.near(u, v)} for u in uniques}
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in before[u]:
            assert state.get(v) != 1, f"no order decides these as unique: {' -> '.join([*path, u, v])}"
            if v not in state:
                visit(v, [*path, u])
        state[u] = 2

    for u in sorted(uniques):
        if u not in state:
            visit(u, [])


def run_one(scenario: Scenario, seed: int, **options: Any) -> None:
    world, verdicts = explore(scenario, random.Random(seed), **options)
    check(scenario, world, verdicts)


# --- the tests ----------------------------------------------------------------------------------------------


# NEARDUP_MODEL_EXAMPLES=50000 explores longer (docs/design.md gives the figures of such a run).
EXAMPLES = int(os.environ.get("NEARDUP_MODEL_EXAMPLES", "400"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_any_interleaving_keeps_the_guarantees(scenario: Scenario, seed: int) -> None:
    run_one(scenario, seed)


def _spam_wave(copies: int, shards: int, seed: int) -> Scenario:
    """`copies` mutual near-duplicates (one group), each in its own worker, at the same event time."""
    rng = random.Random(seed)
    keys = [tuple(sorted([*rng.sample(range(12), 4), 12])) for _ in range(copies)]
    messages = [Msg(f"c{i}", 1.0, keys[i], 0, 1) for i in range(copies)]
    return Scenario(messages, shards, [[[m.id]] for m in messages], 30.0)


@pytest.mark.parametrize("shards", [2, 3, 6])
def test_a_wave_of_copies_racing_makes_exactly_one_unique(shards: int) -> None:
    """The race test's shape: a copy in every worker at the same moment, buckets over every shard."""
    for seed in range(300):
        scenario = _spam_wave(4, shards, seed)
        world, verdicts = explore(scenario, random.Random(seed))
        check(scenario, world, verdicts)
        assert sum(v.duplicate_of is None for v in verdicts.values()) == 1


# --- the model catches a broken protocol --------------------------------------------------------------------


class _NoNotes(cl.Resolver):
    """Broken: a claim never notes the later claims it found (it trusts them to find it)."""

    def _resolve(self, i: int) -> list[cl.Op]:
        for o in self.progress[i].others.values():
            o.noted = True
        return super()._resolve(i)


class _CommitOverNotes(cl.Resolver):
    """Broken: a commit ignores the notes its home holds (the compare-and-set compares nothing)."""

    def _own(self, i: int, home: cl.Home) -> None:
        if home.state == cl.PENDING:
            self.progress[i].seen_notes = 1 << 30
        super()._own(i, home)

    def _resolve(self, i: int) -> list[cl.Op]:
        self.progress[i].seen_notes = 1 << 30
        return super()._resolve(i)


class _WaitForLater(cl.Resolver):
    """Broken: a claim waits for the similar claims after it in the order, and notes those before it."""

    def _waits(self, i: int) -> list[Any]:
        c, p = self.claimants[i], self.progress[i]
        me = (c.ts, c.id)
        return [o for o in p.others.values() if o.state == cl.PENDING and (o.noter or (o.similar and o.order > me))]


class _CountOnce(cl.Resolver):
    """Broken: what a claim shares with another is counted once, even if that one was still appending its
    records (the first bug this model found: a duplicate committed as unique on a partial count)."""

    def _resolve(self, i: int) -> list[cl.Op]:
        for o in self.progress[i].others.values():
            o.full = True
        return super()._resolve(i)


class _IgnoreNoters(cl.Resolver):
    """Broken: a claim does not wait for the claims that noted it."""

    def _own(self, i: int, home: cl.Home) -> None:
        if home.state == cl.PENDING:
            home = cl.Home(home.state, home.blob, ())
            self.progress[i].seen_notes = 1 << 30
        super()._own(i, home)


def _first_failure(resolver_class: type[cl.Resolver], tries: int,
                   make: Callable[[random.Random], Scenario]) -> str | None:
    for seed in range(tries):
        rng = random.Random(seed)
        scenario = make(rng)
        try:
            run_one(scenario, seed, resolver_class=resolver_class)
        except AssertionError as exc:
            return f"seed {seed}: {exc}"
    return None


def _random_scenario(rng: random.Random) -> Scenario:
    """A wave of copies, or a few groups of messages with random keys, floors and event times."""
    if rng.random() < 0.5:
        return _spam_wave(rng.randint(2, 4), rng.randint(2, 3), rng.randrange(1 << 30))
    n, workers = rng.randint(3, 6), rng.randint(2, 4)
    messages = [Msg(f"m{i}", float(rng.randint(0, 2)), tuple(sorted(rng.sample(range(6), rng.randint(1, 3)))),
                    rng.randint(0, 1), rng.randint(1, 2)) for i in range(n)]
    batches: list[list[list[str]]] = [[] for _ in range(workers)]
    for m in messages:
        batches[rng.randrange(workers)].append([m.id])
    return Scenario(messages, rng.randint(1, 3), [b for b in batches if b], float(rng.choice([5, 30, 400])))


@pytest.mark.parametrize("broken", [_NoNotes, _CommitOverNotes, _WaitForLater, _CountOnce, _IgnoreNoters],
                         ids=lambda c: c.__name__.strip("_"))
def test_the_model_catches_a_broken_protocol(broken: type[cl.Resolver]) -> None:
    """Each break of one rule of the protocol is found within a few thousand random runs (the same runs
    pass with the protocol whole: `test_the_seeded_runs_pass`)."""
    failure = _first_failure(broken, 4000, _random_scenario)
    assert failure is not None, f"{broken.__name__} went unnoticed"


def test_the_seeded_runs_pass() -> None:
    assert _first_failure(cl.Resolver, 1000, _random_scenario) is None


def test_explored_interleavings_are_counted() -> None:
    """The explorer does interleave: one wave yields many distinct op orders (here, of 200 seeds)."""
    orders: Counter[tuple[str, ...]] = Counter()
    for seed in range(200):
        scenario = _spam_wave(3, 2, 7)
        world = World(scenario)
        trace: list[str] = []
        apply = world.apply

        def traced(op: cl.Op, _apply: Callable[[cl.Op], Any] = apply, _trace: list[str] = trace) -> Any:
            _trace.append(f"{type(op).__name__}:{getattr(op, 'id', op.shard)}")
            return _apply(op)

        world.apply = traced  # type: ignore[method-assign]
        explore(scenario, random.Random(seed), world=world)
        orders[tuple(trace)] += 1
    assert len(orders) > 150
