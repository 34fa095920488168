"""How Python's cyclic garbage collector runs in a long-lived routing process (`neardup filter`, `serve`).

Routing allocates many short-lived containers a message (the lookup's field lists, fingerprints,
verdicts, Kafka records), nearly all freed by reference counting at once. With CPython's default
thresholds (a young collection every 700 net allocations) the collector still ran about 250 young and
2 full collections for 17,000 short messages: 4–5 µs of CPU a message, 8–10 % of the client's time on
the Redis index (`python bench/redis_cpu.py` prints it, measured with `gc.callbacks`; with
`--collector tuned`, none). The objects made at start-up (normalization tables, modules) live for
the whole run: frozen, full collections no longer walk them. Cycles still get collected, after 50,000
net allocations.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # net allocations of container objects between young collections (CPython: 700)
OLDER_THRESHOLDS = (20, 100)  # young collections per middle one, middle ones per full one (CPython: 10, 10)


def tune_collector() -> None:
    """Freezes what exists now (call it once start-up is done) and spaces the collections out. No collection
    first: it walks every object of start-up (≈ 6 ms, a tenth of a short run's set-up) to free a handful."""
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
