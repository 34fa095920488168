"""The test services are real: Redis (plain, AUTH, TLS, Cluster) and Apache Kafka (PLAINTEXT, SASL/PLAIN)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

# Clients that are expected to fail must not retry with backoff.
NO_RETRY = {"retry": Retry(NoBackoff(), 0), "socket_timeout": 5}

Record = tuple[bytes, bytes, dict[str, bytes]]  # key, value, headers

# --- Redis -------------------------------------------------------------------------------------------


def test_redis_ping_set_get(fresh_redis: redis.Redis) -> None:
    assert fresh_redis.ping() is True
    assert fresh_redis.dbsize() == 0
    fresh_redis.set("neardup:probe", "ok", ex=60)
    assert fresh_redis.get("neardup:probe") == b"ok"
    assert int(fresh_redis.info("server")["redis_version"].split(".")[0]) >= 6


def test_redis_auth_required(redis_auth_url: str) -> None:
    with redis.Redis.from_url(redis_auth_url) as client:
        assert client.ping() is True
    conn = redis.Redis.from_url(redis_auth_url).connection_pool.connection_kwargs
    with (
        redis.Redis(host=conn["host"], port=conn["port"], password="wrong-password", **NO_RETRY) as wrong,
        pytest.raises(redis.AuthenticationError),
    ):
        wrong.ping()
    with (
        redis.Redis(host=conn["host"], port=conn["port"], **NO_RETRY) as anonymous,
        pytest.raises(redis.AuthenticationError),
    ):
        anonymous.ping()


def test_redis_tls(redis_tls_url: str) -> None:
    with redis.Redis.from_url(redis_tls_url) as client:
        assert client.ping() is True
        client.set("neardup:tls", b"\x00\xff")
        assert client.get("neardup:tls") == b"\x00\xff"
        client.delete("neardup:tls")
    conn = redis.Redis.from_url(redis_tls_url).connection_pool.connection_kwargs
    # The port speaks only TLS: a plaintext client is dropped.
    with (
        redis.Redis(host=conn["host"], port=conn["port"], **NO_RETRY) as plain,
        pytest.raises(redis.ConnectionError),
    ):
        plain.ping()


def test_redis_cluster(redis_cluster_url: str) -> None:
    cluster = RedisCluster.from_url(redis_cluster_url)
    try:
        info = cluster.cluster_info(target_nodes=RedisCluster.RANDOM)
        assert info["cluster_state"] == "ok"
        assert int(info["cluster_slots_assigned"]) == 16384
        assert len(cluster.get_primaries()) >= 3
        keys = [f"neardup:cluster:{i}" for i in range(30)]  # spread over all masters' slots
        for key in keys:
            cluster.set(key, key, ex=60)
        assert [cluster.get(key) for key in keys] == [key.encode() for key in keys]
        assert len({cluster.get_node_from_key(key).name for key in keys}) >= 3
        cluster.delete(*keys)
    finally:
        cluster.close()


# --- Kafka -------------------------------------------------------------------------------------------


async def _roundtrip(bootstrap: str, n: int = 10, **security: Any) -> list[Record]:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = f"neardup-test-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **security)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        # A new topic reaches the broker's metadata a moment after CreateTopics returns (KRaft
        # propagates it asynchronously): under load, the first listing may miss it.
        deadline = time.monotonic() + 15
        while topic not in await admin.list_topics() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert topic in await admin.list_topics()
    finally:
        await admin.close()

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", **security)
    await producer.start()
    try:
        for i in range(n):
            await producer.send_and_wait(
                topic,
                value=f"doc {i}".encode(),
                key=f"k{i}".encode(),
                headers=[("source", b"test_services"), ("seq", str(i).encode())],
            )
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"{topic}-group",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **security,
    )
    await consumer.start()
    received: list[Record] = []
    try:
        async with asyncio.timeout(60):
            while len(received) < n:
                batches = await consumer.getmany(timeout_ms=1000)
                for records in batches.values():
                    received += [(r.key, r.value, dict(r.headers)) for r in records]
        await consumer.commit()
    finally:
        await consumer.stop()
    return received


def _assert_roundtrip(received: list[Record]) -> None:
    assert [(key, value) for key, value, _ in received] == [
        (f"k{i}".encode(), f"doc {i}".encode()) for i in range(10)
    ]
    assert [headers for _, _, headers in received] == [
        {"source": b"test_services", "seq": str(i).encode()} for i in range(10)
    ]


def _sasl(kafka_sasl: dict[str, str], password: str | None = None) -> dict[str, Any]:
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": kafka_sasl["user"],
        "sasl_plain_password": kafka_sasl["password"] if password is None else password,
    }


def test_kafka_produce_consume(kafka_bootstrap: str) -> None:
    _assert_roundtrip(asyncio.run(_roundtrip(kafka_bootstrap)))


def test_kafka_sasl_plain_produce_consume(kafka_sasl: dict[str, str]) -> None:
    _assert_roundtrip(asyncio.run(_roundtrip(kafka_sasl["bootstrap"], **_sasl(kafka_sasl))))


def test_kafka_sasl_wrong_password_fails(
    kafka_sasl: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    async def connect() -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_sasl["bootstrap"], **_sasl(kafka_sasl, password="wrong-password")
        )
        try:
            await producer.start()
        finally:
            await producer.stop()

    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises(KafkaError):
        asyncio.run(connect())
    assert "Authentication failed" in caplog.text
