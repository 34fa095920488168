"""The spread layout of the Redis index: one namespace over many slots of a Redis Cluster, so that one stream's
index grows with the cluster's masters (`redis+cluster://...?layout=spread`; docs/design.md, "The spread
layout").

Keys. The namespace is cut into `shards` (default 64); shard k's keys carry the hash tag
`{<prefix>:<namespace>:<n>}`, n chosen so that the tag's slot is the middle one of the k-th of `shards`
equal parts of the slots (`shard_tags`): equal ranges of slots, equal numbers of shards (to one). Per shard, the keys of the
slot layout (filters/index/redis.py): `{tag}:meta` (`seq`, `hwm`) and the event-time slices `{tag}:s:<n>`
with bucket records `b<key>` of the keys the shard holds (`bucket_shards`), entries `e<id>` of the ids
whose home it is (`home_shard`), claim states `c<id>` while a claim is undecided, and the slice's mark
`w` (moved by every call that writes records there).

Reading. A lookup reads, per shard it touches, the meta hash and one HMGET per slice of its mark, then of
every field the batch names there (its buckets, its own ids' entries and states), as one pipeline per node, all nodes at
once (`_Nodes.execute`); the replies are scattered into the columns the slot layout ranks, so ranking is
`rank_lookup`, as there. The candidates' homes (entry and state) are a second read: committed ones are
candidates, pending ones are claims the protocol must resolve; entries known committed are kept
(`entry_cache`) and not read again.

Inserting is the claim protocol (`filters.index.claims`): the `Resolver` says what to ask each shard, this
module asks it (`_round`: the home ops of a shard, and the insert's memos there, in one call of
`spread_home.lua`, its claims in one MULTI/EXEC of plain HSETs gated by `spread_append.lua` when no slice's
mark moved since the lookup, else in one call of `spread_claim.lua` (`_ClaimPlan`), reads as HMGETs), in one
round trip per round (two when a mark moved).

Fence. With the index changelog (`fenced`, as the slot layout's "Fence"), every shard's meta hash holds the
marker its guard set once the index held the changelog's window (`shard_meta_keys`; stream/changelog.py). A
lookup reads every shard's meta hash anyway: one without the marker lost its data (its master restarted empty
or failed over to a replica that had not synced it) and the lookup raises `IndexLost`, so no batch is decided
against a lost shard; a marker changed everywhere tells a rebuild by another worker. The reads that follow (the
candidates' homes, the claims' rounds) read the markers of their shards in the same pipeline (`_fenced`). A rebuild (a restore
while some shard lacks the marker) drops the namespace's keys on every master first and writes the window
again from the changelog. A round looked up before a loss may still write after it: its writes are noticed by
the next lookup (the shard has no marker) and dropped by the rebuild, which the round's entries reach through
the changelog or its worker's write-back.

Redirects. A reply MOVED (the slot has a new owner: failover, resharding), ASK (the slot is being migrated
and the keys are on the target) or TRYAGAIN (a script's keys are split between the two) means the command
did not run: it is sent again where the cluster says (`ASKING` first for ASK), TRYAGAIN after a short
wait; NOSCRIPT loads the script on that node. A node that does not answer fails the round as
`IndexUnavailable`, and the worker retries the batch (what was half done is taken over by the retry).
"""

from __future__ import annotations

import binascii
import math
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, cast

import mmh3
import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import AskError, ClusterDownError, NoScriptError, TryAgainError
from redis.retry import Retry

from filters.errors import ConfigError, IndexCorrupt, IndexLost, IndexUnavailable
from filters.index import Batch, Candidate, Entry, Memo, Query, Stored, Verifier, finish, new_candidate, new_entry
from filters.index import claims as cl
from filters.index.redis import (
    _NAME,
    DEFAULT_SOCKET_TIMEOUT,
    FIELDS_PER_HMGET,
    INSERT_CHUNK,
    MARKER,
    STAMP,
    RedisTarget,
    _event_time,
    _lua,
    _Script,
    high_marks,
    kept_ranking,
    one_marker,
    read_replies,
    redact_url,
    redis_errors,
)
from filters.index.redis_codec import (
    SEQ,
    decode_entries,
    decode_entry,
    decode_memo,
    encode_entries,
    encode_entry,
    encode_memo,
    entry_time,
    field_of,
    id_field,
    memo_time,
    parse_records,
    plan_fields,
    rank_lookup,
    rank_records,
    stored_entries,
    trim_records,
)
from filters.index.shared import AnsweredRounds, SharedDecider
from filters.records import Verdict

try:  # the compiled core; absent when it could not be built at install time (no C++ compiler)
    import filters._native as _native
except ImportError:  # pragma: no cover - exercised on machines without a compiler
    _native = None

__all__ = ["DEFAULT_CLAIM_TTL", "DEFAULT_SHARDS", "SpreadIndex", "bucket_shards", "home_shard", "shard_meta_keys",
           "shard_tags"]

DEFAULT_SHARDS = 64
MAX_SHARDS = 1024
DEFAULT_CLAIM_TTL = 5.0  # seconds a claim stays pending without its owner: what a dead worker can hold up
SLOTS = 16384
_MIX = 0x9E3779B97F4A7C15  # spreads the bucket keys (whose top bits name their method) over the shards
_HOME_SEED = 0x5EED  # mmh3 seed of an id's home shard
_PLACES = 1024  # a record's seq is at least its writer's clock in ms * _PLACES + its place in the batch
_REDIRECTS = 16  # MOVED/ASK hops a command may take in one round before the round fails
_TRY_AGAIN = 0.02  # seconds before a TRYAGAIN is sent again (a slot being migrated), up to 2 s in all

CLAIM_LUA = _lua("trim.lua", "spread_claim.lua")
APPEND_LUA = _lua("spread_append.lua")
HOME_LUA = _lua("spread_home.lua")
_CLAIM = _Script.of(CLAIM_LUA)
_APPEND = _Script.of(APPEND_LUA)
_HOME = _Script.of(HOME_LUA)
_RATE = 0.25  # weight of a round in the average of spread_append.lua's successes
_PROBE = 8  # a round in this many tries spread_append.lua whatever the average
_STATE = {b"C": cl.COMMITTED, b"P": cl.PENDING, b"G": cl.GONE}
_NOTE = struct.Struct("<dI")  # a note: the noter's event time and id length, then its id
_RECORD = struct.Struct("<dI")  # a bucket record: event time, id length; then the id and the seq
_SEEN = struct.Struct(">I")  # what a lookup saw of a field in a slice: its length, then its last 8 bytes (the seq)
_UNSEEN = bytes(12)  # ... of a field absent there
_SECTION = struct.Struct(">iI")  # spread_claim.lua's layout: a slice written to, its number of entries
_ENTRY = struct.Struct(">BHH")  # ... an entry: compared or not, its numbers of fields seen and not seen there


@dataclass(frozen=True, slots=True)
class _Put:
    """A restored entry, written committed at once at its home (`restore`), unless its id is there."""

    shard: int
    id: str
    ts: float
    blob: bytes


@dataclass(frozen=True, slots=True)
class _Memo:
    """A duplicate's verdict, written at its id's home in the slice of its event time (`insert`)."""

    shard: int
    id: str
    ts: float
    blob: bytes


_OP_CODES: dict[type, int] = {cl.Create: 1, cl.Note: 2, cl.Commit: 3, cl.Poll: 4, cl.Refresh: 5, cl.Abort: 6, _Put: 7,
                              _Memo: 8}
_HOME_OP = struct.Struct("<BHdI")  # spread_home.lua's numbers of an op: code, key, event time, notes seen


# --- where things live ---------------------------------------------------------------------------------


def _glob_escape(text: str) -> str:
    """`text` matched as it is by a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def key_slot(key: bytes) -> int:
    """Redis Cluster's slot of a key without a hash tag (CRC16/XMODEM mod 16384)."""
    return binascii.crc_hqx(key, 0) % SLOTS


def shard_tags(prefix: str, namespace: str, shards: int) -> list[str]:
    """Shard k's hash tag: `<prefix>:<namespace>:<n>` with the first n whose slot is the middle slot of the
    k-th of `shards` equal parts of the slots (so a master holding a range of slots holds the shards whose
    middle slot it holds). One pass over n finds them all (about 16,384 x ln(shards) tries)."""
    wanted = {(2 * k + 1) * SLOTS // (2 * shards): k for k in range(shards)}
    tags: dict[int, str] = {}
    n = 0
    while len(tags) < shards:
        tag = f"{prefix}:{namespace}:{n}"
        k = wanted.get(key_slot(tag.encode()))
        if k is not None and k not in tags:
            tags[k] = tag
        n += 1
    return [tags[k] for k in range(shards)]


def shard_meta_keys(target: RedisTarget, namespace: str) -> list[str]:
    """The meta hash of every shard of `namespace` (each holds a fenced index's marker)."""
    return [f"{{{tag}}}:meta" for tag in shard_tags(target.prefix, namespace, _options(target)[0])]


def bucket_shards(keys: np.ndarray, shards: int) -> np.ndarray:
    """The shard of each bucket key (uint64): its key multiplied by a 64-bit odd constant, top 32 bits
    scaled to `shards`."""
    mixed = keys.astype(np.uint64, copy=False) * np.uint64(_MIX)
    return ((mixed >> np.uint64(32)) * np.uint64(shards)) >> np.uint64(32)


def bucket_shard(key: int, shards: int) -> int:
    return ((((key * _MIX) & 0xFFFFFFFFFFFFFFFF) >> 32) * shards) >> 32


def home_shard(id: str, shards: int) -> int:
    """The shard of an id's home (its entry and claim state)."""
    return (mmh3.hash(id.encode("utf-8", "surrogatepass"), _HOME_SEED, signed=False) * shards) >> 32


def _options(target: RedisTarget) -> tuple[int, float]:
    shards, claim_ttl = DEFAULT_SHARDS, DEFAULT_CLAIM_TTL
    for name, value in target.spread:
        try:
            if name == "shards":
                shards = int(value)
            else:
                claim_ttl = float(value)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if not 1 <= shards <= MAX_SHARDS:
        raise ConfigError(f"shards must be from 1 to {MAX_SHARDS}, got {shards}")
    if not (math.isfinite(claim_ttl) and claim_ttl > 0):
        raise ConfigError(f"claim_ttl must be > 0 seconds, got {claim_ttl}")
    return shards, claim_ttl


# --- the nodes -----------------------------------------------------------------------------------------


class _Nodes:
    """Round trips to the nodes that serve the namespace's slots: each command names its slot; one
    pipeline per node, all sent before any is read. On standalone Redis, one node serves every slot."""

    def __init__(self, client: redis.Redis | RedisCluster, where: str) -> None:
        self.client = client
        self.where = where
        self.conns: dict[str, Any] = {}  # node name -> its connection, kept for the index's round trips
        self.stale = False  # the slot map must be read again before the next round
        self.redirects: Counter[str] = Counter()  # MOVED, ASK, TRYAGAIN, NOSCRIPT replies followed
        self.cluster = isinstance(client, RedisCluster)
        # A share of other work (the engine's next batch) to run while replies are on their way.
        self.meanwhile: Callable[[], bool] | None = None

    def node_name(self, slot: int) -> str:
        """The name of the node that serves `slot` as the client knows it ("" on standalone Redis)."""
        return self._node(slot)[0]

    def _node(self, slot: int) -> tuple[str, Any]:
        if not self.cluster:
            return "", None
        node = self.client.nodes_manager.get_node_from_slot(slot)  # type: ignore[union-attr]
        return node.name, node

    def _conn(self, name: str, node: Any) -> Any:
        conn = self.conns.get(name)
        if conn is None:
            client: Any = node.redis_connection if node is not None else self.client
            if client is None:  # a node the client has not connected to yet
                client = cast(RedisCluster, self.client).get_redis_connection(node)
            conn = self.conns[name] = client.connection_pool.get_connection()
        return conn

    def _ask_node(self, host: str, port: int) -> tuple[str, Any]:
        manager = cast(RedisCluster, self.client).nodes_manager
        node = manager.get_node(host, port)
        if node is None:
            manager.initialize()
            node = manager.get_node(host, port)
            if node is None:
                raise IndexUnavailable(f"Redis index at {self.where}: ASK to unknown node {host}:{port}")
        return node.name, node

    def execute(self, commands: Sequence[tuple[int, Sequence[Any] | _Transaction]], scripts: dict[bytes, str],
                resent: set[int] | None = None) -> list[Any]:
        """Runs (slot, command) pairs, each where its slot is served, in one round trip per node (more if
        redirected); returns the replies in order (error replies raised, after redirects are followed).
        `scripts`: sha -> source of the scripts the commands may run (loaded on NOSCRIPT); `resent` gets
        the commands that ran only when sent again (so after the others)."""
        with redis_errors(self.where):
            if self.stale and isinstance(self.client, RedisCluster):
                self.client.nodes_manager.initialize()
                self.stale = False
            replies: list[Any] = [None] * len(commands)
            todo = list(range(len(commands)))
            asked: dict[int, tuple[str, Any]] = {}  # command -> the node an ASK sent it to
            sent_to: dict[int, tuple[str, Any]] = {}
            hops = 0
            waited = 0.0
            while todo:
                groups: dict[str, tuple[Any, list[int]]] = {}
                nodes: dict[int, tuple[str, Any]] = {}  # slot -> its node, this pass
                for i in todo:
                    if i in asked:
                        name, node = sent_to[i] = asked[i]
                    else:
                        slot = commands[i][0]
                        where = nodes.get(slot)
                        if where is None:
                            where = nodes[slot] = self._node(slot)
                        name, node = sent_to[i] = where
                    groups.setdefault(name, (node, []))[1].append(i)
                sent = []
                try:
                    for name, (node, at) in groups.items():
                        conn = self._conn(name, node)
                        packed: list[Sequence[Any]] = []
                        for i in at:
                            if i in asked:
                                packed.append(("ASKING",))
                            command = commands[i][1]
                            if isinstance(command, _Transaction):
                                packed += [("MULTI",), *command.commands, ("EXEC",)]
                            else:
                                packed.append(command)
                        _send(conn, packed)
                        sent.append((name, conn, at))
                    if self.meanwhile is not None and self.meanwhile():
                        self.meanwhile = None
                    for _, conn, at in sent:
                        sizes = [_size(commands[i][1]) for i in at]
                        if asked:
                            for i, size in zip(at, sizes):
                                if i in asked:
                                    read_replies(conn, 1)[0]  # ASKING's OK
                                replies[i] = read_replies(conn, 1)[0] if size == 1 else _exec_reply(read_replies(conn, size))
                        else:
                            got = read_replies(conn, sum(sizes))
                            p = 0
                            for i, size in zip(at, sizes):
                                replies[i] = got[p] if size == 1 else _exec_reply(got[p : p + size])
                                p += size
                except BaseException:
                    self.drop()
                    raise
                again, moved, retry = [], False, False
                for i in todo:
                    reply = replies[i]
                    command = commands[i][1]
                    if isinstance(command, _Transaction) and isinstance(reply, list):
                        for c, r in zip(command.commands, reply, strict=True):
                            if isinstance(r, NoScriptError):  # its gate wrote nothing: loaded for the next one
                                self._reload(sent_to[i][0], c, scripts)
                        continue
                    if isinstance(reply, NoScriptError):  # to the same node again (ASKING too, if asked)
                        self._reload(sent_to[i][0], cast(Sequence[Any], command), scripts)
                        again.append(i)
                        continue
                    asked.pop(i, None)
                    if isinstance(reply, TryAgainError):
                        self.redirects["TRYAGAIN"] += 1
                        retry = True
                        again.append(i)
                    elif isinstance(reply, AskError) and not _is_moved(reply):
                        self.redirects["ASK"] += 1
                        asked[i] = self._ask_node(reply.host, reply.port)
                        again.append(i)
                    elif isinstance(reply, AskError):
                        self.redirects["MOVED"] += 1
                        moved = True
                        again.append(i)
                if again:
                    if resent is not None:
                        resent.update(again)
                    hops += 1
                    if hops > _REDIRECTS or waited > 2.0:
                        raise IndexUnavailable(f"Redis index at {self.where}: still redirected after {hops} hops "
                                               f"(resharding or failover in progress)")
                    if moved and isinstance(self.client, RedisCluster):
                        self.client.nodes_manager.initialize()
                    if retry:
                        time.sleep(_TRY_AGAIN)
                        waited += _TRY_AGAIN
                todo = again
            for reply in replies:
                if isinstance(reply, Exception):
                    if isinstance(reply, ClusterDownError):
                        self.stale = True
                    raise reply
            return replies

    def _reload(self, name: str, evalsha: Sequence[Any], scripts: dict[bytes, str]) -> None:
        """The script of `evalsha` (an EVALSHA node `name` answered NOSCRIPT) loaded there, and counted."""
        self.redirects["NOSCRIPT"] += 1
        sha = evalsha[1]
        self._load(name, scripts[sha if isinstance(sha, bytes) else sha.encode()])

    def _load(self, name: str, source: str) -> None:
        conn = self.conns[name]
        try:
            _send(conn, [("SCRIPT", "LOAD", source)])
            reply = read_replies(conn, 1)[0]
        except BaseException:
            self.drop()
            raise
        if isinstance(reply, Exception):
            raise reply

    def drop(self) -> None:
        """Forgets every kept connection (replies may still be on their way on one) and the slot map."""
        for conn in self.conns.values():
            conn.disconnect()
        self.conns.clear()
        self.stale = True

    def close(self) -> None:
        self.drop()
        self.client.close()


@dataclass(frozen=True, slots=True)
class _Transaction:
    """Commands sent as one MULTI/EXEC (`_Nodes.execute`). Its reply is EXEC's list of replies, or None when
    Redis refused the transaction (a key moved or a slot being migrated, out of memory: any command refused
    when queued): then nothing of it ran, and nothing is sent again."""

    commands: tuple[Sequence[Any], ...]


def _size(command: Sequence[Any] | _Transaction) -> int:
    """The replies a command takes: MULTI's, each command's (QUEUED) and EXEC's for a transaction."""
    return len(command.commands) + 2 if isinstance(command, _Transaction) else 1


def _exec_reply(replies: list[Any]) -> list[Any] | None:
    return replies[-1] if isinstance(replies[-1], list) else None


def _is_moved(reply: AskError) -> bool:
    return type(reply).__name__ == "MovedError"


def _send(conn: Any, commands: Sequence[Sequence[Any]]) -> None:
    if _native is not None:
        conn.send_packed_command([_native.pack_commands(list(commands))])
    else:
        conn.send_packed_command(conn.pack_commands(list(commands)))


# --- what a lookup leaves for the inserts ---------------------------------------------------------------


@dataclass(slots=True)
class _View:
    """What the last lookup read that its inserts need: the values of every field it read (a column per
    slice, a place per field), and each query's fields, their places and their shards."""

    slices: tuple[int, ...] = ()
    columns: list[list[bytes | None]] = field(default_factory=list)
    at: dict[bytes, int] = field(default_factory=dict)  # field -> its place in the columns
    looked: dict[str, int] = field(default_factory=dict)  # id -> its query's number
    keys_of: list[tuple[int, ...]] = field(default_factory=list)
    fields_of: list[list[bytes]] = field(default_factory=list)
    shards_of: list[list[int]] = field(default_factory=list)
    pending: dict[str, list[cl.Seen]] = field(default_factory=dict)  # id -> the pending claims its lookup found
    own_pending: set[str] = field(default_factory=set)  # ids whose own home an earlier attempt left pending
    candidates: dict[str, set[str]] = field(default_factory=dict)  # id -> the committed candidates it was given
    returned: dict[str, set[str]] = field(default_factory=dict)  # id -> committed claims returned as conflicts
    # (shard, slice) -> the mark `w` the lookup read there (0: none), read before its fields (spread_claim.lua)
    slice_marks: dict[tuple[int, int], int] = field(default_factory=dict)


# --- the index ----------------------------------------------------------------------------------------------


class SpreadIndex:
    """`CandidateIndex` on a namespace spread over the slots of a Redis Cluster (or over one Redis), shared
    by any number of workers. One instance is used by one thread at a time (`stats` excepted)."""

    def __init__(self, url: str, *, window: float, bucket_cap: int, namespace: str, fenced: bool = False) -> None:
        """`fenced`: lookups require the marker an index changelog keeps in every shard (see "Fence" above)."""
        if not window > 0 or bucket_cap < 1:
            raise ConfigError("window must be > 0 seconds and bucket_cap >= 1")
        if not _NAME.fullmatch(namespace):
            raise ConfigError(f"namespace must match {_NAME.pattern}, got {namespace!r}")
        target = RedisTarget.parse(url)
        self.shards, self.claim_ttl = _options(target)
        self.window = float(window)
        self.slice_length = self.window
        self.bucket_cap = bucket_cap
        self.namespace = namespace
        self.prefix = target.prefix
        self.fenced = fenced
        self._marker = b""  # the marker every shard held at the last lookup (fenced)
        self._metas_kept = -math.inf  # when the lookups last renewed the shards' meta hashes' TTLs (fenced)
        self._where = redact_url(url)
        self.tags = shard_tags(target.prefix, namespace, self.shards)
        self._slots = [key_slot(tag.encode()) for tag in self.tags]
        self._shard_at = {slot: k for k, slot in enumerate(self._slots)}  # (every shard's slot is its own)
        self._ttl_ms = max(1, round((self.window + target.grace) * 1000))
        self._hwm = -math.inf  # the highest event time this instance decided (as the slot layout's)
        self._top = -math.inf  # the highest event time stored, as the shards' marks last said
        # The window's clock (`expire`); None until a caller sets it, and then the newest event time stored
        # stands for it (as in the slot layout).
        self._clock: float | None = None
        self._memos: list[_Memo] = []  # memos the insert in progress has still to write
        self._gone = -math.inf  # the last slice this instance unlinked (as left the window)
        self._stamp = 0  # the last round's clock (ms), increasing: the seqs of its records (`_ClaimPlan`)
        self._view = _View()
        # How often spread_append.lua found no mark moved, lately (an exponential average): below one half
        # (workers writing the same shards at once), claims go to spread_claim.lua at once, but every
        # `_PROBE`-th round.
        self._append_rate = 1.0
        self._rounds = 0
        self._known: dict[tuple[str, float], Entry] = {}  # committed entries read or written lately
        self._known_cap = target.entry_cache
        self._decider = SharedDecider()
        self._engine: _Engine | None = None  # set by `decide` for its inserts: the engine's verification
        self._rank_all = kept_ranking("rank_lookup", rank_lookup)
        self._rank = _native.rank_records if _native is not None else rank_records
        self._plan = _native.plan_fields if _native is not None else plan_fields
        self._decode = _native.decode_entries if _native is not None else decode_entries
        self._encode = _native.encode_entries if _native is not None else encode_entries
        options: dict[str, Any] = {"decode_responses": False, "retry": Retry(NoBackoff(), 0)}
        for name in ("socket_timeout", "socket_connect_timeout"):
            if name not in target.client_url:
                options[name] = DEFAULT_SOCKET_TIMEOUT
        try:
            with redis_errors(self._where):
                client: redis.Redis | RedisCluster
                if target.cluster:
                    client = RedisCluster.from_url(target.client_url, **options)
                else:
                    client = redis.Redis.from_url(target.client_url, **options)
                    pool = client.connection_pool
                    pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"Redis index URL {self._where}: {exc}") from exc
        self._nodes = _Nodes(client, self._where)
        self._scripts = {script.sha.encode(): script.source for script in (_CLAIM, _APPEND, _HOME)}

    # -- CandidateIndex ----------------------------------------------------------------------------------
    compiled_table = False
    in_process = False

    def decide(self, batch: Batch, verifier: Verifier) -> list[Verdict]:
        """`SharedDecider`'s rounds, with the engine's verification given to the claims; then a message that
        is a duplicate now releases the claim an earlier attempt of it left pending."""
        self._nodes.meanwhile = batch.meanwhile
        try:
            verdicts = self._decider.decide(_Rounds(self, batch, verifier), batch, verifier)
            stale = [m for m, v in zip(batch.messages, verdicts) if v.duplicate and m.id in self._view.own_pending]
            if stale:
                self._ops([cl.Abort(self._home(m.id), m.id, m.ts) for m in stale])
        finally:
            left, self._nodes.meanwhile = self._nodes.meanwhile, None
            self._engine = None
        finish(left)
        return verdicts

    def prefetch(self, queries: Sequence[Query]) -> None:
        """No read goes ahead on the spread layout (its reads are cheap per node; see docs/design.md)."""

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        if not queries:
            self._view = _View()
            return []
        marks = high_marks(queries, self._hwm, self.slice_length)
        hwm = marks[-1]
        ids = [q.id for q in queries]
        keys_of = [q.keys for q in queries]
        names, key_fields, positions, id_places = self._plan(keys_of, [id_field(id) for id in ids])
        state_places = list(range(len(names), len(names) + len(ids)))
        names = [*names, *(b"c" + f[1:] for f in (id_field(id) for id in ids))]
        shard_of = np.empty(len(names), dtype=np.int64)
        flat_keys = np.fromiter((k for keys in keys_of for k in keys), dtype=np.uint64)
        flat_places = np.fromiter((p for places in positions for p in places), dtype=np.int64)
        key_shards = bucket_shards(flat_keys, self.shards).astype(np.int64)
        shard_of[flat_places] = key_shards
        ends = np.cumsum([len(keys) for keys in keys_of]).tolist()
        flat = key_shards.tolist()
        shards_of = [flat[end - len(keys) : end] for keys, end in zip(keys_of, ends)]
        homes = [self._home(id) for id in ids]
        shard_of[np.asarray(id_places, dtype=np.int64)] = homes
        shard_of[np.asarray(id_places, dtype=np.int64) + 1] = homes  # its memo field (`plan_fields`)
        shard_of[np.asarray(state_places, dtype=np.int64)] = homes
        # The slice after the high-water mark's too: a near-duplicate up to a window after the batch's newest message
        # is written there (a slice is a window long), and a claim that reads its mark finds it moved if another
        # worker wrote there meanwhile (one racing across a slice boundary would be unseen by both otherwise).
        slices, columns, stored, slice_marks = self._read_fields(names, shard_of, self._slices(marks[0], hwm + self.window),
                                                                 marks[0], hwm)
        self._hwm = hwm
        self._top = max(self._top, stored)
        found = self._rank_all(columns, positions, id_places, ids, [q.min_shared for q in queries], limit,
                               [mark - self.window for mark in marks], self.bucket_cap, entry_time, memo_time)
        own_pending = {id for id, p in zip(ids, state_places) if any(column[p] is not None for column in columns)}
        homes_found = self._homes({(id, ts) for _, _, ranked in found for id, _, _, ts in ranked})
        view = _View(slices, columns, {name: p for p, name in enumerate(names)}, dict(zip(ids, range(len(ids)))),
                     keys_of, key_fields, shards_of, own_pending=own_pending, slice_marks=slice_marks)
        out: list[tuple[Entry | Verdict | None, list[Candidate]]] = []
        for q, (own, memo, ranked) in zip(queries, found):
            cands: list[Candidate] = []
            pending: list[cl.Seen] = []
            for id, shared, first, ts in ranked:
                state, entry = homes_found.get((id, ts), (cl.GONE, None))
                if state == cl.COMMITTED and entry is not None:
                    cands.append(new_candidate(entry, shared, q.keys[first]))
                elif state == cl.PENDING:
                    pending.append(cl.Seen(id, ts, shared, first))
            if pending:
                view.pending[q.id] = pending
            view.candidates[q.id] = {c.entry.id for c in cands}
            replay = own is not None and q.id not in own_pending
            out.append((decode_entry(own, q.id) if replay else None if memo is None else decode_memo(memo, q.id), cands))
        self._view = view
        self._unlink_gone()
        return out

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        """See `CandidateIndex.insert`: each entry is claimed (`filters.index.claims`). None: committed (or
        its id was, a replay); else the committed claims it yielded to, which its verification must take
        (with `decide`'s verification, those it is a near-duplicate of; without, every committed claim
        that reached its buckets since its lookup, and the engine verifies them: a claim not taken is not
        returned again). The memos are written at their ids' homes with the first round trip of the claims, by
        the calls of spread_home.lua there (or by calls of their own); if it raises, some may have been
        written, as in the slot layout."""
        self._memos = self._memo_ops(memos)
        try:
            out: list[list[Candidate] | None] = []
            for at in range(0, len(entries), INSERT_CHUNK):
                out.extend(self._claim(entries[at : at + INSERT_CHUNK]))
            if self._memos:
                self._ops([])
        finally:
            self._memos = []
        return out

    def _memo_ops(self, memos: Sequence[Memo]) -> list[_Memo]:
        """The writes of `memos` in the slices of their event times at their ids' homes (spread_home.lua renews
        each slice's TTL and moves its memo count, for `stats`); a memo outside the window is left out."""
        horizon = self._hwm - self.window
        out = []
        for verdict, ts in memos:
            ts = _event_time(ts, verdict.id, self.slice_length)
            if ts >= horizon:
                out.append(_Memo(self._home(verdict.id), verdict.id, ts, encode_memo(verdict, ts)))
        return out

    def restore(self, parts: Iterable[Stored], *, rebuild: bytes = b"") -> int:
        """See `CandidateIndex.restore`: entries written committed at once (home, then records), unchecked. A
        rebuild (`rebuild`, by the guard's lock holder) of a fenced index whose shards do not all hold the
        marker drops what its shards hold first (a shard lost its data, so every shard's part of the window
        comes again from the changelog; and a rebuild that died left entries at their homes whose records it
        had not written, which a put of the same id would skip). A write-back never drops: another worker may
        be rebuilding meanwhile, and what it adds to a lost index is dropped by that index's rebuild."""
        if rebuild and self.fenced:
            markers = self._nodes.execute([(self._slots[k], ("HGET", f"{{{tag}}}:meta", MARKER))
                                           for k, tag in enumerate(self.tags)], self._scripts)
            if one_marker(markers) is None:
                self._drop()
                # The guard's stamp went with the meta hashes: again, so that its marker finds what it set.
                self._nodes.execute([(self._slots[k], c) for k, tag in enumerate(self.tags)
                                     for c in (("HSET", f"{{{tag}}}:meta", STAMP, rebuild),
                                               ("PEXPIRE", f"{{{tag}}}:meta", self._ttl_ms))], self._scripts)
        return sum(self._restore_entries(stored_entries(stored)) for stored in parts)

    def _drop(self) -> None:
        """Unlinks every key of the namespace's shards (`{<prefix>:<namespace>:<n>}...`), on every master."""
        client = self._nodes.client
        pattern = _glob_escape(f"{{{self.prefix}:{self.namespace}:") + "*"
        with redis_errors(self._where):
            keys = list(client.scan_iter(match=pattern, count=1000))  # (on a cluster: every master's)
            for a in range(0, len(keys), 500):
                client.unlink(*keys[a : a + 500])  # (on a cluster, redis-py splits them by slot)
        self._known, self._view, self._top, self._gone = {}, _View(), -math.inf, -math.inf

    def _restore_entries(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> int:
        written = 0
        for at in range(0, len(entries), INSERT_CHUNK):
            chunk = [(e, keys) for e, keys in entries[at : at + INSERT_CHUNK]
                     if _event_time(e.ts, e.id, self.slice_length) >= self._hwm - self.window]
            if not chunk:
                continue
            blobs = self._encode(list(chunk), encode_entry)
            by_shard: dict[int, list[tuple[Entry, bytes]]] = {}
            for (entry, _), blob in zip(chunk, blobs):
                by_shard.setdefault(self._home(entry.id), []).append((entry, blob))
            commands, order = [], []
            for shard, items in by_shard.items():
                puts: list[Any] = [_Put(shard, e.id, float(e.ts), blob) for e, blob in items]
                commands.append((self._slots[shard], self._home_call(shard, puts)))
                order += [e.id for e, _ in items]
            replies = self._nodes.execute(commands, self._scripts)
            put = {id for id, r in zip(order, (r for reply in replies for r in reply)) if r == 1}
            fresh = [(e, keys) for e, keys in chunk if e.id in put]
            ops = [op for e, keys in fresh for op in self._claim_ops(e, keys)]
            if ops:
                self._ops(ops)
            written += len(fresh)
            self._remember(e for e, _ in fresh)
        return written

    def expire(self, now: float) -> int:
        """Sets the window's clock to `now` (it only moves forward): the slice wholly older than `now - window`
        may go. Redis forgets by slice (see `RedisIndex.expire`): 0."""
        self._clock = now if self._clock is None else max(self._clock, now)
        return 0

    def stats(self) -> dict[str, int]:
        """`entries` (committed), `buckets` and `memos` in the live slices of every shard (a bucket with records in
        two slices counts twice; claim states count as buckets; counters and marks do not); `inserted` is
        `entries` (the shards have no common counter)."""
        nodes = _Nodes(self._nodes.client, self._where)  # its own connections: any thread may call this
        try:
            metas = nodes.execute([(self._slots[k], ("HGET", f"{{{tag}}}:meta", "hwm")) for k, tag in enumerate(self.tags)],
                                  {})
            top = max((float(h) for h in metas if h is not None), default=-math.inf)
            commands = [(self._slots[k], c) for k in range(self.shards) for s in self._slices(top, top)
                        for c in (("HLEN", self._slice_key(k, s)), ("HMGET", self._slice_key(k, s), "n", "m", "w"))]
            replies = nodes.execute(commands, {}) if commands else []
        finally:
            for conn in nodes.conns.values():
                conn.disconnect()
        fields = sum(replies[0::2])
        counts = [c for triple in replies[1::2] for c in triple]
        entries = sum(int(n) for n in counts[0::3] if n is not None)
        memos = sum(int(m) for m in counts[1::3] if m is not None)
        counters = sum(c is not None for c in counts)
        return {"entries": entries, "buckets": max(0, fields - entries - memos - counters), "memos": memos,
                "inserted": entries}

    def close(self) -> None:
        self._nodes.close()

    def __repr__(self) -> str:
        return f"SpreadIndex({self._where!r}, namespace={self.namespace!r}, shards={self.shards})"

    # -- where ------------------------------------------------------------------------------------------
    def _home(self, id: str) -> int:
        return home_shard(id, self.shards)

    def _slice(self, ts: float) -> int:
        return math.floor(ts / self.slice_length)

    def _slice_key(self, shard: int, s: int) -> str:
        return f"{{{self.tags[shard]}}}:s:{s}"

    def _held_key(self, shard: int, s: int) -> str:
        """Where spread_append.lua's transaction holds a slice while it blocks writes there (never outside it)."""
        return f"{{{self.tags[shard]}}}:held:{s}"

    def _slices(self, low_mark: float, high_mark: float) -> tuple[int, ...]:
        if not math.isfinite(high_mark):
            return ()
        low = low_mark if math.isfinite(low_mark) else high_mark
        return tuple(range(self._slice(low - self.window), self._slice(high_mark) + 1))

    # -- reading -----------------------------------------------------------------------------------------
    def _read_fields(self, names: list[bytes], shard_of: np.ndarray, slices: tuple[int, ...], low_mark: float,
                     high_mark: float) -> tuple[tuple[int, ...], list[list[bytes | None]], float, dict[tuple[int, int], int]]:
        """The values of `names` (each in its shard) in `slices`, the highest high-water mark of the shards and
        the mark of each (shard, slice) read; more slices if a mark shows records beyond them."""
        order = np.argsort(shard_of, kind="stable")
        bounds = np.searchsorted(shard_of[order], np.arange(self.shards + 1))
        groups = [(k, order[bounds[k] : bounds[k + 1]]) for k in range(self.shards) if bounds[k + 1] > bounds[k]]
        plan = [(k, places, [names[p] for p in places.tolist()]) for k, places in groups]
        stored, columns, slice_marks = self._read_groups(plan, slices, len(names))
        need = self._slices(low_mark, max(high_mark, stored))
        if not set(need) <= set(slices):
            slices = tuple(sorted(set(slices) | set(need)))
            stored2, columns, slice_marks = self._read_groups(plan, slices, len(names))
            stored = max(stored, stored2)
        return slices, columns, stored, slice_marks

    def _read_groups(self, plan: list[tuple[int, np.ndarray, list[bytes]]], slices: Sequence[int],
                     n: int) -> tuple[float, list[list[bytes | None]], dict[tuple[int, int], int]]:
        # Every shard's high-water mark (the namespace's is the highest), then the fields, each (shard, slice)'s
        # mark `w` first: a call of spread_claim.lua or spread_append.lua that wrote there after any of its
        # fields was read moved it.
        meta: tuple[Any, ...] = ("hwm", MARKER) if self.fenced else ("hwm",)
        commands: list[tuple[int, Sequence[Any]]] = [(self._slots[k], ("HMGET", f"{{{tag}}}:meta", *meta))
                                                     for k, tag in enumerate(self.tags)]
        step = FIELDS_PER_HMGET
        for k, _, fields in plan:
            slot = self._slots[k]
            for s in slices:
                key = self._slice_key(k, s)
                commands.append((slot, ("HMGET", key, b"w", *fields[:step])))
                commands += [(slot, ("HMGET", key, *fields[a : a + step])) for a in range(step, len(fields), step)]
        if self.fenced and time.monotonic() - self._metas_kept >= self._ttl_ms / 4000:
            # A shard's meta hash (its marker with it) lives by the writes of the ids whose home it is; a shard
            # few ids of a quiet stream home to would lose it with nothing lost. Lookups renew them all, a few
            # times a TTL (a lost shard's is not made again: PEXPIRE of no key). (Replies after the reads'.)
            self._metas_kept = time.monotonic()
            commands += [(self._slots[k], ("PEXPIRE", f"{{{tag}}}:meta", self._ttl_ms)) for k, tag in enumerate(self.tags)]
        replies = iter(self._nodes.execute(commands, self._scripts))
        arrays = [np.empty(n, dtype=object) for _ in slices]
        states = list(islice(replies, self.shards))
        if self.fenced:
            self._check_marker([state[1] for state in states])
        stored = max((float(state[0]) for state in states if state[0] is not None), default=-math.inf)
        slice_marks: dict[tuple[int, int], int] = {}
        for k, places, fields in plan:
            for s, array in zip(slices, arrays):
                first = next(replies)
                slice_marks[(k, s)] = int(first[0] or 0)
                values: list[Any] = first[1:]
                for _ in range(1, -(-len(fields) // step)):
                    values.extend(next(replies))
                array[places] = np.fromiter(values, dtype=object, count=len(values))
        return stored, [array.tolist() for array in arrays], slice_marks

    def _check_marker(self, found: Sequence[bytes | None]) -> None:
        """Raises `IndexLost` unless every shard holds the marker (see "Fence"): one without it lost its data
        (its master restarted empty, or failed over to a replica that had not synced it; FLUSHALL) or is being
        rebuilt; every one with another marker than at the last lookup, the index was rebuilt since."""
        marker = one_marker(found)
        if marker is None:
            missing = sum(m is None for m in found)
            self._marker = b""  # the loss is told (the caller rebuilds or waits): the next marker is taken as it is
            raise IndexLost(f"the Redis index at {self._where} holds no marker in {missing or 'some'} of its "
                            f"{self.shards} shards ({MARKER} of their meta hashes): their data was lost, or the index "
                            "is being rebuilt from the changelog")
        rebuilt = bool(self._marker) and marker != self._marker
        self._marker = marker
        if rebuilt:
            # As in the slot layout: the rebuild read the changelog before this worker committed its last batches;
            # told once, so that the worker writes them back before deciding anything against the index.
            raise IndexLost(f"the Redis index at {self._where} was rebuilt since this worker's last batch (its "
                            f"shards' marker {MARKER} changed)")

    def _homes(self, wanted: Iterable[tuple[str, float]]) -> dict[tuple[str, float], tuple[str, Entry | None]]:
        """The state and entry of the homes named by (id, event time): committed entries kept lately are
        not read again."""
        out: dict[tuple[str, float], tuple[str, Entry | None]] = {}
        read: dict[tuple[int, int], list[tuple[str, float]]] = {}
        for id, ts in wanted:
            entry = self._known.get((id, ts))
            if entry is not None:
                out[(id, ts)] = (cl.COMMITTED, entry)
            else:
                read.setdefault((self._home(id), self._slice(ts)), []).append((id, ts))
        if not read:
            return out
        groups = list(read.items())
        commands = [(self._slots[k], ("HMGET", self._slice_key(k, s), *(f for id, _ in items
                                                                         for f in (id_field(id), b"c" + id_field(id)[1:]))))
                    for (k, s), items in groups]
        replies = self._fenced(commands)
        committed: list[Entry] = []
        for (_, items), values in zip(groups, replies):
            blobs = values[0::2]
            entries = self._decode([id for id, _ in items], blobs, new_entry, decode_entry)
            for (id, ts), blob, state in zip(items, blobs, values[1::2]):
                if blob is None or entries[id].ts != ts:  # none, or another claim of the id
                    out[(id, ts)] = (cl.GONE, None)
                elif state is None:
                    out[(id, ts)] = (cl.COMMITTED, entries[id])
                    committed.append(entries[id])
                else:
                    out[(id, ts)] = (cl.PENDING, entries[id])
        self._remember(committed)
        return out

    def _remember(self, entries: Iterable[Entry]) -> None:
        cap = self._known_cap
        if not cap:
            return
        known = self._known
        known.update({(entry.id, float(entry.ts)): entry for entry in entries})
        if len(known) > cap + cap // 4:
            self._known = dict(islice(known.items(), len(known) - cap, None))

    def _unlink_gone(self) -> None:
        """Unlinks, in every shard, the slice wholly older than the window of the clock (once per slice): the
        caller's (`expire`), else the newest event time stored or decided."""
        clock = max(self._hwm, self._top) if self._clock is None else self._clock
        if not math.isfinite(clock):
            return
        gone = self._slice(clock - self.window) - 1
        if gone <= self._gone:
            return
        self._gone = gone
        self._nodes.execute([(self._slots[k], ("UNLINK", self._slice_key(k, gone))) for k in range(self.shards)],
                            self._scripts)

    # -- claiming ----------------------------------------------------------------------------------------
    def _claim(self, entries: Sequence[tuple[Entry, tuple[int, ...]]]) -> list[list[Candidate] | None]:
        # Nothing to do for an entry outside the window (it could never match), nor for an id again in the
        # call while its earlier entry is live (as the slot layout's script decides, with the mark moving
        # entry by entry): as for a replay.
        hwm, kept, skip = self._hwm, dict[str, float](), set[int]()
        for j, (entry, _) in enumerate(entries):
            ts = _event_time(entry.ts, entry.id, self.slice_length)
            earlier = kept.get(entry.id)
            if earlier is not None and earlier >= hwm - self.window:
                skip.add(j)
                continue
            hwm = max(hwm, ts)
            if ts < hwm - self.window:
                skip.add(j)
            else:
                kept[entry.id] = ts
        if skip:
            claimed = iter(self._claim([e for j, e in enumerate(entries) if j not in skip]) if len(skip) < len(entries)
                           else ())
            return [None if j in skip else next(claimed) for j in range(len(entries))]
        view = self._view
        blobs = self._encode(list(entries), encode_entry)
        batch_ids = {e.id for e, _ in entries}
        claimants = []
        for (entry, keys), blob in zip(entries, blobs):
            q = view.looked.get(entry.id)
            looked = q is not None and (view.keys_of[q] is keys or view.keys_of[q] == keys)
            if looked:
                assert q is not None
                fields, shards = view.fields_of[q], view.shards_of[q]
            else:
                fields, shards = [field_of(k) for k in keys], [bucket_shard(k, self.shards) for k in keys]
            groups: dict[int, list[bytes]] = {}
            for f, shard in zip(fields, shards):
                groups.setdefault(shard, []).append(f)
            pending = [s for s in view.pending.get(entry.id, ()) if s.id not in batch_ids]
            excluded = view.returned.get(entry.id, set()) | view.candidates.get(entry.id, set())
            claimants.append(cl.Claimant(entry.id, float(entry.ts), blob, tuple(fields),
                                         tuple((shard, tuple(fs)) for shard, fs in groups.items()),
                                         self._home(entry.id), self._home, looked, pending, frozenset(excluded)))
        checks = _Checks(self, self._engine, entries, claimants, [c.looked for c in claimants])
        resolver = cl.Resolver(claimants, checks, own=batch_ids, clock=time.monotonic, ttl=self.claim_ttl)
        try:
            outcomes = cl.drive(resolver, self._round)
        except cl.ClaimsExpired as exc:
            raise IndexUnavailable(f"Redis index at {self._where}: {exc} (claim_ttl {self.claim_ttl} s too short?)") from exc
        out: list[list[Candidate] | None] = []
        for (entry, _), outcome in zip(entries, outcomes):
            if outcome.yielded is None:
                self._remember([entry])
                out.append(None)
            else:
                view.returned.setdefault(entry.id, set()).update(c.entry.id for c in outcome.yielded)
                out.append(outcome.yielded)
        return out

    def _claim_ops(self, entry: Entry, keys: Sequence[int]) -> list[cl.Op]:
        by_shard: dict[int, list[bytes]] = {}
        for k in keys:
            by_shard.setdefault(bucket_shard(k, self.shards), []).append(field_of(k))
        return [cl.Claim(s, entry.id, float(entry.ts), tuple(fs), False) for s, fs in by_shard.items()]

    def _round(self, round_: cl.Round) -> list[Any]:
        if round_.delay:
            time.sleep(round_.delay)
        return self._ops(round_.ops, fence=True)

    def _fenced(self, commands: Sequence[tuple[int, Sequence[Any] | _Transaction]], fence: bool = True) -> list[Any]:
        """`commands` ((slot, command)) in one round trip per node (`_Nodes.execute`). `fence` (a fenced index
        deciding: the lookup's second read, a claim's rounds): the marker of a shard on each node is read in the
        same pipeline, after the node's commands, and must be the one the lookup found; else `IndexLost` before any reply is
        used. A master restarted empty breaks its connections, so a marker read on one came after any loss its
        replies saw; without this, the entries of a lost shard read as gone and the batch was decided unique."""
        if not (fence and self.fenced) or not commands:
            return self._nodes.execute(commands, self._scripts)
        # One shard's marker a node: what this guards against after the lookup (which read every shard's) is a
        # master restarted empty or flushed, which takes every shard it serves. (Planned on the client's slot map:
        # a round redirected to another node meanwhile, a resharding, is checked by the next lookup.)
        first: dict[str, int] = {}
        for slot in {slot for slot, _ in commands}:
            first.setdefault(self._nodes.node_name(slot), self._shard_at[slot])
        shards = list(first.values())
        marks = [(self._slots[k], ("HGET", f"{{{self.tags[k]}}}:meta", MARKER)) for k in shards]
        replies = self._nodes.execute([*commands, *marks], self._scripts)
        found = replies[len(commands) :]
        if not self._marker or any(m != self._marker for m in found):
            missing = sum(m is None for m in found)
            self._marker = b""  # the loss is told (the caller rebuilds or waits): the next marker is taken as it is
            raise IndexLost(f"the Redis index at {self._where} holds no marker in {missing} of the {len(shards)} shards "
                            f"a round read, or another than its lookup found: their data was lost, or the index was "
                            "rebuilt meanwhile")
        return replies[: len(commands)]

    def _ops(self, ops: Sequence[cl.Op], fence: bool = False) -> list[Any]:
        """Runs a round's ops in one round trip per node: per shard, its home ops and the insert's memos still to
        write in one call of spread_home.lua, its claims in one transaction gated by spread_append.lua or one
        call of spread_claim.lua (`_ClaimPlan`), its reads as HMGETs. Returns the replies in the order of `ops`."""
        homes: dict[int, list[int]] = {}
        claims: list[int] = []
        reads: list[int] = []
        self._stamp = max(time.time_ns() // 1_000_000, self._stamp + 1)  # this round's records' stamp
        n = len(ops)
        memos, self._memos = self._memos, []  # the insert's memos go with its first round trip, in the home calls
        if memos:
            ops = [*ops, *cast(list[Any], memos)]
        for i, op in enumerate(ops):
            if isinstance(op, cl.Claim):
                claims.append(i)
            elif isinstance(op, (cl.Read, cl.State)):
                reads.append(i)
            else:
                homes.setdefault(op.shard, []).append(i)
        commands: list[tuple[int, Sequence[Any] | _Transaction]] = []
        takes: list[tuple[str, list[int]]] = []  # per command: what it answers
        for shard, at in homes.items():
            commands.append((self._slots[shard], self._home_call(shard, [ops[i] for i in at])))
            takes.append(("home", at))
        # A claim observes its buckets in every slice its lookup read (and the live ones now, with the one after).
        slices = tuple(sorted({*self._view.slices, *self._slices(self._hwm, self._hwm + self.window)})) if reads else ()
        for i in reads:
            op = ops[i]
            if isinstance(op, cl.Read):
                for s in slices:
                    commands.append((self._slots[op.shard], ("HMGET", self._slice_key(op.shard, s), *op.fields)))
                takes.append(("read", [i]))
            else:
                assert isinstance(op, cl.State)
                f = id_field(op.id)
                commands.append((self._slots[op.shard], ("HMGET", self._slice_key(op.shard, self._slice(op.ts)),
                                                         f, b"c" + f[1:])))
                takes.append(("state", [i]))
        self._rounds += 1
        fast = self._append_rate >= 0.5 or self._rounds % _PROBE == 0
        plan = _ClaimPlan(self, [(i, cast(cl.Claim, ops[i])) for i in claims], fast) if claims else None
        if plan is not None:
            commands += plan.commands
        replies = self._fenced(commands, fence)
        out: list[Any] = [None] * len(ops)
        it = iter(replies[: len(replies) - (len(plan.commands) if plan is not None else 0)])
        for kind, at in takes:
            if kind == "home":  # a flat list: three values an op, one a memo's
                flat, p = next(it), 0
                for i in at:
                    if i < n:
                        out[i] = _home_reply(flat[p : p + 3])
                        p += 3
                    else:
                        p += 1
                if p != len(flat):
                    raise IndexCorrupt(f"spread_home.lua answered {len(flat)} values for {len(at)} ops")
            elif kind == "read":
                out[at[0]] = [next(it) for _ in slices]
            else:
                blob, state = next(it)
                out[at[0]] = _state(blob, state, cast(cl.State, ops[at[0]]).ts)
        if plan is not None:
            results, again, answers = plan.results(replies[len(replies) - len(plan.commands) :])
            if again:  # others wrote where the records go since the lookup: compared field by field
                for claims_of, reply in zip(answers, self._fenced(again, fence), strict=True):
                    results.update(plan.answer(claims_of, reply))
            appended = len(plan.commands) - sum(shard < 0 for shard, _ in plan.order)
            if appended:
                self._append_rate += _RATE * ((appended - len(again)) / appended - self._append_rate)
            for i, result in results.items():
                out[i] = result
        return out[:n]

    def _home_call(self, shard: int, ops: Sequence[Any]) -> tuple[Any, ...]:
        # The live slices first (a create or put looks for its id in each), then those the ops name.
        live = self._slices(self._hwm, self._hwm) if math.isfinite(self._hwm) else ()
        keys = [f"{{{self.tags[shard]}}}:meta", *(self._slice_key(shard, s) for s in live)]
        at = {key: n for n, key in enumerate(keys, 1)}
        horizon = self._hwm - self.window  # an entry at or after it is live (as in the slot layout's insert)
        created = [op.ts for op in ops if isinstance(op, (cl.Create, _Put))]
        args: list[Any] = [round(self.claim_ttl * 1000), self._ttl_ms, repr(horizon) if math.isfinite(horizon) else "-inf",
                           len(live), repr(max(created)) if created else ""]
        layout: list[bytes] = []
        for op in ops:
            key = self._slice_key(shard, self._slice(op.ts))
            if key not in at:
                at[key] = len(keys) + 1
                keys.append(key)
            layout.append(_HOME_OP.pack(_OP_CODES[type(op)], at[key], op.ts, op.seen if isinstance(op, cl.Commit) else 0))
            args.append(op.id.encode("utf-8", "surrogatepass"))
            if isinstance(op, (cl.Create, _Put, _Memo)):
                args.append(op.blob)
            elif isinstance(op, cl.Note):
                raw = op.by[1].encode("utf-8", "surrogatepass")
                args.append(_NOTE.pack(op.by[0], len(raw)) + raw)
        args.insert(5, b"".join(layout))
        return ("EVALSHA", _HOME.sha, len(keys), *keys, *args)


class _ClaimPlan:
    """The commands of a round's claims, and how their replies answer them: per shard, one call with every
    claim of the round there, in the round's order (so that the records of a field are too). A claim is
    compared with what its lookup saw of its fields (the values, and each slice's mark), unless it has
    nothing to compare with (not looked up, a field the lookup did not read, a second attempt): then it
    changed. When every claim of a shard is compared and its lookup read the slice it writes to, the
    values its records make are computed here and written as plain HSETs in a transaction that
    spread_append.lua lets write if no mark moved since the lookup (`fast`); else (a mark moved: others
    wrote there meanwhile), and for the other shards, spread_claim.lua appends the records and compares
    field by field."""

    def __init__(self, index: SpreadIndex, claims: Sequence[tuple[int, cl.Claim]], fast: bool) -> None:
        self.index = index
        view = index._view
        base = index._stamp * _PLACES
        made: dict[tuple[str, int], bytes] = {}  # a claimant's record is the same in all its shards
        at, columns, slices = view.at, view.columns, view.slices
        column_of = {s: c for c, s in enumerate(slices)}
        slice_of = index._slice
        # shard -> target slice -> [(claim, record, compared, fields it saw in the target slice, the others)]
        self.calls: dict[int, dict[int, list[tuple[int, bytes, bool, list[bytes], list[bytes]]]]] = {}
        for i, op in claims:
            record = made.get((op.id, op.place))
            if record is None:
                raw = op.id.encode("utf-8", "surrogatepass")
                record = made[(op.id, op.place)] = (_RECORD.pack(op.ts, len(raw)) + raw
                                                    + SEQ.pack(base + op.place % _PLACES))
            target = slice_of(op.ts)
            check = op.check and all(f in at for f in op.fields)
            if check:
                c = column_of.get(target)
                old: list[bytes] = []
                fresh: list[bytes] = []
                for f in op.fields:  # a field the lookup read as absent is fresh
                    (fresh if c is not None and columns[c][at[f]] is None else old).append(f)
            else:
                old, fresh = list(op.fields), []
            self.calls.setdefault(op.shard, {}).setdefault(target, []).append((i, record, check, old, fresh))
        self.commands: list[tuple[int, Sequence[Any] | _Transaction]] = []
        self.order: list[tuple[int, list[int]]] = []  # per command: its shard (-1: spread_claim.lua), its claims
        for shard, sections in self.calls.items():
            marks = [view.slice_marks.get((shard, s)) for s in slices]
            if (fast and None not in marks and all(target in column_of for target in sections)
                    and all(check for entries in sections.values() for _, _, check, _, _ in entries)):
                self.commands.append((index._slots[shard], self._append(shard, sections, cast(list[int], marks))))
                self.order.append((shard, [i for entries in sections.values() for i, *_ in entries]))
            else:
                self.commands.append((index._slots[shard], self._claim(shard, sections)))
                self.order.append((-1, [i for entries in sections.values() for i, *_ in entries]))

    def _keys(self, shard: int, sections: Iterable[int]) -> tuple[int, list[str]]:
        slices = self.index._view.slices
        lo, hi = min([*slices, *sections]), max([*slices, *sections])
        return lo, [self.index._slice_key(shard, s) for s in range(lo, hi + 1)]

    def _append(self, shard: int, sections: dict[int, list[tuple[int, bytes, bool, list[bytes], list[bytes]]]],
                marks: list[int]) -> _Transaction:
        """spread_append.lua's transaction (see the script): the slices written to blocked, the script (the gate:
        it unblocks them if no mark moved), an HSET per slice written to of the values the records make of what
        the lookup read (as spread_claim.lua makes them: a record's seq is above its field's last, the field
        trimmed to `bucket_cap` records once it holds twice as many), the slices still blocked put back."""
        index, view = self.index, self.index._view
        at, columns, slices = view.at, view.columns, view.slices
        cap = index.bucket_cap
        lo, keys = self._keys(shard, sections)
        m = len(keys)  # slice s's key is keys[s - lo], its holding key keys[m + s - lo]
        keys += [index._held_key(shard, s) for s in range(lo, lo + m)]
        writes: list[Sequence[Any]] = []
        for target, entries in sections.items():
            column = columns[slices.index(target)]
            values: dict[bytes, bytes] = {}
            for _, record, _, old, fresh in entries:
                seq = SEQ.unpack_from(record, len(record) - 8)[0]
                for f in (*old, *fresh):
                    v = values.get(f)
                    if v is None:
                        v = column[at[f]]
                    if v is None:
                        values[f] = record
                        continue
                    last = SEQ.unpack_from(v, len(v) - 8)[0]
                    r = record if last < seq else record[:-8] + SEQ.pack(last + 1)
                    values[f] = (trim_records(v, cap) if len(v) > 2 * cap * len(r) else v) + r
            writes.append(("HSET", keys[target - lo], *(x for pair in values.items() for x in pair)))
        held = [(keys[s - lo], keys[m + s - lo]) for s in sections]
        return _Transaction((
            *(c for key, aside in held for c in (("RENAME", key, aside), ("SET", key, "blocked"))),
            ("EVALSHA", _APPEND.sha, len(keys), *keys, index._ttl_ms, lo, len(slices), *slices, *marks, len(held),
             *sections),
            *writes,
            *(c for key, aside in held for c in (("GETDEL", key), ("RENAMENX", aside, key)))))

    def _claim(self, shard: int, sections: dict[int, list[tuple[int, bytes, bool, list[bytes], list[bytes]]]]
               ) -> tuple[Any, ...]:
        """spread_claim.lua's call."""
        index, view = self.index, self.index._view
        at, columns, slices = view.at, view.columns, view.slices
        unseen = _UNSEEN * len(slices)
        lo, keys = self._keys(shard, sections)
        seen: list[bytes] = []
        layout: list[bytes] = []
        records: list[Any] = []
        for target, entries in sections.items():
            layout.append(_SECTION.pack(target, len(entries)))
            for _, record, check, old, fresh in entries:
                layout.append(_ENTRY.pack(check, len(old), len(fresh)))
                records += (record, *old, *fresh)
                if check:
                    for f in (*old, *fresh):
                        p = at[f]
                        seen.append(b"".join(_SEEN.pack(len(v)) + v[-8:] if v is not None else _UNSEEN
                                             for v in (column[p] for column in columns))
                                    if any(column[p] is not None for column in columns) else unseen)
        marks = [view.slice_marks.get((shard, s), -1) for s in slices]
        return ("EVALSHA", _CLAIM.sha, len(keys), *keys, index.bucket_cap, index._ttl_ms, lo, len(slices), *slices,
                *marks, b"".join(seen), b"".join(layout), *records)

    def results(self, replies: Sequence[Any]
                ) -> tuple[dict[int, int], list[tuple[int, Sequence[Any] | _Transaction]], list[list[int]]]:
        """Each claim's reply (CLAIM_SAME or CLAIM_CHANGED) but those of the shards whose spread_append.lua
        found a mark moved: their spread_claim.lua calls (to send), and the claims each answers."""
        out: dict[int, int] = {}
        again: list[tuple[int, Sequence[Any] | _Transaction]] = []
        answers: list[list[int]] = []
        for (shard, claims), reply in zip(self.order, replies, strict=True):
            if shard < 0:
                out.update(self.answer(claims, reply))
            elif _appended(reply, len(self.calls[shard])):
                out.update((i, cl.CLAIM_SAME) for i in claims)
            else:
                again.append((self.index._slots[shard], self._claim(shard, self.calls[shard])))
                answers.append(claims)
        return out, again, answers

    @staticmethod
    def answer(claims: list[int], reply: Sequence[Any]) -> dict[int, int]:
        """The claims of a spread_claim.lua call, by its reply."""
        return {i: cl.CLAIM_SAME if result == cl.CLAIM_SAME else cl.CLAIM_CHANGED
                for i, result in zip(claims, reply, strict=True)}


def _appended(reply: list[Any] | None, slices: int) -> bool:
    """Whether a transaction of spread_append.lua writing to `slices` slices wrote (its gate found every mark
    the lookup read): False if Redis refused it, or the gate did not let its HSETs write (nothing written).
    The commands around the gate fail as they may (a RENAME of a slice that is not there, a GETDEL of a slice
    that is a hash again); the HSETs fail only if blocked."""
    if reply is None:
        return False
    gate, writes = reply[2 * slices], reply[2 * slices + 1 : 3 * slices + 1]
    if gate == 1 and any(isinstance(r, Exception) for r in writes):
        raise IndexCorrupt(f"spread_append.lua's writes failed: {[r for r in writes if isinstance(r, Exception)]}")
    return bool(gate == 1)


def _home_reply(reply: Any) -> cl.Home:
    state, blob, notes = reply
    return cl.Home(_STATE[state], blob or None, _parse_notes(notes))


def _parse_notes(notes: bytes) -> tuple[cl.Order, ...]:
    out = []
    pos = 0
    try:
        while pos < len(notes):
            ts, n = _NOTE.unpack_from(notes, pos)
            pos += _NOTE.size
            out.append((ts, notes[pos : pos + n].decode("utf-8", "surrogatepass")))
            pos += n
    except Exception as exc:
        raise IndexCorrupt(f"a claim's notes are not notes: {notes[:64]!r}") from exc
    return tuple(out)


def _state(blob: bytes | None, state: bytes | None, ts: float) -> cl.Home:
    """A home as read (its entry field and state field), for the claim of its id at event time `ts`."""
    if blob is None or entry_time(blob, "") != ts:  # none, or another claim of the id
        return cl.Home(cl.GONE)
    if state is None:
        return cl.Home(cl.COMMITTED, blob)
    # 'Q', its deadline, its entry's event time, its notes; 'P', its deadline, its notes: an older version's
    return cl.Home(cl.PENDING, blob, _parse_notes(state[9:] if state[:1] == b"P" else state[17:]))


# --- the verification the claims need ---------------------------------------------------------------------


class _Engine:
    """The engine's verification for the claims of `decide`'s batch (by message id)."""

    def __init__(self, index: SpreadIndex, batch: Batch, verifier: Verifier) -> None:
        self.index = index
        self.verifier = verifier
        self.by_id = {m.id: (m, fp) for m, fp in zip(batch.messages, batch.prepared)}


class _Checks:
    """`claims.Checks` for one call of `_claim` (claimant i is entries[i]): the engine's verification when
    `decide` gave it; else (`insert` called on its own) every claim is similar, so the order of claims holds
    whatever the verification, and every committed claim that reached a looked-up entry's buckets since its
    lookup is returned for the engine to verify, as the slot layout returns conflicts (an entry its lookup
    did not cover is a plain insert: nothing is returned for it)."""

    def __init__(self, index: SpreadIndex, engine: _Engine | None, entries: Sequence[tuple[Entry, tuple[int, ...]]],
                 claimants: Sequence[cl.Claimant], looked: Sequence[bool]) -> None:
        self.index, self.engine, self.entries, self.claimants, self.looked = index, engine, entries, claimants, looked

    def _candidate(self, i: int, id: str, blob: bytes, shared: int, first: int) -> Candidate:
        keys = self.entries[i][1]
        return new_candidate(decode_entry(blob, id), shared, keys[min(first, len(keys) - 1)])

    def similar(self, i: int, id: str, ts: float, blob: bytes) -> bool:
        if self.engine is None:
            return True
        msg, fp = self.engine.by_id[self.entries[i][0].id]
        cand = self._candidate(i, id, blob, len(fp.keys), 0)
        return self.engine.verifier.first_match(msg, fp, [cand]).duplicate

    def near(self, i: int, seen: cl.Seen, blob: bytes) -> Any:
        if self.engine is None:
            return self._candidate(i, seen.id, blob, seen.shared, seen.first) if self.looked[i] else None
        msg, fp = self.engine.by_id[self.entries[i][0].id]
        cand = self._candidate(i, seen.id, blob, seen.shared, seen.first)
        return cand if self.engine.verifier.first_match(msg, fp, [cand]).duplicate else None

    def rank(self, i: int, columns: list[list[bytes | None]]) -> tuple[list[cl.Seen], set[str]]:
        """Every claim in the claimant's buckets inside the window (the newest `bucket_cap` of each bucket),
        with all the buckets it is in; and the ids with a record that the claimant's lookup did not see in
        that bucket."""
        index, c = self.index, self.claimants[i]
        horizon = max(c.ts, index._hwm) - index.window
        n, cap = len(c.fields), index.bucket_cap
        found = index._rank(columns, list(range(n)), c.id, 1, n * cap + 1, horizon, cap, -1, None)
        ranked = [cl.Seen(id, ts, shared, first) for id, shared, first, ts in found]
        if not c.looked:
            return ranked, {seen.id for seen in ranked}
        view, new = index._view, set[str]()
        for j, f in enumerate(c.fields):
            p = view.at[f]
            before = {(seq, id) for column in view.columns for _, seq, id in parse_records(column[p] or b"")}
            new.update(id for column in columns for _, seq, id in parse_records(column[j] or b"") if (seq, id) not in before)
        return ranked, new


class _Rounds(AnsweredRounds):
    """`SharedDecider`'s rounds on a spread index, with the engine's verification for the claims; each insert
    round waits for its answer (a claim's round decides by the home scripts' answer)."""

    def __init__(self, index: SpreadIndex, batch: Batch, verifier: Verifier) -> None:
        self.index = index
        index._engine = _Engine(index, batch, verifier)

    def lookup(self, queries: Sequence[Query], limit: int) -> list[tuple[Entry | Verdict | None, list[Candidate]]]:
        return self.index.lookup(queries, limit)

    def insert(self, entries: Sequence[tuple[Entry, tuple[int, ...]]],
               memos: Sequence[Memo] = ()) -> list[list[Candidate] | None]:
        return self.index.insert(entries, memos)

    def prefetch(self, queries: Sequence[Query]) -> None:
        self.index.prefetch(queries)


