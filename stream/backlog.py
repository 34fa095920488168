"""A backlog of near-duplicate clusters whose copies sit hours apart in event time, in different partitions.

It is what makes a consumer's fetch order matter: drained partition by partition, the later copy of a
message would be decided before its original. The event-time alignment test (tests/test_alignment.py)
and benchmark (bench/alignment.py) produce it to a multi-partition topic and compare the routing with
the filter's on the same records in event-time order (`reference`). Synthetic, seeded text: no data
set needed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from filters.engine import NearDupFilter
from stream.codec import RecordFormat
from stream.runner import DUPLICATE, UNIQUE, RawRecord, route_batch

if TYPE_CHECKING:  # the Kafka extra: only its type, for whoever passes outputs
    from stream.kafka_tools import KafkaRecord

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "du", "ar", "en", "il", "om", "ub", "zy",
              "qua", "tri", "sol", "mar", "ven", "dor", "lin", "pax")
_ADS = ("Reply STOP to unsubscribe.", "Sent from my phone", "Follow us for more deals!", "Limited offer, act now.")


@dataclass(frozen=True, slots=True)
class Item:
    """One record of the backlog: its partition, event time (seconds), id, cluster and JSON value."""

    partition: int
    ts: float
    id: str
    cluster: int
    value: bytes


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _copy(rng: random.Random, words: list[str]) -> str:
    """A near-duplicate of `words`: another number, padding, one word dropped, or an ad line added."""
    kind = rng.randrange(4)
    out = list(words)
    if kind == 0:
        out[-1] = str(rng.randint(10_000, 99_999))
    elif kind == 1:
        out = [w + ("  " if rng.random() < 0.3 else "") for w in out]
    elif kind == 2:
        del out[rng.randrange(len(out) - 1)]
    else:
        out.append(rng.choice(_ADS))
    return " ".join(out)


def backlog(clusters: int = 150, copies: int = 3, partitions: int = 4, *, hours: float = 6.0,
            apart: tuple[float, float] = (1.0, 5.0), start: float = 1_700_000_000.0, seed: int = 7) -> list[Item]:
    """`clusters` originals spread over `hours` of event time, each with up to `copies` near-duplicates
    `apart` hours later (uniformly), every record in a partition drawn at random; plus as many singletons.
    In event-time order (a partition's records are in order too)."""
    rng = random.Random(seed)
    items: list[tuple[float, int, str]] = []
    for c in range(clusters):
        words = [_word(rng) for _ in range(rng.randint(10, 22))] + [str(rng.randint(10_000, 99_999))]
        t0 = start + rng.uniform(0, hours * 3600)
        items.append((t0, c, " ".join(words)))
        for _ in range(rng.randint(1, copies)):
            items.append((t0 + rng.uniform(*apart) * 3600, c, _copy(rng, words)))
    for s in range(clusters):  # singletons: unrelated messages among them
        words = [_word(rng) for _ in range(rng.randint(8, 20))]
        items.append((start + rng.uniform(0, (hours + apart[1]) * 3600), clusters + s, " ".join(words)))
    items.sort()
    out = []
    for n, (ts, cluster, text) in enumerate(items):
        ident = f"b{n:06d}"
        value = orjson.dumps({"id": ident, "text": text, "ts": round(ts, 3)})
        out.append(Item(rng.randrange(partitions), round(ts, 3), ident, cluster, value))
    return out


def reference(items: Sequence[Item], nd: NearDupFilter) -> dict[str, str]:
    """What the filter decides for the records in event-time order: id → unique or duplicate."""
    fmt = RecordFormat("json", "text", "id", "ts")
    raws = [RawRecord(item.value, item.id, item.ts) for item in sorted(items, key=lambda i: (i.ts, i.id))]
    verdicts: dict[str, str] = {}
    for i in range(0, len(raws), 500):
        for routed in route_batch(nd, raws[i:i + 500], fmt):
            assert routed.verdict is not None
            verdicts[routed.verdict.id] = DUPLICATE if routed.verdict.duplicate else UNIQUE
    return verdicts


def verdicts_of(outputs: Sequence[KafkaRecord]) -> dict[str, str]:
    """What a worker's outputs say: id → verdict (headers `neardup-id`, `neardup-verdict`)."""
    out = {}
    for r in outputs:
        ident = r.header("neardup-id")
        if ident is None:
            raise ValueError(f"an output without neardup-id: {r}")
        out[ident.decode()] = (r.header("neardup-verdict") or b"").decode()
    return out


def differences(got: dict[str, str], want: dict[str, str]) -> list[str]:
    """The ids routed otherwise than `want` says (a missing one counts too)."""
    return sorted(i for i in want if got.get(i) != want[i])


def f1(got: dict[str, str], items: Sequence[Item]) -> float:
    """Routing F1 against the clusters (a message is truly a duplicate when an earlier one of its cluster
    exists; shared/eval's measure)."""
    first: set[int] = set()
    tp = fp = fn = 0
    for item in sorted(items, key=lambda i: (i.ts, i.id)):
        truly = item.cluster in first
        first.add(item.cluster)
        said = got.get(item.id) == DUPLICATE
        tp += said and truly
        fp += said and not truly
        fn += truly and not said
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0
