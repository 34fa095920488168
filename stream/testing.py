"""List sources and sinks, a list changelog and a settable clock, so pipelines run in tests and notebooks with no broker."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from filters.index import Entry, Stored


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


@dataclass
class ListChangelog:
    """An index changelog held in a list, so that a rebuild (`IndexGuard.ensure`) runs with no broker: the
    entries journaled (`Journal.take`, appended to `entries`) are read back in one chunk, as
    `stream.changelog.read_changelog` hands a topic's."""

    entries: list[tuple[Entry, tuple[int, ...]]] = field(default_factory=list)

    async def __call__(self, write: Callable[[Stored], Awaitable[int]]) -> int:
        from filters.index.redis_codec import stored_of  # numpy: imported by a rebuild only

        if self.entries:
            await write(stored_of(self.entries))
        return len(self.entries)
