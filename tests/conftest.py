"""Real Redis/Kafka fixtures: NEARDUP_TEST_* env, else testcontainers, else skip (fail in CI)."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from functools import cache
from typing import NoReturn

import pytest
import redis

HINT = 'run `docker/services.sh start` and `eval "$(docker/services.sh env)"`, or start a Docker daemon'


def _unavailable(what: str) -> NoReturn:
    """A missing service fails in CI (a service test must never be skipped there) and skips elsewhere."""
    msg = f"{what} is not available: {HINT}"
    if os.environ.get("CI"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


@cache
def _docker_available() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


@pytest.fixture(scope="session")
def _containers() -> Iterator[ExitStack]:
    """Owns the testcontainers started by the fixtures below; stops them at the end of the session."""
    with ExitStack() as stack:
        yield stack


def _redis_container(stack: ExitStack, password: str | None = None) -> str:
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:  # testcontainers < 4.15
        from testcontainers.redis import RedisContainer

    container = stack.enter_context(RedisContainer("redis:7", password=password))
    auth = f":{password}@" if password else ""
    return f"redis://{auth}{container.get_container_host_ip()}:{container.get_exposed_port(6379)}/0"


@pytest.fixture(scope="session")
def redis_url(_containers: ExitStack) -> str:
    if url := os.environ.get("NEARDUP_TEST_REDIS_URL"):
        return url
    if _docker_available():
        return _redis_container(_containers)
    _unavailable("Redis (NEARDUP_TEST_REDIS_URL)")


@pytest.fixture(scope="session")
def redis_auth_url(_containers: ExitStack) -> str:
    if url := os.environ.get("NEARDUP_TEST_REDIS_AUTH_URL"):
        return url
    if _docker_available():
        return _redis_container(_containers, password="neardup-secret")
    _unavailable("Redis with AUTH (NEARDUP_TEST_REDIS_AUTH_URL)")


@pytest.fixture(scope="session")
def redis_tls_url() -> str:
    # Only docker/services.sh provides it (Debian's redis-server has TLS).
    if url := os.environ.get("NEARDUP_TEST_REDIS_TLS_URL"):
        return url
    _unavailable("TLS Redis (NEARDUP_TEST_REDIS_TLS_URL, from docker/services.sh start redis)")


@pytest.fixture(scope="session")
def redis_cluster_url() -> str:
    # Started only by `docker/services.sh start cluster` (as .ci/run does).
    if url := os.environ.get("NEARDUP_TEST_REDIS_CLUSTER_URL"):
        return url
    _unavailable("Redis Cluster (NEARDUP_TEST_REDIS_CLUSTER_URL, from docker/services.sh start cluster)")


def _service_url(variable: str, what: str) -> str:
    """The URL docker/services.sh exported in `variable`, or the test is skipped (failed in CI)."""
    if url := os.environ.get(variable):
        return url
    _unavailable(f"{what} ({variable}, from docker/services.sh start clusters)")


@pytest.fixture(scope="session")
def redis_cluster6_url() -> str:
    return _service_url("NEARDUP_TEST_REDIS_CLUSTER6_URL", "6-master Redis Cluster")


@pytest.fixture(scope="session")
def redis_cluster_ha_url() -> str:
    """A 3-master Redis Cluster with a replica each, for failovers."""
    return _service_url("NEARDUP_TEST_REDIS_CLUSTER_HA_URL", "Redis Cluster with replicas")


@pytest.fixture(scope="session")
def kafka_bootstrap(_containers: ExitStack) -> str:
    if bootstrap := os.environ.get("NEARDUP_TEST_KAFKA"):
        return bootstrap
    if _docker_available():
        try:
            from testcontainers.community.kafka import KafkaContainer
        except ImportError:  # testcontainers < 4.15
            from testcontainers.kafka import KafkaContainer

        return _containers.enter_context(KafkaContainer()).get_bootstrap_server()
    _unavailable("Kafka (NEARDUP_TEST_KAFKA)")


@pytest.fixture(scope="session")
def kafka_sasl() -> dict[str, str]:
    """SASL_PLAINTEXT + PLAIN listener: {"bootstrap", "user", "password"} (docker/services.sh only)."""
    if bootstrap := os.environ.get("NEARDUP_TEST_KAFKA_SASL"):
        return {
            "bootstrap": bootstrap,
            "user": os.environ.get("NEARDUP_TEST_KAFKA_SASL_USER", "neardup"),
            "password": os.environ.get("NEARDUP_TEST_KAFKA_SASL_PASSWORD", "neardup-secret"),
        }
    _unavailable("Kafka SASL/PLAIN listener (NEARDUP_TEST_KAFKA_SASL)")


@pytest.fixture
def fresh_redis(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    """`neardup filter` run in-process tunes the garbage collector for the whole process
    (`stream.collector`): put it back, so that each test sees CPython's defaults."""
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    gc.unfreeze()


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A fresh key prefix on the test Redis; its keys are deleted after the test."""
    from tests.test_index_contract import drop_namespace  # the helper lives with the contract suite

    prefix = f"neardup-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    drop_namespace(redis_url, prefix)
