"""Kafka plumbing on aiokafka: client options from Settings, error mapping, topic admin, produce a file, read/tail topics."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    IllegalSaslStateError,
    IllegalStateError,
    KafkaConfigurationError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NoBrokersAvailable,
    NodeNotReadyError,
    RecordListTooLargeError,
    RequestTimedOutError,
    SaslAuthenticationFailed,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.helpers import create_ssl_context

from filters.errors import BrokerUnavailable, ConfigError, NeardupError, ServiceError
from filters.records import maker
from stream.config import Settings

if TYPE_CHECKING:
    from stream.runner import RawRecord

log = logging.getLogger("neardup.kafka")

Headers = tuple[tuple[str, bytes], ...]

# Retrying cannot help: the settings are wrong.
_REFUSED = (AuthenticationFailedError, SaslAuthenticationFailed, AuthenticationMethodNotSupported, UnsupportedSaslMechanismError,
            IllegalSaslStateError, TopicAuthorizationFailedError, GroupAuthorizationFailedError,
            ClusterAuthorizationFailedError, KafkaConfigurationError)
# The broker is not reachable now (retrying helps), as opposed to refusing what it was asked.
KAFKA_UNAVAILABLE = (KafkaConnectionError, NoBrokersAvailable, NodeNotReadyError, KafkaTimeoutError,
                     RequestTimedOutError)
# Errors of KAFKA_UNAVAILABLE that do not show by themselves that the broker is down: a request that timed out
# (a hung broker, or one that answers late: a broker thawed after a freeze), a connection still being made.
INCONCLUSIVE = (KafkaTimeoutError, RequestTimedOutError, NodeNotReadyError)
# How long a produce request may go unanswered before it fails, on both runtimes (aiokafka's default; faust's own
# is 20 minutes: a hung broker went unsaid that long).
REQUEST_TIMEOUT = 40.0
# The broker refused a record batch as larger than the topic's max.message.bytes (Kafka's MESSAGE_TOO_LARGE /
# RecordTooLarge, and RECORD_LIST_TOO_LARGE).
TOO_LARGE = (MessageSizeTooLargeError, RecordListTooLargeError)


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    """One record as read from a topic (timestamp in milliseconds, as Kafka has it)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Headers = ()
    # The record as routed, decoded already (`stream.outputs.arrived`: the worker decodes each record once, on
    # arrival, for its event time and its routing); None: made when it is routed (`stream.outputs.raw_record`).
    raw: RawRecord | None = field(default=None, compare=False, repr=False)

    @property
    def coordinates(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"

    def header(self, name: str) -> bytes | None:
        """The last value of header `name` (a name may repeat; the last one written wins)."""
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found

    @staticmethod
    def of(msg: Any) -> KafkaRecord:
        """From an aiokafka ConsumerRecord."""
        headers = msg.headers
        return new_kafka_record(msg.topic, msg.partition, msg.offset, msg.timestamp, msg.key, msg.value,
                                tuple([(k, bytes(v)) for k, v in headers]) if headers else (), None)


# One per record consumed: from all field values, without the dataclass __init__'s cost.
new_kafka_record = maker(KafkaRecord)


def transient(exc: BaseException) -> bool:
    """An aiokafka error that retrying can cure: the broker unreachable, or a leader being elected."""
    return isinstance(exc, KAFKA_UNAVAILABLE) or (isinstance(exc, KafkaError) and exc.retriable)


def map_kafka_error(exc: BaseException, where: str) -> NeardupError:
    """The neardup error for an aiokafka error (raise it `from exc`)."""
    detail = f"Kafka at {where}: {type(exc).__name__}: {exc}"
    if isinstance(exc, _REFUSED):
        return ConfigError(f"{detail} (check the security settings)")
    if isinstance(exc, KAFKA_UNAVAILABLE) or getattr(exc, "retriable", False):
        return BrokerUnavailable(detail)
    return ServiceError(detail)


class _RefusalSeen(logging.Filter):
    """aiokafka logs why each bootstrap host failed, then raises a bare "Unable to bootstrap" error;
    this remembers a refusal (bad password, unsupported mechanism) so it is not mistaken for an outage."""

    def __init__(self) -> None:
        super().__init__()
        self.refusal: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        for arg in args:
            if isinstance(arg, _REFUSED):
                self.refusal = arg
        return True


@contextmanager
def broker_errors(settings: Settings) -> Iterator[None]:
    """Maps aiokafka errors raised inside the block to neardup errors."""
    seen = _RefusalSeen()
    logger = logging.getLogger("aiokafka")
    logger.addFilter(seen)
    try:
        yield
    except KafkaError as exc:
        if isinstance(exc, KafkaConnectionError) and seen.refusal is not None:
            raise map_kafka_error(seen.refusal, settings.kafka_bootstrap) from exc
        raise map_kafka_error(exc, settings.kafka_bootstrap) from exc
    finally:
        logger.removeFilter(seen)


def client_options(settings: Settings) -> dict[str, Any]:
    """Connection keyword arguments shared by aiokafka's consumer, producer and admin client."""
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "client_id": settings.kafka_client_id,
        "security_protocol": settings.kafka_security_protocol,
    }
    if settings.kafka_security_protocol.startswith("SASL"):
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        options["sasl_plain_username"] = settings.kafka_sasl_username
        options["sasl_plain_password"] = settings.kafka_sasl_password
    if settings.kafka_security_protocol.endswith("SSL"):
        options["ssl_context"] = create_ssl_context(cafile=settings.kafka_ssl_cafile or None)
    return options


# -- admin ---------------------------------------------------------------------------------------


@asynccontextmanager
async def admin_client(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """An admin client, started (aiokafka errors inside the block mapped to neardup errors)."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    with broker_errors(settings):
        await admin.start()
        try:
            yield admin
        finally:
            await admin.close()


async def ensure_topics(settings: Settings, topics: Sequence[str], partitions: int | None = None,
                        configs: dict[str, str] | None = None) -> list[str]:
    """Create those of `topics` that do not exist (with the topic `configs` given); returns the ones created."""
    async with admin_client(settings) as admin:
        return await create_missing(admin, settings, topics, partitions, configs)


async def create_missing(admin: AIOKafkaAdminClient, settings: Settings, topics: Sequence[str],
                         partitions: int | None = None, configs: dict[str, str] | None = None) -> list[str]:
    """`ensure_topics` with an admin client already started."""
    existing = set(await admin.list_topics())
    missing = sorted(set(topics) - existing)
    if not missing:
        return []
    n = partitions or settings.partitions
    new = [NewTopic(t, num_partitions=n, replication_factor=settings.replication_factor,
                    topic_configs=configs or {}) for t in missing]
    try:
        response = await admin.create_topics(new)
    except TopicAlreadyExistsError:
        return []  # another worker created them meanwhile
    created = []
    for topic, code, *_ in response.topic_errors:
        if code == 0:
            created.append(topic)
        elif code != TopicAlreadyExistsError.errno:
            raise ServiceError(f"Kafka at {settings.kafka_bootstrap}: cannot create topic {topic!r}: "
                               f"error code {code}")
    if created:
        log.info("created topic(s) %s with %d partition(s)", ", ".join(created), n)
    return created


async def max_message_bytes(admin: AIOKafkaAdminClient, topics: Sequence[str]) -> dict[str, int]:
    """The `max.message.bytes` of each of `topics` (DescribeConfigs: the topic's own value, else the broker's
    message.max.bytes). A topic the broker does not describe (not permitted, unknown) raises its KafkaError."""
    resources = [ConfigResource(ConfigResourceType.TOPIC, t, {"max.message.bytes": None}) for t in dict.fromkeys(topics)]
    limits: dict[str, int] = {}
    for response in await admin.describe_configs(resources):
        for code, message, _, name, entries, *_ in response.resources:
            if code:
                raise for_code(code)(f"DescribeConfigs of topic {name!r}" + (f": {message}" if message else ""))
            for key, value, *_ in entries:
                if key == "max.message.bytes" and value is not None:
                    limits[name] = int(value)
    return limits


async def missing_topics(settings: Settings, topics: Sequence[str]) -> list[str]:
    """Those of `topics` the broker does not have."""
    async with admin_client(settings) as admin:
        return sorted(set(topics) - set(await admin.list_topics()))


async def delete_topics(settings: Settings, topics: Sequence[str]) -> None:
    async with admin_client(settings) as admin:
        existing = set(await admin.list_topics())
        if doomed := [t for t in topics if t in existing]:
            await admin.delete_topics(doomed)


# -- produce -------------------------------------------------------------------------------------


@asynccontextmanager
async def producer(settings: Settings, **overrides: Any) -> AsyncIterator[AIOKafkaProducer]:
    options = {"acks": "all", "linger_ms": round(settings.linger * 1000),
               "request_timeout_ms": round(REQUEST_TIMEOUT * 1000), **client_options(settings), **overrides}
    p = AIOKafkaProducer(**options)
    with broker_errors(settings):
        await p.start()
        try:
            yield p
        finally:
            await p.stop()


def _key_of(line: bytes, key_field: str) -> bytes | None:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    value = record.get(key_field) if isinstance(record, dict) else None
    if value is None or isinstance(value, dict | list):
        return None
    return (value if isinstance(value, str) else orjson.dumps(value).decode()).encode()


async def produce_lines(
    settings: Settings,
    lines: BinaryIO,
    topic: str,
    *,
    key_field: str = "",
    limit: int | None = None,
) -> int:
    """Each non-blank line of `lines` (without its line break) becomes one record's value, in order;
    the key is the JSON field `key_field` when given and present. Returns how many were acknowledged."""
    sent = 0
    # Idempotent: a record batch retried after a leader election (a topic just created) is not appended
    # twice, so every line is one input record.
    async with producer(settings, enable_idempotence=True) as p:
        pending: list[asyncio.Future[Any]] = []
        with broker_errors(settings):
            for line in lines:
                value = line.rstrip(b"\r\n")
                if not value.strip():
                    continue
                key = _key_of(value, key_field) if key_field else None
                pending.append(await p.send(topic, value=value, key=key))
                sent += 1
                if len(pending) >= 10_000:  # bound memory on big files
                    await asyncio.gather(*pending)
                    pending.clear()
                if limit is not None and sent >= limit:
                    break
            await asyncio.gather(*pending)
    return sent


# -- read ----------------------------------------------------------------------------------------


async def read_topics(
    settings: Settings,
    topics: Sequence[str],
    *,
    from_beginning: bool = True,
    max_records: int | None = None,
    idle_timeout: float | None = None,
    deadline: float | None = None,
) -> AsyncIterator[KafkaRecord]:
    """Records of `topics` (all partitions, no consumer group, nothing committed), as they arrive.

    Stops after `max_records`, after `idle_timeout` seconds without a record, or at `deadline`
    (time.monotonic()); with none of them it follows the topics forever.
    """
    consumer = AIOKafkaConsumer(
        *topics,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if from_beginning else "latest",
        **client_options(settings),
    )
    with broker_errors(settings):
        await consumer.start()
        try:
            seen = 0
            last = time.monotonic()
            while max_records is None or seen < max_records:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return
                if idle_timeout is not None and now - last >= idle_timeout:
                    return
                wait = 1.0
                if deadline is not None:
                    wait = min(wait, deadline - now)
                if idle_timeout is not None:
                    wait = min(wait, idle_timeout - (now - last))
                batches = await consumer.getmany(timeout_ms=max(1, round(wait * 1000)), max_records=1000)
                for messages in batches.values():
                    for msg in messages:
                        yield KafkaRecord.of(msg)
                        seen += 1
                        last = time.monotonic()
                        if max_records is not None and seen >= max_records:
                            return
        finally:
            await consumer.stop()


async def collect(settings: Settings, topics: Sequence[str], count: int, timeout: float) -> list[KafkaRecord]:
    """The first `count` records of `topics` (from the beginning), or what arrived within `timeout`."""
    deadline = time.monotonic() + timeout
    return [r async for r in read_topics(settings, topics, max_records=count, deadline=deadline)]


def _text_or_base64(data: bytes | None) -> str | dict[str, str] | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(data).decode("ascii")}


def record_json(record: KafkaRecord) -> bytes:
    """One JSON line for `neardup tail`: bytes as UTF-8 text, or {"base64": ...} when not UTF-8;
    headers as an object (a repeated header name shows its last value)."""
    return orjson.dumps({
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "key": _text_or_base64(record.key),
        "value": _text_or_base64(record.value),
        "headers": {name: _text_or_base64(value) for name, value in record.headers},
    })


# -- consumer position ---------------------------------------------------------------------------


async def partition_lags(consumer: AIOKafkaConsumer, committed_only: bool = False) -> dict[tuple[str, int], int]:
    """Records left to fetch per assigned partition whose end is known (it comes with fetches; the last
    stable offset when reading committed records only); a partition fetched nothing of yet, revoked
    meanwhile, or without a position within a second is missing. The aligner's idleness and the
    `neardup_consumer_lag` metric."""
    return lags_of(await partition_positions(consumer, committed_only))


def lags_of(positions: dict[tuple[str, int], tuple[int, int]]) -> dict[tuple[str, int], int]:
    """Records left to fetch per partition, from `partition_positions`."""
    return {lane: max(0, end - position) for lane, (position, end) in positions.items()}


def stale_ends(consumer: AIOKafkaConsumer, older_than: float) -> set[tuple[str, int]]:
    """The assigned partitions whose end (high-water mark, last stable offset) a fetch last told more than
    `older_than` seconds ago. The fetcher asks for the end of a partition only with its records, and not
    while records it fetched of it wait to be returned (the worker not polling: a restore waited for, a long
    batch): such an end says nothing of what was produced since (a lag of 0 from it is not known)."""
    out: set[tuple[str, int]] = set()
    try:
        assigned = consumer.assignment()
    except IllegalStateError:
        return out
    now_ms = time.time() * 1000
    for tp in assigned:
        try:
            told = consumer.last_poll_timestamp(tp)
        except (IllegalStateError, AssertionError):
            continue
        if told is not None and now_ms - told > older_than * 1000:
            out.add((tp.topic, tp.partition))
    return out


async def partition_positions(consumer: AIOKafkaConsumer,
                              committed_only: bool = False) -> dict[tuple[str, int], tuple[int, int]]:
    """Per assigned partition whose end is known: the consumer's position and that end (see `partition_lags`)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    try:
        assigned = consumer.assignment()
    except IllegalStateError:
        return out
    for tp in assigned:
        try:
            end = consumer.last_stable_offset(tp) if committed_only else None
            if end is None or end < 0:
                end = consumer.highwater(tp)
            if end is None:
                continue
            position = await asyncio.wait_for(consumer.position(tp), 1.0)
        except (IllegalStateError, AssertionError, TimeoutError, KafkaError):
            continue
        out[(tp.topic, tp.partition)] = (position, end)
    return out
