"""The one exception tree of neardup; third-party errors are mapped onto it where they enter.

    NeardupError                      .retriable says whether trying again later can succeed
    ├── ConfigError                   bad parameters, URL or settings (never retriable)
    ├── RejectedInput                 a message that cannot be filtered; routed to dead-letter
    │   ├── DecodeError               not UTF-8, not JSON, not an object, nesting too deep
    │   └── MissingText               no text field, or text is not a string
    └── ServiceError                  an external service failed (raised `from` the client's error)
        ├── IndexUnavailable          Redis unreachable, timed out, loading, failing over (retriable)
        │   └── IndexLost             the index lost its data (a changelogged index without its marker)
        ├── IndexCorrupt              stored data unreadable, e.g. written by another version
        └── BrokerUnavailable         Kafka unreachable or refused (retriable)
"""

from __future__ import annotations


class NeardupError(Exception):
    retriable: bool = False


class ConfigError(NeardupError, ValueError):
    pass


class RejectedInput(NeardupError):
    """`reason` is the short machine-readable cause written to the dead-letter record."""

    reason: str = "rejected"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class DecodeError(RejectedInput):
    reason = "undecodable"


class MissingText(RejectedInput):
    reason = "no_text"


class ServiceError(NeardupError):
    pass


class IndexUnavailable(ServiceError):
    retriable = True


class IndexLost(IndexUnavailable):
    """A changelogged (fenced) index answered without the marker that says it holds its window: its data was
    lost (a restart without persistence, FLUSHALL, a failover to an empty replica), or it was rebuilt since the
    batch's lookup or this instance's last batch. Nothing of the batch was written (but on the spread layout,
    whose claim rounds span masters: what a round wrote on the masters that kept their data, which a rebuild
    drops, and which a batch decided again takes over as its own pending claims); the worker rebuilds the index
    (or waits for it), writes back what it routed meanwhile, and decides the batch again."""


class IndexCorrupt(ServiceError):
    pass


class BrokerUnavailable(ServiceError):
    retriable = True
