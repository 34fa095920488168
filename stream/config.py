"""Settings of the CLI and the worker: durations, and the layered configuration (flags > env > TOML file > defaults)."""

from __future__ import annotations

import argparse
import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from filters.config import METHODS, VERIFY_MODES, FilterConfig
from filters.errors import ConfigError
from filters.normalize import NormalizeOptions
from stream.codec import FORMATS, RecordFormat
from stream.logs import LOG_FORMATS

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
DURATION_FORMS = "30s, 15m, 24h, 7d"


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '7d', '1.5h', '50ms' → seconds. A bare number is refused wherever a duration is
    read (flag, environment, TOML): `--window 24` would otherwise silently mean 24 seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        raise ConfigError(f"{text}: a duration needs a unit: {DURATION_FORMS}")
    if not isinstance(text, str):
        raise ConfigError(f"not a duration: {text!r} (use e.g. {DURATION_FORMS})")
    m = _DURATION.match(text)
    if not m:
        if re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", text):
            raise ConfigError(f"{text.strip()}: a duration needs a unit: {DURATION_FORMS}")
        raise ConfigError(f"not a duration: {text!r} (use e.g. {DURATION_FORMS})")
    seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if seconds <= 0:
        raise ConfigError(f"duration must be positive: {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest spelling `parse_duration` reads back exactly: 86400.0 → '1d', 0.05 → '50ms'."""
    for unit in ("d", "h", "m", "s"):
        count = seconds / _UNIT[unit]
        if count >= (2 if unit == "d" else 1) and count == int(count):  # 24h, not 1d
            return f"{int(count)}{unit}"
    ms = seconds * 1000
    if ms == int(ms):
        return f"{int(ms)}ms"
    return f"{seconds!r}s"


ENV_PREFIX = "NEARDUP_"
CONFIG_ENV = "NEARDUP_CONFIG"
RUNTIMES = ("aiokafka", "faust")
INDEX_ERROR_POLICIES = ("block", "unchecked")
PROCESSING_GUARANTEES = ("at_least_once", "exactly_once")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
MASK = "***"
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")  # Kafka's own rule for topic names

# Groups of settings, so that `produce` and `tail` show only the connection options.
KAFKA, WORKER, FILTER = "kafka", "worker", "filter"


def _meta(help: str, group: str = WORKER, kind: str = "str", secret: bool = False) -> dict[str, Any]:
    return {"help": help, "group": group, "kind": kind, "secret": secret}


_DEFAULT_FILTER = FilterConfig()


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything `neardup serve`/`produce`/`tail` need. `sources` says where each value came from."""

    # -- Kafka connection ------------------------------------------------------------------------
    kafka_bootstrap: str = field(default="localhost:9092", metadata=_meta("bootstrap servers, host:port[,...]", KAFKA))
    kafka_security_protocol: str = field(default="PLAINTEXT", metadata=_meta(
        f"one of {', '.join(SECURITY_PROTOCOLS)}", KAFKA))
    kafka_sasl_mechanism: str = field(default="PLAIN", metadata=_meta(f"one of {', '.join(SASL_MECHANISMS)}", KAFKA))
    kafka_sasl_username: str = field(default="", metadata=_meta("SASL user name", KAFKA))
    kafka_sasl_password: str = field(default="", repr=False, metadata=_meta(
        "SASL password (prefer the environment variable: flags show in `ps`)", KAFKA, secret=True))
    kafka_ssl_cafile: str = field(default="", metadata=_meta("CA certificate file for SSL/SASL_SSL", KAFKA))
    kafka_client_id: str = field(default="neardup", metadata=_meta("client id the broker logs", KAFKA))
    # -- topics ----------------------------------------------------------------------------------
    input_topics: tuple[str, ...] = field(default=("neardup-input",), metadata=_meta(
        "topics to filter, comma-separated", kind="list"))
    unique_topic: str = field(default="unique", metadata=_meta("where unique records go"))
    duplicate_topic: str = field(default="duplicate", metadata=_meta("where duplicates go"))
    dead_letter_topic: str = field(default="neardup-dead-letter", metadata=_meta(
        "where undecodable/rejected records go, with the reason in headers"))
    group_id: str = field(default="neardup", metadata=_meta("consumer group: workers sharing it share the input"))
    group_instance_id: str = field(default="", metadata=_meta(
        "static group membership (aiokafka runtime): a restarted worker with the same id gets its partitions "
        "back at once instead of after the session timeout; unique per worker, e.g. the pod name"))
    session_timeout: float = field(default=10.0, metadata=_meta(
        "consumer group session timeout: a dead worker's partitions move after this long", kind="duration"))
    create_topics: bool = field(default=True, metadata=_meta("create missing input/output topics", kind="bool"))
    partitions: int = field(default=1, metadata=_meta("partitions of topics neardup creates", kind="int"))
    replication_factor: int = field(default=1, metadata=_meta("replication of topics neardup creates", kind="int"))
    # -- records ---------------------------------------------------------------------------------
    format: str = field(default="json", metadata=_meta(f"record format: {', '.join(FORMATS)}"))
    text_field: str = field(default="text", metadata=_meta("JSON field holding the text"))
    id_field: str = field(default="", metadata=_meta(
        "JSON field holding a unique message id (empty: topic/partition/offset)"))
    ts_field: str = field(default="", metadata=_meta(
        "JSON field holding the event time in seconds (empty: the Kafka record timestamp)"))
    # -- filter: every FilterConfig field under its own name, its default taken from FilterConfig -----
    index: str = field(default="memory://", metadata=_meta(
        "candidate index: redis://host:6379/0 (shared, survives restarts) or memory:// (trying out only)", FILTER))
    window: float = field(default=_DEFAULT_FILTER.window, metadata=_meta(
        f"sliding window of event time, with a unit: {DURATION_FORMS}", FILTER, kind="duration"))
    normalize: str = field(default="", metadata=_meta(
        "normalization steps turned off/on, e.g. '-pinyin,-mask_numbers' (+step turns one on; also no-step, !step) "
        f"of {', '.join(NormalizeOptions.step_names())}", FILTER, kind="steps"))
    methods: tuple[str, ...] = field(default=_DEFAULT_FILTER.methods, metadata=_meta(
        f"candidate generators, comma-separated, of {', '.join(METHODS)}", FILTER, kind="list"))
    verify: str = field(default=_DEFAULT_FILTER.verify, metadata=_meta(
        f"one of {', '.join(VERIFY_MODES)}: sketch verifies every candidate by shingle overlap, native by each "
        "method's own measure", FILTER))
    threshold: float = field(default=_DEFAULT_FILTER.threshold, metadata=_meta(
        "Jaccard at or above which a candidate is a duplicate", FILTER, kind="float"))
    threshold_long: float = field(default=_DEFAULT_FILTER.threshold_long, metadata=_meta(
        "... but this when one text is longer than short_text and neither is contained in the other (templates with "
        "other names and figures)", FILTER, kind="float"))
    containment: float = field(default=_DEFAULT_FILTER.containment, metadata=_meta(
        "... or containment of the smaller text in the larger at or above this (truncated copies, added lines)",
        FILTER, kind="float"))
    containment_min_ratio: float = field(default=_DEFAULT_FILTER.containment_min_ratio, metadata=_meta(
        "containment counts when the smaller text has at least this share of the larger's size", FILTER,
        kind="float"))
    containment_min_size: int = field(default=_DEFAULT_FILTER.containment_min_size, metadata=_meta(
        "... and at least this many shingles (short texts need Jaccard)", FILTER, kind="int"))
    containment_slack: int = field(default=_DEFAULT_FILTER.containment_slack, metadata=_meta(
        "... and the smaller text has at most this many shingles the larger lacks", FILTER, kind="int"))
    containment_slack_share: float = field(default=_DEFAULT_FILTER.containment_slack_share, metadata=_meta(
        "... and at most this share of its shingles", FILTER, kind="float"))
    short_text: int = field(default=_DEFAULT_FILTER.short_text, metadata=_meta(
        "texts of at most this many normalized characters keep them for the edit check (0: off)", FILTER,
        kind="int"))
    edit_similarity: float = field(default=_DEFAULT_FILTER.edit_similarity, metadata=_meta(
        "two short texts are duplicates at or above this LCS similarity (words inserted, deleted, swapped)",
        FILTER, kind="float"))
    shingle: int = field(default=_DEFAULT_FILTER.shingle, metadata=_meta(
        "character n-gram size of the verification shingles", FILTER, kind="int"))
    sketch_size: int = field(default=_DEFAULT_FILTER.sketch_size, metadata=_meta(
        "bottom-k sketch size kept per indexed message", FILTER, kind="int"))
    mgram: int = field(default=_DEFAULT_FILTER.mgram, metadata=_meta(
        "m-gram size of the substring-index bucket keys", FILTER, kind="int"))
    mgram_keys: int = field(default=_DEFAULT_FILTER.mgram_keys, metadata=_meta(
        "m-gram keys sampled per message (all of them for short texts)", FILTER, kind="int"))
    short_mgram: int = field(default=_DEFAULT_FILTER.short_mgram, metadata=_meta(
        "m-gram size of the extra bucket keys of short texts, in wide (Han, kana, hangul) characters", FILTER,
        kind="int"))
    short_mgram_chars: int = field(default=_DEFAULT_FILTER.short_mgram_chars, metadata=_meta(
        "texts of at most this many normalized characters get the short m-gram keys (0: none)", FILTER,
        kind="int"))
    simhash_k: int = field(default=_DEFAULT_FILTER.simhash_k, metadata=_meta(
        "simhash Hamming distance bound (0-15)", FILTER, kind="int"))
    minhash_perm: int = field(default=_DEFAULT_FILTER.minhash_perm, metadata=_meta(
        "minhash permutations (a multiple of minhash_bands)", FILTER, kind="int"))
    minhash_bands: int = field(default=_DEFAULT_FILTER.minhash_bands, metadata=_meta(
        "minhash LSH bands", FILTER, kind="int"))
    sentences_top: int = field(default=_DEFAULT_FILTER.sentences_top, metadata=_meta(
        "sentences method: this many longest sentences make the signature", FILTER, kind="int"))
    sentences_min_chars: int = field(default=_DEFAULT_FILTER.sentences_min_chars, metadata=_meta(
        "sentences method: shortest sentence counted, in characters", FILTER, kind="int"))
    max_candidates: int = field(default=_DEFAULT_FILTER.max_candidates, metadata=_meta(
        "candidates verified per message, best-ranked first", FILTER, kind="int"))
    min_shared: float = field(default=_DEFAULT_FILTER.min_shared, metadata=_meta(
        "a candidate is verified only if it shares this fraction of the message's bucket keys", FILTER,
        kind="float"))
    bucket_cap: int = field(default=_DEFAULT_FILTER.bucket_cap, metadata=_meta(
        "representatives kept per bucket (newest win)", FILTER, kind="int"))
    max_chars: int = field(default=_DEFAULT_FILTER.max_chars, metadata=_meta(
        "longer texts are truncated to this many characters before fingerprinting", FILTER, kind="int"))
    seed: int = field(default=_DEFAULT_FILTER.seed, metadata=_meta(
        "hash seed of the fingerprints (a shared index needs the same seed everywhere)", FILTER, kind="int"))
    # -- worker ----------------------------------------------------------------------------------
    runtime: str = field(default="aiokafka", metadata=_meta(
        "consume/produce/commit loop: aiokafka (default, faster) or faust"))
    max_batch: int = field(default=2000, metadata=_meta("records routed per batch, at most", kind="int"))
    batch_within: float = field(default=0.05, metadata=_meta(
        "wait at most this long to fill a batch: 50ms, 1s", kind="duration"))
    align: bool = field(default=True, metadata=_meta(
        "decide records in event-time order across partitions and workers (off: in the order fetched)", kind="bool"))
    max_skew: float = field(default=5.0, metadata=_meta(
        "event time a partition or worker may run ahead of the slowest: 5s, 1m (bigger: faster backlogs)",
        kind="duration"))
    idle_timeout: float = field(default=1.0, metadata=_meta(
        "a partition with nothing to fetch holds the others back at most this long: 1s, 500ms",
        kind="duration"))
    on_index_error: str = field(default="block", metadata=_meta(
        "index unavailable: block (pause, retry with backoff) or unchecked (pass to unique, "
        "header neardup-verdict: unchecked)"))
    processing_guarantee: str = field(default="at_least_once", metadata=_meta(
        "at_least_once (default: a crash may repeat the last batches) or exactly_once (aiokafka runtime: "
        "outputs and consumed offsets in one Kafka transaction; readers use isolation.level=read_committed)"))
    changelog: bool = field(default=True, metadata=_meta(
        "write the shared index's entries to a changelog topic and rebuild the index from it when Redis loses "
        "its data (aiokafka runtime, redis:// index)", kind="bool"))
    changelog_topic: str = field(default="", metadata=_meta(
        "the index changelog topic (empty: <group_id>-index-changelog)"))
    retry_initial: float = field(default=0.5, metadata=_meta("first backoff after an index error", kind="duration"))
    retry_max: float = field(default=30.0, metadata=_meta("longest backoff after index errors", kind="duration"))
    linger: float = field(default=0.005, metadata=_meta("producer linger: batch output records this long",
                                                       kind="duration"))
    batch_bytes: int = field(default=64 * 1024, metadata=_meta(
        "producer record batches up to this many bytes (aiokafka runtime; lowered at start to the output "
        "topics' smallest max.message.bytes: a topic refuses a larger batch whole)", kind="int"))
    state_dir: str = field(default="", metadata=_meta(
        "faust runtime: its data directory (empty: a temporary directory)"))
    log_level: str = field(default="info", metadata=_meta("debug, info, warning, error"))
    log_format: str = field(default="plain", metadata=_meta(f"log lines: {' or '.join(LOG_FORMATS)} (JSON lines)"))
    # -- operations ------------------------------------------------------------------------------
    metrics_port: int = field(default=9464, metadata=_meta(
        "HTTP port of /metrics, /health, /ready and the campaign page (0: no HTTP server)", kind="int"))
    metrics_host: str = field(default="127.0.0.1", metadata=_meta(
        "address the HTTP server binds (0.0.0.0: every interface, e.g. in a container)"))
    campaigns: bool = field(default=True, metadata=_meta(
        "keep the campaign view (duplicate clusters of the window; in the index's Redis)", kind="bool"))
    campaign_minutes: int = field(default=10, metadata=_meta(
        "minutes of per-minute counts (growth) the campaign view keeps", kind="int"))
    # Not a setting: where each value above came from ("default", "file PATH", "env NAME", "flag --x").
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

        one_of("kafka_security_protocol", SECURITY_PROTOCOLS)
        one_of("kafka_sasl_mechanism", SASL_MECHANISMS)
        one_of("runtime", RUNTIMES)
        one_of("on_index_error", INDEX_ERROR_POLICIES)
        one_of("processing_guarantee", PROCESSING_GUARANTEES)
        if self.processing_guarantee == "exactly_once" and self.runtime != "aiokafka":
            # faust-streaming's processing_guarantee="exactly_once" has open bugs (lost and repeated
            # records around rebalances); the aiokafka runtime's transactions are the tested path.
            raise ConfigError("processing_guarantee exactly_once needs runtime aiokafka: the faust runtime is "
                              "at-least-once only")
        one_of("format", FORMATS)
        one_of("log_format", LOG_FORMATS)
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}")
        if self.campaign_minutes < 1:
            raise ConfigError(f"campaign_minutes must be >= 1, got {self.campaign_minutes}")
        if self.kafka_security_protocol.startswith("SASL") and not (
            self.kafka_sasl_username and self.kafka_sasl_password
        ):
            raise ConfigError(f"{self.kafka_security_protocol} needs kafka_sasl_username and kafka_sasl_password")
        if not self.kafka_bootstrap.strip():
            raise ConfigError("kafka_bootstrap is empty")
        if not self.input_topics:
            raise ConfigError("input_topics is empty")
        outputs = (self.unique_topic, self.duplicate_topic, self.dead_letter_topic)
        for topic in (*self.input_topics, *outputs, self.changelog_name):
            if not _TOPIC.match(topic):
                raise ConfigError(f"not a valid Kafka topic name: {topic!r}")
        if loop := set(outputs) & set(self.input_topics):
            raise ConfigError(f"output topic(s) {sorted(loop)} are also inputs: the worker would read its own output")
        for name in ("partitions", "replication_factor", "max_batch", "batch_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retry_max < self.retry_initial:
            raise ConfigError("retry_max must be >= retry_initial")
        self.filter_config()  # validates methods, thresholds and the window
        object.__setattr__(self, "sources", dict(self.sources))  # a copy: the caller's dict may change

    # -- derived ---------------------------------------------------------------------------------
    def filter_config(self) -> FilterConfig:
        """The FilterConfig of these settings: every one of its fields has a setting of the same name."""
        values = {name: getattr(self, name) for name in filter_setting_names() if name != "normalize"}
        return FilterConfig(normalize=parse_steps(self.normalize), **values)

    @property
    def changelog_name(self) -> str:
        """The index changelog topic: `changelog_topic`, else `<group_id>-index-changelog` (as Kafka Streams
        names a store's changelog after its application)."""
        return self.changelog_topic or f"{self.group_id}-index-changelog"

    @property
    def changelogged(self) -> bool:
        """Whether the worker keeps an index changelog: asked for, on a shared index, in the aiokafka runtime."""
        return self.changelog and not self.index.startswith("memory:") and self.runtime == "aiokafka"

    def record_format(self) -> RecordFormat:
        # An empty field name is never looked up by any real record, so the codec uses the fallback
        # (Kafka coordinates / Kafka timestamp).
        return RecordFormat(self.format, self.text_field, self.id_field, self.ts_field)

    @property
    def output_topics(self) -> tuple[str, str, str]:
        return self.unique_topic, self.duplicate_topic, self.dead_letter_topic

    def masked(self) -> dict[str, Any]:
        """The settings as plain values, secrets replaced by `***` (for printing and logging)."""
        return {f.name: mask_value(f.name, getattr(self, f.name)) for f in setting_fields()}

    def __repr__(self) -> str:
        # Secrets stay out of logs and tracebacks: passwords and passwords inside URLs are masked.
        return "Settings(" + ", ".join(f"{k}={v!r}" for k, v in self.masked().items()) + ")"

    def describe(self) -> str:
        """TOML-like lines `name = value  # source`, secrets masked: what `neardup config` prints."""
        lines = []
        for name, value in self.masked().items():
            lines.append(f"{name} = {_toml_value(shown_value(name, value))}  # {self.sources.get(name, 'default')}")
        return "\n".join(lines)

    def env(self) -> dict[str, str]:
        """Every setting as the `NEARDUP_*` variable that gives it (secrets included: the environment is how
        they should be passed), e.g. to start a `neardup serve` subprocess with exactly these settings."""
        out = {}
        for f in setting_fields():
            value = shown_value(f.name, getattr(self, f.name))
            if isinstance(value, tuple):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = "true" if value else "false"
            out[env_name(f.name)] = str(value)
        return out


def setting_fields() -> tuple[Any, ...]:
    return tuple(f for f in fields(Settings) if f.name != "sources")


def filter_setting_names() -> tuple[str, ...]:
    """The settings that make the FilterConfig: its fields, by the same names."""
    return tuple(f.name for f in fields(FilterConfig))


@functools.cache
def _kinds() -> dict[str, str]:
    """Each setting's kind, by name: `shown_value` is asked for every flag each parser is built with."""
    return {f.name: f.metadata["kind"] for f in setting_fields()}


def shown_value(name: str, value: Any) -> Any:
    """A value as flags, the environment and TOML spell it: durations with their unit."""
    return format_duration(value) if _kinds().get(name, "str") == "duration" else value


def parse_steps(spec: str) -> NormalizeOptions:
    """'-pinyin,+leet' (also 'no-pinyin', '!pinyin') → the default NormalizeOptions with those steps off/on."""
    steps: dict[str, bool] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        off = item.startswith(("-", "!", "no-"))
        name = item.removeprefix("no-").lstrip("+-!")
        if name not in NormalizeOptions.step_names():
            raise ConfigError(f"unknown normalization step {name!r} (steps: {', '.join(NormalizeOptions.step_names())})")
        steps[name] = not off
    return NormalizeOptions().with_steps(**steps)


def steps_spec(options: NormalizeOptions) -> str:
    """The canonical spelling of `options`: the steps that differ from the defaults, '-step' or '+step'."""
    default = NormalizeOptions()
    return ",".join(("+" if getattr(options, n) else "-") + n for n in NormalizeOptions.step_names()
                    if getattr(options, n) != getattr(default, n))


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- masking ------------------------------------------------------------------------------------


def mask_url(text: str) -> str:
    """`redis://:secret@host/0` → `redis://:***@host/0`; anything without a password is unchanged."""
    if "://" not in text:
        return text
    try:
        parts = urlsplit(text)
        password = parts.password
    except ValueError:
        return text
    if not password:
        return text
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{host}"))


def mask_value(name: str, value: Any) -> Any:
    meta: Mapping[str, Any] = next((f.metadata for f in setting_fields() if f.name == name), {})
    if meta.get("secret") or name.endswith("password"):
        return MASK if value else value
    if isinstance(value, str):
        return mask_url(value)
    return value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- conversion ---------------------------------------------------------------------------------


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {value!r} (use true/false)")


def _to_list(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(str(item).strip() for item in items if str(item).strip())


def _to_number(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, bool):
            raise ConfigError(f"not a number: {value!r}")
        try:
            if kind is int and isinstance(value, str):
                return int(value.strip(), 0)  # 0x6E656172 for the seed
            return kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"not a number: {value!r}") from None

    return convert


def _to_str(value: Any) -> str:
    if isinstance(value, dict | list | tuple | bool):
        raise ConfigError(f"not a string: {value!r}")
    return str(value)


_CONVERT: dict[str, Callable[[Any], Any]] = {
    "str": _to_str,
    "int": _to_number(int),
    "float": _to_number(float),
    "bool": _to_bool,
    "list": _to_list,
    "duration": parse_duration,
    "steps": lambda value: steps_spec(parse_steps(_steps_text(value))),
}


def _steps_text(value: Any) -> str:
    """TOML may give the steps as a string, a list of '-step' items or a table {pinyin = false}."""
    if isinstance(value, dict):
        return ",".join(("+" if _to_bool(on) else "-") + str(name) for name, on in value.items())
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return _to_str(value)


def _convert(name: str, value: Any, source: str) -> Any:
    kind = next(f.metadata["kind"] for f in setting_fields() if f.name == name)
    try:
        return _CONVERT[kind](value)
    except ConfigError as exc:
        raise ConfigError(f"{name} from {source}: {exc}") from None


# -- layers -------------------------------------------------------------------------------------


def read_toml(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file: top-level `name = value`, or tables whose name prefixes the key
    (`[kafka] bootstrap = ...` is `kafka_bootstrap`). Unknown names are an error: a typo must not
    silently fall back to a default."""
    import tomllib  # here: most runs read no file

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    known = {f.name for f in setting_fields()}
    out: dict[str, Any] = {}

    def walk(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            name = f"{prefix}{key}".replace("-", "_")
            if isinstance(value, dict) and name != "normalize":
                walk(value, name + "_")
            elif name in known:
                out[name] = value
            else:
                raise ConfigError(f"config file {path}: unknown setting {name!r}")

    walk(data, "")
    return out


def load_settings(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Settings:
    """Flags (only those given: None means not given) > `NEARDUP_*` environment > TOML file > defaults.

    The file is `config_file`, else `$NEARDUP_CONFIG`, else none.
    """
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    if config_file is None:
        config_file = env.get(CONFIG_ENV) or None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file is not None:
        for name, value in read_toml(config_file).items():
            values[name] = _convert(name, value, f"file {config_file}")
            sources[name] = f"file {config_file}"
    for f in setting_fields():
        var = env_name(f.name)
        if var in env:
            values[f.name] = _convert(f.name, env[var], f"env {var}")
            sources[f.name] = f"env {var}"
    known = {f.name for f in setting_fields()}
    for name, value in flags.items():
        if name not in known:
            raise ConfigError(f"unknown setting {name!r}")
        values[name] = _convert(name, value, f"flag {flag_name(name)}")
        sources[name] = f"flag {flag_name(name)}"
    return Settings(**values, sources=sources)


def add_settings_arguments(parser: argparse.ArgumentParser, groups: tuple[str, ...] = (KAFKA, WORKER)) -> None:
    """One `--flag` per setting (of the given groups), plus `--config FILE`. Flags default to None
    ("not given"), so `load_settings` can tell a flag from a default."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help=f"TOML file of settings (default ${CONFIG_ENV}); flags and {ENV_PREFIX}* override it")
    titles = {KAFKA: "Kafka connection", WORKER: "worker", FILTER: "filter parameters (also FilterConfig's)"}
    names: list[str] = list(parser.get_default("setting_names") or ())
    for group in groups:
        g = parser.add_argument_group(titles[group])
        for f in setting_fields():
            if f.metadata["group"] != group:
                continue
            default = shown_value(f.name, f.default)
            default = ",".join(default) if isinstance(default, tuple) else default
            shown = MASK if f.metadata["secret"] else default
            help_text = f"{f.metadata['help']} [{env_name(f.name)}; default {shown!r}]".replace("%", "%%")
            g.add_argument(flag_name(f.name), dest=f.name, default=None, help=help_text,
                           metavar=f.metadata["kind"].upper())
            names.append(f.name)
    # Only these dests are settings: a command's own option of the same name (filter's --format) is not.
    parser.set_defaults(setting_names=tuple(names))


def settings_from_args(args: argparse.Namespace) -> Settings:
    known = set(getattr(args, "setting_names", ())) or {f.name for f in setting_fields()}
    flags = {k: v for k, v in vars(args).items() if k in known}
    return load_settings(flags, config_file=getattr(args, "config", None))
