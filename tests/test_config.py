"""Layered settings: flags > NEARDUP_* environment > TOML file > defaults, sources, validation, masking."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from filters.errors import ConfigError
from stream import commands
from stream.config import (
    MASK,
    Settings,
    add_settings_arguments,
    format_duration,
    load_settings,
    mask_url,
    parse_duration,
    settings_from_args,
)
from stream.delivery import capped_batch_bytes


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "neardup.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_with_nothing_given() -> None:
    s = load_settings({}, env={})
    assert s == Settings()
    assert s.input_topics == ("neardup-input",)
    assert s.output_topics == ("unique", "duplicate", "neardup-dead-letter")
    assert s.index == "memory://" and s.runtime == "aiokafka" and s.on_index_error == "block"
    assert all(s.sources.get(name, "default") == "default" for name in s.masked())


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    path = write(tmp_path, """
        index = "redis://file-host:6379/0"
        window = "2h"
        max_batch = 100
        partitions = 3
        [kafka]
        bootstrap = "file-broker:9092"
        client_id = "from-file"
    """)
    env = {
        "NEARDUP_KAFKA_BOOTSTRAP": "env-broker:9092",
        "NEARDUP_WINDOW": "30m",
        "NEARDUP_INPUT_TOPICS": "a, b",
        "NEARDUP_MAX_BATCH": "200",
        "NEARDUP_TEST_KAFKA": "ignored: not a setting",
    }
    s = load_settings({"kafka_bootstrap": "flag-broker:9092", "max_batch": "300", "window": None}, env=env,
                      config_file=path)
    assert s.kafka_bootstrap == "flag-broker:9092"  # flag over env over file
    assert s.max_batch == 300
    assert s.window == 1800.0  # env over file (the flag was not given)
    assert s.input_topics == ("a", "b")
    assert s.index == "redis://file-host:6379/0"  # file over default
    assert s.kafka_client_id == "from-file"
    assert s.partitions == 3
    assert s.runtime == "aiokafka"  # default
    assert s.sources["kafka_bootstrap"] == "flag --kafka-bootstrap"
    assert s.sources["window"] == "env NEARDUP_WINDOW"
    assert s.sources["index"] == f"file {path}"
    assert "runtime" not in s.sources


def test_config_file_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, 'unique_topic = "kept"\n')
    s = load_settings({}, env={"NEARDUP_CONFIG": str(path)})
    assert s.unique_topic == "kept"
    assert s.sources["unique_topic"] == f"file {path}"


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("0", False), ("no", False), ("YES", True)])
def test_env_booleans(value: str, expected: bool) -> None:
    assert load_settings({}, env={"NEARDUP_CREATE_TOPICS": value}).create_topics is expected


@pytest.mark.parametrize(("flags", "env", "fragment"), [
    ({"window": "soon"}, {}, "window from flag --window"),
    ({}, {"NEARDUP_MAX_BATCH": "many"}, "max_batch from env NEARDUP_MAX_BATCH"),
    ({}, {"NEARDUP_CREATE_TOPICS": "maybe"}, "not a boolean"),
    ({"runtime": "kafka-streams"}, {}, "runtime must be one of"),
    ({"on_index_error": "ignore"}, {}, "on_index_error must be one of"),
    ({"unique_topic": "in"}, {"NEARDUP_INPUT_TOPICS": "in"}, "also inputs"),
    ({"duplicate_topic": "bad topic"}, {}, "not a valid Kafka topic name"),
    ({"kafka_security_protocol": "SASL_PLAINTEXT"}, {}, "needs kafka_sasl_username"),
    ({"methods": "exact,telepathy"}, {}, "methods must be"),
    ({"max_batch": "0"}, {}, "max_batch must be >= 1"),
    ({"nonsense": "1"}, {}, "unknown setting"),
])
def test_invalid_values_name_their_source(flags: dict[str, str], env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_settings(flags, env=env)


def test_unknown_or_broken_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'kafka_bootstrapp'"):
        load_settings({}, env={}, config_file=write(tmp_path, '[kafka]\nbootstrapp = "x:1"\n'))
    with pytest.raises(ConfigError, match="config file"):
        load_settings({}, env={}, config_file=write(tmp_path, "window = \n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({}, env={}, config_file=tmp_path / "missing.toml")


def test_durations() -> None:
    assert parse_duration("50ms") == 0.05
    assert parse_duration("1.5h") == 5400.0
    assert parse_duration("7d") == 7 * 86400.0
    with pytest.raises(ConfigError):
        parse_duration("0s")
    for bare in ("24", 24, 1.5, " 90 "):  # from a flag or env (text) or TOML (a number): never plain seconds
        with pytest.raises(ConfigError, match=r"a duration needs a unit: 30s, 15m, 24h, 7d"):
            parse_duration(bare)  # type: ignore[arg-type]
    assert [format_duration(s) for s in (86400.0, 7 * 86400.0, 0.05, 90.0, 1.5)] == ["24h", "7d", "50ms", "90s",
                                                                                     "1500ms"]


def test_secrets_are_masked_everywhere(tmp_path: Path) -> None:
    path = write(tmp_path, 'index = "redis://:file-secret@redis:6379/0"\n')
    env = {"NEARDUP_KAFKA_SASL_PASSWORD": "env-secret", "NEARDUP_KAFKA_SASL_USERNAME": "neardup",
           "NEARDUP_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}
    s = load_settings({}, env=env, config_file=path)
    assert s.kafka_sasl_password == "env-secret" and s.index.startswith("redis://:file-secret@")
    text = s.describe()
    for shown in (text, repr(s), str(s.masked())):
        assert "file-secret" not in shown and "env-secret" not in shown
    assert f'kafka_sasl_password = "{MASK}"  # env NEARDUP_KAFKA_SASL_PASSWORD' in text
    assert f'index = "redis://:{MASK}@redis:6379/0"  # file {path}' in text
    assert 'kafka_sasl_username = "neardup"' in text  # a user name is not a secret


@pytest.mark.parametrize(("url", "masked"), [
    ("redis://:pw@host:6379/0", f"redis://:{MASK}@host:6379/0"),
    ("rediss://user:p%40ss@host/1?ssl_ca_certs=/x", f"rediss://user:{MASK}@host/1?ssl_ca_certs=/x"),
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("memory://", "memory://"),
    ("not a url", "not a url"),
])
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_flags_from_argparse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write(tmp_path, 'group_id = "file-group"\nunique_topic = "file-unique"\n')
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--unique-topic", "flag-unique", "--on-index-error",
                              "unchecked", "--input-topics", "x,y"])
    monkeypatch.setenv("NEARDUP_UNIQUE_TOPIC", "env-unique")
    monkeypatch.setenv("NEARDUP_GROUP_ID", "env-group")
    s = settings_from_args(args)
    assert (s.unique_topic, s.group_id, s.on_index_error, s.input_topics) == (
        "flag-unique", "env-group", "unchecked", ("x", "y"))


def test_config_command_prints_effective_settings(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("NEARDUP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NEARDUP_INDEX", "redis://:hunter2@127.0.0.1:6379/0")
    assert commands.main(["config", "--window", "12h", "--ts-field", "ts"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    assert f'index = "redis://:{MASK}@127.0.0.1:6379/0"  # env NEARDUP_INDEX' in out
    assert 'window = "12h"  # flag --window' in out
    assert 'ts_field = "ts"  # flag --ts-field' in out
    assert 'runtime = "aiokafka"  # default' in out


def test_bad_setting_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert commands.main(["config", "--runtime", "spark"]) == 2
    assert "runtime must be one of" in capsys.readouterr().err


# -- one configuration: every FilterConfig field by the same name from flag, env and TOML ------------------

# (field, the text given, the value FilterConfig gets, as `neardup config` prints it)
FILTER_FIELDS = [
    ("window", "2h", 7200.0, '"2h"'),
    ("methods", "exact,simhash", ("exact", "simhash"), '["exact", "simhash"]'),
    ("verify", "native", "native", '"native"'),
    ("threshold", "0.6", 0.6, "0.6"),
    ("threshold_long", "0.7", 0.7, "0.7"),
    ("containment", "0.9", 0.9, "0.9"),
    ("containment_min_ratio", "0.4", 0.4, "0.4"),
    ("containment_min_size", "15", 15, "15"),
    ("containment_slack", "8", 8, "8"),
    ("containment_slack_share", "0.25", 0.25, "0.25"),
    ("short_text", "50", 50, "50"),
    ("edit_similarity", "0.9", 0.9, "0.9"),
    ("shingle", "5", 5, "5"),
    ("sketch_size", "64", 64, "64"),
    ("mgram", "7", 7, "7"),
    ("mgram_keys", "12", 12, "12"),
    ("short_mgram", "2", 2, "2"),
    ("short_mgram_chars", "16", 16, "16"),
    ("simhash_k", "4", 4, "4"),
    ("minhash_perm", "64", 64, "64"),
    ("minhash_bands", "16", 16, "16"),
    ("sentences_top", "4", 4, "4"),
    ("sentences_min_chars", "12", 12, "12"),
    ("max_candidates", "6", 6, "6"),
    ("min_shared", "0.3", 0.3, "0.3"),
    ("bucket_cap", "32", 32, "32"),
    ("max_chars", "10000", 10000, "10000"),
    ("seed", "0x1234", 0x1234, "4660"),
    ("normalize", "-pinyin,no-leet", None, '"-leet,-pinyin"'),
]


def test_every_filter_config_field_is_a_setting_with_its_default() -> None:
    from dataclasses import fields

    from filters.config import FilterConfig

    names = [f.name for f in fields(FilterConfig)]
    assert sorted(names) == sorted(name for name, *_ in FILTER_FIELDS)
    assert Settings().filter_config() == FilterConfig()  # defaults defined once: FilterConfig's
    for f in fields(FilterConfig):
        if f.name != "normalize":
            assert getattr(Settings(), f.name) == getattr(FilterConfig(), f.name), f.name


def _toml(value: str) -> str:
    return value if value.replace(".", "").isdigit() and "x" not in value else f'"{value}"'


@pytest.mark.parametrize("layer", ["flag", "env", "file"])
@pytest.mark.parametrize(("name", "given", "expected", "shown"), FILTER_FIELDS, ids=[f[0] for f in FILTER_FIELDS])
def test_each_filter_field_reaches_config_and_the_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str], layer: str, name: str,
                                                         given: str, expected: object, shown: str) -> None:
    from stream import cli

    for var in [n for n in __import__("os").environ if n.startswith("NEARDUP_")]:
        monkeypatch.delenv(var)
    if name == "seed" and layer == "file":
        given = "4660"  # TOML has its own hex literal; a plain integer here
    # minhash_perm must stay a multiple of minhash_bands (64 % 32 == 0, 128 % 16 == 0)
    argv: list[str] = []
    source = {"flag": f"flag --{name.replace('_', '-')}", "env": f"env NEARDUP_{name.upper()}"}.get(layer, "")
    if layer == "flag":
        argv = [f"--{name.replace('_', '-')}={given}"]
    elif layer == "env":
        monkeypatch.setenv(f"NEARDUP_{name.upper()}", given)
    else:
        path = write(tmp_path, f"{name} = {_toml(given)}\n")
        argv = ["--config", str(path)]
        source = f"file {path}"
    assert cli.main(["config", *argv]) == 0
    assert f"{name} = {shown}  # {source}" in capsys.readouterr().out.splitlines()
    for command in (["filter"], ["explain", "a", "b"], ["eval"], ["serve"]):
        args = cli.build_parser().parse_args(cli._glue_normalize_value([*command, *argv]))
        got = settings_from_args(args).filter_config()
        if name == "normalize":
            assert (got.normalize.pinyin, got.normalize.leet, got.normalize.casefold) == (False, False, True)
        else:
            assert getattr(got, name) == expected, command


def test_toml_normalize_as_a_table_or_list_and_durations_need_units(tmp_path: Path) -> None:
    s = load_settings({}, env={}, config_file=write(tmp_path, "[normalize]\npinyin = false\nleet = false\n"))
    assert s.normalize == "-leet,-pinyin" and not s.filter_config().normalize.pinyin
    s = load_settings({}, env={}, config_file=write(tmp_path, 'normalize = ["-mask_numbers"]\n'))
    assert not s.filter_config().normalize.mask_numbers
    for text in ("window = 86400\n", 'window = "24"\n', "session_timeout = 10\n"):
        with pytest.raises(ConfigError, match="a duration needs a unit: 30s, 15m, 24h, 7d"):
            load_settings({}, env={}, config_file=write(tmp_path, text))
    with pytest.raises(ConfigError, match="NEARDUP_BATCH_WITHIN: 50: a duration needs a unit"):
        load_settings({}, env={"NEARDUP_BATCH_WITHIN": "50"})


def test_settings_env_round_trips() -> None:
    s = load_settings({"window": "90m", "normalize": "-pinyin", "mgram_keys": "11", "linger": "5ms"}, env={})
    again = load_settings({}, env=s.env())
    assert again == s and again.filter_config() == s.filter_config()


def test_transient_kafka_errors_at_start_are_not_logged_as_errors() -> None:
    import io
    import logging

    from stream.logs import setup_logging

    out = io.StringIO()
    handler = setup_logging("info", "plain", stream=out)
    try:
        log = logging.getLogger("aiokafka.consumer.group_coordinator")
        log.error("Group Coordinator Request failed: %s", "[Error 15] GroupCoordinatorNotAvailableError")
        logging.getLogger("aiokafka.client").error("Unable to request metadata: NodeNotReadyError: 1")
        log.error("Heartbeat session expired - marking coordinator dead")
    finally:
        logging.getLogger().removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert [line.split(" ", 3)[2] for line in lines] == ["INFO", "INFO", "ERROR"], lines


def test_batch_bytes_is_capped_to_the_smallest_max_message_bytes_of_the_output_topics() -> None:
    """The effective record batch size: batch_bytes stays the ceiling, the smallest topic limit below it wins
    (and is named, for the log line); nothing known (no limits read) keeps batch_bytes."""
    assert capped_batch_bytes(65536, {}) == (65536, None)
    assert capped_batch_bytes(65536, {"unique": 1048588, "duplicate": 20000, "dead": 32768}) == (20000, "duplicate")
    assert capped_batch_bytes(65536, {"unique": 65536, "duplicate": 1048588}) == (65536, None)  # equal: not lowered
    assert capped_batch_bytes(16384, {"unique": 20000}) == (16384, None)  # a larger limit does not raise it
    assert capped_batch_bytes(65536, {"b": 20000, "a": 20000}) == (20000, "a")  # a tie names the same topic each time
