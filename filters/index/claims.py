"""The claim protocol of the spread index, the workers' half, without I/O: how a batch's unique messages are
decided when their buckets live on many Redis nodes (`filters/index/redis_spread.py` drives it with real
round trips, `tests/test_claim_model.py` with a model of the nodes and random interleavings).

An insert is atomic per node, not across nodes, so one message's insert is a *claim* in steps, each
atomic on one shard (a slot of the cluster): see docs/design.md, "The spread layout". In short, a claim

1. creates its **home** (`Create`): the message's entry and a pending state with a deadline in the home
   node's clock, in the shard its id hashes to. The home is the claim's one decision point: it ends
   committed (the message is unique; the pending state is deleted) or gone (the claim yielded to a
   committed near-duplicate, or was aborted because it expired), by a compare-and-set there.
2. appends its records to its buckets (`Claim`, one op per shard), each node saying whether any of
   them got a record the lookup did not see: a record always has a home created before it.
3. observes the other claims in its buckets: those its lookup found pending (the committed ones it
   found, the engine verified), and, if a bucket changed since the lookup (or this is a second attempt),
   those with a record newer than the lookup (`Read`), each counted with all the buckets it is in; their
   homes say what they are (`State`).
4. resolves, with (event time, id) as the order of claims: a committed near-duplicate makes it yield
   (`Abort` of its own home, then a duplicate of that one); a pending similar claim smaller in the order
   is waited for (`Poll`, which also aborts it once its deadline passed); a pending similar larger one is
   *noted* (`Note`: the note in its home makes it wait for this one before it commits); claims that
   noted this one are waited for too. Waits go only to smaller claims, so they cannot cycle.
5. commits (`Commit`): the compare-and-set succeeds if the home is still pending with no note it has
   not resolved; a new note sends it back to waiting; a home gone (expired and aborted, or lost in a
   failover) starts a new attempt, which observes everything afresh.

Two similar claims that share a bucket always meet: on that bucket's node one appended after the other,
and the later one either read the earlier's record in its lookup or found the bucket changed (a storage
that keeps a bucket in several places, as the spread layout's slices of event time, has its lookups and
observations cover every place a similar claim can write). The one
that meets the other either waits for it, notes it, or yields to it, so one of the two decides first
and the other sees that decision; by commit order, no unique is a near-duplicate of a unique committed
before it. "Similar" here is the verification without the floor of shared keys (`Checks.similar`),
symmetric, so the order holds whichever of the two found the other; a verdict uses the full rule
(`Checks.near`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

PENDING = "pending"
COMMITTED = "committed"
GONE = "gone"

Order = tuple[float, str]  # (event time, id): the order of claims, its tie-break

MAX_ATTEMPTS = 8  # a claim aborted this often (it kept expiring: claim_ttl far too short) raises
_POLL_FIRST, _POLL_MAX = 0.001, 0.032  # seconds between polls of the claims waited for


# --- what the nodes are asked, one op atomic on one shard --------------------------------------------


@dataclass(frozen=True, slots=True)
class Create:
    """Make `id`'s home pending (a fresh deadline; notes it holds are kept), unless it is committed."""

    shard: int
    id: str
    ts: float
    blob: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    """Append `id`'s record to its bucket `fields` of this shard; say whether any of them got a record that
    the claimant's lookup did not see (`check`; else nothing to compare with: changed). The driver knows
    what the lookup saw (the Redis index: the slices' marks, and the fields of a slice whose mark moved are
    compared in a script)."""

    shard: int
    id: str
    ts: float
    fields: tuple[bytes, ...]
    check: bool
    place: int = 0  # the claimant's place in its batch (its records rank by it among the batch's)


@dataclass(frozen=True, slots=True)
class Read:
    """The values of bucket `fields` of this shard, one list per slice read."""

    shard: int
    fields: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class State:
    """`id`'s home as it is (a plain read)."""

    shard: int
    id: str
    ts: float


@dataclass(frozen=True, slots=True)
class Note:
    """If `id`'s home is pending, add `by` to its notes (the home then waits for `by` before committing)."""

    shard: int
    id: str
    ts: float
    by: Order


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit `id`'s home if it is pending and holds no notes beyond the first `seen` (it has resolved)."""

    shard: int
    id: str
    ts: float
    seen: int


@dataclass(frozen=True, slots=True)
class Poll:
    """`id`'s home as it is, after aborting it (gone) if it is pending and its deadline passed."""

    shard: int
    id: str
    ts: float


@dataclass(frozen=True, slots=True)
class Refresh:
    """A fresh deadline for `id`'s own pending home; its state (and notes) as it is."""

    shard: int
    id: str
    ts: float


@dataclass(frozen=True, slots=True)
class Abort:
    """Delete `id`'s own home if it is pending (the claim yields); a committed one stays."""

    shard: int
    id: str
    ts: float


Op = Create | Claim | Read | State | Note | Commit | Poll | Refresh | Abort


@dataclass(frozen=True, slots=True)
class Home:
    """What a home op answers: the state, the entry's bytes (pending or committed) and the notes."""

    state: str  # PENDING | COMMITTED | GONE
    blob: bytes | None = None
    notes: tuple[Order, ...] = ()


CLAIM_SAME, CLAIM_CHANGED = 1, -1  # `Claim` replies (0: outside the window, nothing written)


@dataclass(frozen=True, slots=True)
class Round:
    """One round trip: ops for any shards, sent together, after `delay` seconds."""

    ops: list[Op]
    delay: float = 0.0


# --- what the protocol is given --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """Another claim one of ours observed: its order, and how many of our buckets hold it (and the first)."""

    id: str
    ts: float
    shared: int
    first: int


@dataclass(slots=True)
class Claimant:
    """A message to insert: its entry, its bucket fields and where things live, and what its lookup saw."""

    id: str
    ts: float
    blob: bytes
    fields: tuple[bytes, ...]  # its bucket fields, in key order
    groups: tuple[tuple[int, tuple[bytes, ...]], ...]  # its fields by shard: (shard, fields there)
    home: int  # the shard of its home
    home_of: Callable[[str], int]  # the shard of another id's home
    looked: bool  # its lookup read its buckets (what it saw is the driver's)
    pending: Sequence[Seen] = ()  # the pending claims its lookup found
    excluded: frozenset[str] = frozenset()  # committed claims the engine verified already and did not take


class Checks(Protocol):
    """The verification the protocol needs of the engine, for claimant `i` against another claim's entry."""

    def similar(self, i: int, id: str, ts: float, blob: bytes) -> bool:
        """Would the two verify as near-duplicates, whatever the keys they share (symmetric)?"""
        ...

    def near(self, i: int, seen: Seen, blob: bytes) -> Any:
        """The candidate claimant `i` is a duplicate of (by the engine's full rule), or None."""
        ...

    def rank(self, i: int, columns: list[list[bytes | None]]) -> tuple[list[Seen], set[str]]:
        """The claims recorded in claimant `i`'s buckets (`columns`: per slice read, per field), ranked,
        each with all the buckets it is in; and those of them with a record the claimant's lookup did not
        see (all of them if it was not looked up)."""
        ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a claim ended: committed (None), or yielded to committed near-duplicates (their candidates)."""

    yielded: list[Any] | None = None


class ClaimsExpired(Exception):
    """A claim was aborted `MAX_ATTEMPTS` times: its deadline keeps passing before it decides."""


# --- the protocol ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Other:
    """What one claimant knows of another claim."""

    id: str
    ts: float
    shared: int = 0
    first: int = 0
    state: str | None = None  # None: not read yet
    blob: bytes | None = None
    similar: bool | None = None
    noted: bool = False  # we noted it (it waits for us)
    noter: bool = False  # it noted us (we wait for it)
    # `shared` comes from a read of our buckets that began once all its records were written (we knew it
    # committed, or that it noted us: a claim commits and notes only after its records are in). A read
    # made while it was still appending counts only some of them.
    full: bool = False

    @property
    def order(self) -> Order:
        return (self.ts, self.id)


@dataclass(slots=True)
class _Progress:
    """One claimant's progress: its attempt, what it knows, where it stands."""

    attempt: int = 1
    step: str = "create"  # create | claim | observe | states | resolve | wait | done
    others: dict[str, _Other] = field(default_factory=dict)
    seen_notes: int = 0
    full: set[str] = field(default_factory=set)  # the others a read in flight counts in full
    outcome: Outcome | None = None
    refreshed: float = 0.0


class Resolver:
    """Decides a batch's claims together, each on its own (a claim never waits for another of the batch:
    they are decided against each other before, by the engine). `run` yields the rounds to send and is
    sent their replies (the ops' replies, in order); it returns one `Outcome` per claimant.

    `own`: the ids of the batch (never observed: the engine decided them against each other).
    `clock`: seconds, monotonic, for refreshing the deadlines of claims that wait; `ttl`: claim_ttl in
    seconds (a waiting claim refreshes its deadline every third of it)."""

    def __init__(self, claimants: Sequence[Claimant], checks: Checks, *, own: set[str],
                 clock: Callable[[], float], ttl: float) -> None:
        self.claimants = list(claimants)
        self.checks = checks
        self.own = own
        self.clock = clock
        self.ttl = ttl
        self.progress = [_Progress() for _ in self.claimants]

    def run(self) -> Generator[Round, list[Any], list[Outcome]]:
        poll = _POLL_FIRST
        while True:
            ops: list[Op] = []
            owners: list[int] = []
            for i, p in enumerate(self.progress):
                if p.step in ("wait", "done"):
                    continue
                mine = self._ops(i)
                ops += mine
                owners += [i] * len(mine)
            delay = 0.0
            if not ops:
                waiting = [i for i, p in enumerate(self.progress) if p.step == "wait"]
                if not waiting:
                    return [p.outcome or Outcome() for p in self.progress]
                for i in waiting:
                    mine = self._polls(i)
                    ops += mine
                    owners += [i] * len(mine)
                delay, poll = poll, min(2 * poll, _POLL_MAX)
            else:
                poll = _POLL_FIRST
            replies = yield Round(ops, delay)
            by_owner: dict[int, list[tuple[Op, Any]]] = {}
            for owner, op, reply in zip(owners, ops, replies, strict=True):
                by_owner.setdefault(owner, []).append((op, reply))
            for i, answered in by_owner.items():
                self._answered(i, answered)

    # -- the ops of a step ------------------------------------------------------------------------------
    def _ops(self, i: int) -> list[Op]:
        c, p = self.claimants[i], self.progress[i]
        if p.step == "create":
            return [Create(c.home, c.id, c.ts, c.blob)]
        if p.step == "claim":
            check = c.looked and p.attempt == 1
            return [Claim(s, c.id, c.ts, fs, check, i) for s, fs in c.groups]
        if p.step == "observe":
            return [Read(s, fs) for s, fs in c.groups]
        if p.step == "states":
            return [State(c.home_of(o.id), o.id, o.ts) for o in p.others.values() if o.state is None]
        if p.step == "resolve":
            return self._resolve(i)
        raise AssertionError(p.step)

    def _resolve(self, i: int) -> list[Op]:
        """The step after everything observed is known: yield, note, wait or commit."""
        c, p = self.claimants[i], self.progress[i]
        me = (c.ts, c.id)
        checks = self.checks
        for o in list(p.others.values()):
            if o.state == GONE:
                del p.others[o.id]
            elif o.similar is None and o.blob is not None:
                o.similar = checks.similar(i, o.id, o.ts, o.blob)
        committed = [o for o in p.others.values() if o.state == COMMITTED and o.id not in c.excluded]
        if any(o.similar and not o.full for o in committed):
            # A similar claim committed since we counted what we share with it: count again, from a read
            # of our buckets that begins now (all its records are in).
            p.step = "observe"
            p.full = {o.id for o in p.others.values() if o.state == COMMITTED or o.noter}
            return self._ops(i)
        near = []
        for o in sorted(committed, key=lambda o: (-o.shared, -o.ts, o.id)):
            if o.similar and o.shared:
                cand = checks.near(i, Seen(o.id, o.ts, o.shared, o.first), o.blob or b"")
                if cand is not None:
                    near.append(cand)
        if near:
            p.outcome = Outcome(near)
            return [Abort(c.home, c.id, c.ts)]
        notes = [o for o in p.others.values()
                 if o.state == PENDING and o.similar and not o.noted and not o.noter and o.order > me]
        if notes:
            return [Note(c.home_of(o.id), o.id, o.ts, me) for o in notes]
        if self._waits(i):
            p.step = "wait"
            p.refreshed = self.clock() if not p.refreshed else p.refreshed
            return []
        return [Commit(c.home, c.id, c.ts, p.seen_notes)]

    def _waits(self, i: int) -> list[_Other]:
        """The pending claims claimant `i` waits for: similar ones before it in the order, and those that
        noted it (always before it: a claim notes only later ones)."""
        c, p = self.claimants[i], self.progress[i]
        me = (c.ts, c.id)
        return [o for o in p.others.values() if o.state == PENDING and (o.noter or (o.similar and o.order < me))]

    def _polls(self, i: int) -> list[Op]:
        c, p = self.claimants[i], self.progress[i]
        ops: list[Op] = [Poll(c.home_of(o.id), o.id, o.ts) for o in self._waits(i)]
        if self.clock() - p.refreshed >= self.ttl / 3:
            ops.append(Refresh(c.home, c.id, c.ts))
            p.refreshed = self.clock()
        return ops

    # -- what the replies tell ---------------------------------------------------------------------------
    def _answered(self, i: int, answered: list[tuple[Op, Any]]) -> None:
        c, p = self.claimants[i], self.progress[i]
        step = p.step
        if step == "create":
            [(_, home)] = answered
            if home.state == COMMITTED:  # somebody committed this very id (a redelivery): a replay
                self._done(i, Outcome())
            else:
                p.step = "claim"
            return
        if step == "claim":
            for seen in c.pending:  # what the lookup saw pending; the rest it saw is verified already
                self._observe(p, seen)
            if p.attempt > 1 or any(reply != CLAIM_SAME and reply != 0 for _, reply in answered):
                p.step = "observe"  # and what arrived since the lookup
                p.full = {o.id for o in p.others.values() if o.state == COMMITTED or o.noter}
            else:
                p.step = "states"
                self._after_states(i)
            return
        if step == "observe":
            n_slices = max((len(reply) for _, reply in answered), default=0)
            columns: list[list[bytes | None]] = [[None] * len(c.fields) for _ in range(n_slices)]
            place = {f: j for j, f in enumerate(c.fields)}
            for op, reply in answered:
                assert isinstance(op, Read)
                for s, values in enumerate(reply):
                    for f, v in zip(op.fields, values, strict=True):
                        columns[s][place[f]] = v
            for o in p.others.values():
                o.shared, o.first = 0, 0  # counted afresh: absent now, it shares nothing
                o.full = o.full or o.id in p.full
            ranked, new = self.checks.rank(i, columns)
            for seen in ranked:
                if seen.id != c.id and seen.id not in self.own and (seen.id in new or seen.id in p.others):
                    self._observe(p, seen, counted=True)
            p.full = set()
            p.step = "states"
            self._after_states(i)
            return
        if step == "states":
            for op, home in answered:
                self._learn(p, op.id, home)  # type: ignore[union-attr]
            self._after_states(i)
            return
        if step == "resolve":
            self._resolved(i, answered)
            return
        if step == "wait":
            for op, home in answered:
                if not isinstance(op, Refresh):
                    self._learn(p, op.id, home)  # type: ignore[union-attr]
            for op, home in answered:
                if isinstance(op, Refresh):
                    self._own(i, home)  # may end the claim, or start a new attempt
            if self.progress[i] is p and p.step == "wait" and not self._waits(i):
                self._after_states(i)
            return
        raise AssertionError(step)

    def _resolved(self, i: int, answered: list[tuple[Op, Any]]) -> None:
        p = self.progress[i]
        kind = type(answered[0][0])
        if kind is Abort:
            [(_, home)] = answered
            # Our own home: gone (we yielded) or committed by a redelivery of the same id meanwhile.
            self._done(i, p.outcome if p.outcome is not None and home.state != COMMITTED else Outcome())
            return
        if kind is Note:
            for op, home in answered:
                o = p.others[op.id]  # type: ignore[union-attr]
                if home.state == PENDING:
                    o.noted = True
                else:
                    self._learn(p, o.id, home)
            self._after_states(i)
            return
        if kind is Commit:
            [(_, home)] = answered
            self._own(i, home)
            if self.progress[i] is p and p.step == "resolve":  # pending still: new notes, to wait for
                self._after_states(i)
            return
        raise AssertionError(kind)

    def _own(self, i: int, home: Home) -> None:
        """Our own home as a commit or refresh found it."""
        p = self.progress[i]
        if home.state == COMMITTED:
            self._done(i, Outcome())
        elif home.state == GONE:  # aborted (its deadline passed) or lost: a new attempt, from its home
            if p.attempt >= MAX_ATTEMPTS:
                raise ClaimsExpired(f"the claim of {self.claimants[i].id!r} was aborted {p.attempt} times")
            self.progress[i] = _Progress(attempt=p.attempt + 1)
        else:
            for ts, id in home.notes[p.seen_notes:]:
                o = p.others.get(id)
                if o is None:
                    o = p.others[id] = _Other(id, ts)
                o.noter = True
                o.full = False  # all its records are in now; our count may be older
                if o.state != COMMITTED:
                    o.state = None  # read it (its entry too)
            p.seen_notes = len(home.notes)

    def _observe(self, p: _Progress, seen: Seen, *, counted: bool = False) -> None:
        o = p.others.get(seen.id)
        if o is None:
            p.others[seen.id] = _Other(seen.id, seen.ts, seen.shared, seen.first)
            return
        if counted or not o.shared:
            o.shared, o.first = seen.shared, seen.first
        if o.state == PENDING:
            o.state = None  # read again: it may have decided

    @staticmethod
    def _learn(p: _Progress, id: str, home: Home) -> None:
        o = p.others[id]
        o.state = home.state
        if home.blob is not None:
            o.blob = home.blob

    def _after_states(self, i: int) -> None:
        p = self.progress[i]
        p.step = "states" if any(o.state is None for o in p.others.values()) else "resolve"

    def _done(self, i: int, outcome: Outcome) -> None:
        p = self.progress[i]
        p.outcome = outcome
        p.step = "done"


def drive(resolver: Resolver, execute: Callable[[Round], list[Any]]) -> list[Outcome]:
    """Runs `resolver` to the end, each round executed by `execute` (which returns the replies in order)."""
    run = resolver.run()
    try:
        round_ = next(run)
        while True:
            round_ = run.send(execute(round_))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
