"""List sources and sinks and a settable clock, so whole pipelines run in tests and notebooks with no broker."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class ListSource:
    """Yields the given raw records (bytes) in order, like lines of a file."""

    records: list[bytes]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.records)


@dataclass
class ListSink:
    """Collects what a pipeline writes to one output."""

    records: list[bytes] = field(default_factory=list)

    def write(self, record: bytes) -> None:
        self.records.append(record)

    def write_many(self, records: list[bytes]) -> None:
        self.records.extend(records)

    def flush(self) -> None:
        pass


@dataclass
class ManualClock:
    """A clock the test moves by hand: `clock.now += 60`."""

    now: float = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
