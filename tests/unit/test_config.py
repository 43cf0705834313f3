"""blockagg.config: validation, pass-through, secrets, overrides."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from blockagg.config import (
    Secret,
    iter_keys,
    load,
    loads,
    parse_duration,
    parse_size,
)
from blockagg.exceptions import ConfigError

ROOT = Path(__file__).resolve().parents[2]

MINIMAL = """
[job]
checkpoint_location = "/tmp/ck"

[kafka]
"bootstrap.servers" = "localhost:9092"

[[topics]]
name = "events"
replicas = ["ch1:9000", "ch2:9000"]
"""


def cfg(extra: str = "", base: str = MINIMAL, **kw: object):  # type: ignore[no-untyped-def]
    return loads(base + extra, **kw)  # type: ignore[arg-type]


def refused(text: str, pattern: str, **kw: object) -> str:
    with pytest.raises(ConfigError) as info:
        loads(text, **kw)  # type: ignore[arg-type]
    message = str(info.value)
    assert re.search(pattern, message), message
    return message


def test_minimal_defaults() -> None:
    c = cfg()
    assert c.job.metadata_group_id == "blockagg"
    assert c.job.trigger_interval == 1.0
    assert c.job.starting_offsets == "earliest"
    assert c.job.max_offsets_per_trigger is None
    assert c.blocks.max_rows == 1_000_000
    assert c.topics[0].name == "events"
    assert [str(r) for r in c.topics[0].replicas] == ["ch1:9000", "ch2:9000"]
    assert c.subscription == ("subscribe", "events")
    assert c.metrics.port == 9464
    assert c.dead_letters.table == "blockagg.dead_letters"


def test_example_file_is_valid() -> None:
    c = load(ROOT / "blockagg.example.toml", env={"CH_PASSWORD": "pw", "KAFKA_PASSWORD": "k"})
    assert c.topics
    assert "pw" not in repr(c)


def test_docs_mention_every_key() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in iter_keys() if f"`{key.split('.', 1)[1]}`" not in doc]
    assert not missing, f"undocumented keys: {missing}"


def test_unknown_key_named_with_path_and_hint() -> None:
    msg = refused(MINIMAL + "\n[blocks]\nmax_row = 5\n", r"blocks\.max_row: unknown key")
    assert "max_rows" in msg
    refused(MINIMAL.replace('name = "events"', 'name = "events"\nreplica = []'),
            r"topics\[0\]\.replica: unknown key")
    refused(MINIMAL + "\n[jobs]\nx=1\n", r"^jobs: unknown key")


def test_unknown_section_key_in_job() -> None:
    refused(MINIMAL.replace("[job]", "[job]\ntrigger = 1"), r"job\.trigger: unknown key.*"
            r"trigger_interval")


def test_durations_and_sizes() -> None:
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2 minutes") == 120
    assert parse_duration(3) == 3.0
    assert parse_duration("1.5") == 1.5
    assert parse_size("10MiB") == 10 * 1024 * 1024
    assert parse_size("64MB") == 64_000_000
    assert parse_size(123) == 123
    bad_durations: list[object] = ["0s", "soon", -1, True]
    for bad in bad_durations:
        with pytest.raises(ConfigError):
            parse_duration(bad)
    bad_sizes: list[object] = [0, "10 parsecs", 1.5]
    for bad_size in bad_sizes:
        with pytest.raises(ConfigError):
            parse_size(bad_size)
    c = cfg('\n[blocks]\nmax_bytes = "1MiB"\nmax_rows = 10\n')
    assert c.blocks.max_bytes == 1 << 20


def test_insert_lanes_and_ping_settings() -> None:
    assert (cfg("").clickhouse.insert_concurrency, cfg("").clickhouse.ping_after_idle) == (4, 5.0)
    c = cfg('\n[clickhouse]\ninsert_concurrency = 1\nping_after_idle = "0s"\n')
    assert (c.clickhouse.insert_concurrency, c.clickhouse.ping_after_idle) == (1, 0.0)
    refused(MINIMAL + "\n[clickhouse]\ninsert_concurrency = 0\n",
            r"clickhouse\.insert_concurrency: must be >= 1 and <= 64, got 0")
    assert cfg("").clickhouse.executor_insert_concurrency == 0
    assert cfg("\n[clickhouse]\nexecutor_insert_concurrency = 8\n"
               ).clickhouse.executor_insert_concurrency == 8
    refused(MINIMAL + "\n[clickhouse]\nexecutor_insert_concurrency = -1\n",
            r"clickhouse\.executor_insert_concurrency: must be >= 0 and <= 256, got -1")
    refused(MINIMAL + "\n[clickhouse]\nping_after_idle = -1\n",
            r"clickhouse\.ping_after_idle: must be 0 or more, got -1")


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ("\n[blocks]\nmax_rows = 0\n", r"blocks\.max_rows: must be >= 1"),
        ("\n[blocks]\nmax_rows = -3\n", r"blocks\.max_rows"),
        ("\n[blocks]\nmax_bytes = 0\n", r"blocks\.max_bytes"),
        ("\n[blocks]\nmax_rows = \"10\"\n", r"blocks\.max_rows: expected an integer"),
        ("\n[dead_letters]\nmax_rate = 2\n", r"dead_letters\.max_rate: must be between"),
        ("\n[dead_letters]\ntable = \"nodot\"\n", r"dead_letters\.table"),
        ("\n[metrics]\nport = 70000\n", r"metrics\.port"),
        ("\n[source]\nminPartitions = 4\n", r"source\.minPartitions.*never be split"),
        ("\n[source]\nmaxRecordsPerPartition = 4\n", r"maxRecordsPerPartition.*split"),
        ("\n[source]\nstartingOffsets = \"earliest\"\n", r"source\.startingOffsets"),
        ("\n[source]\nfailOnDataLoss = false\n", r"failOnDataLoss.*always true"),
        ("\n[source]\n\"kafka.group.id\" = \"x\"\n", r"Kafka client keys go under \[kafka\]"),
        ("\n[source]\nmaxOffsetsPerTrigger = 5\n", r"max_offsets_per_trigger"),
    ],
)
def test_refusals(extra: str, pattern: str) -> None:
    refused(MINIMAL + extra, pattern)


def test_min_rows_off_by_default_and_validated() -> None:
    c = cfg()
    assert (c.blocks.min_rows, c.blocks.min_rows_percentile, c.blocks.max_latency) == (
        0, 0.5, 60.0)
    c = cfg('\n[blocks]\nmin_rows = 10000\nmax_latency = "2min"\nmin_rows_percentile = 0.9\n')
    assert (c.blocks.min_rows, c.blocks.min_rows_percentile, c.blocks.max_latency) == (
        10000, 0.9, 120.0)
    refused(MINIMAL + "\n[blocks]\nmin_rows = 10\nmax_rows = 5\n",
            r"blocks\.min_rows = 10 is above blocks\.max_rows = 5")
    refused(MINIMAL.replace("[job]", '[job]\ntrigger_interval = "10s"')
            + '\n[blocks]\nmin_rows = 10\nmax_latency = "15s"\n',
            r"blocks\.max_latency = 15s leaves no time.*trigger_interval = 10s.*at least 20s")
    refused(MINIMAL + "\n[blocks]\nmin_rows = -1\n", r"blocks\.min_rows: must be >= 0")
    refused(MINIMAL + "\n[blocks]\nmin_rows_percentile = 0\n",
            r"blocks\.min_rows_percentile: must be above 0")
    refused(MINIMAL + "\n[blocks]\nmin_rows = 10\n[source]\nminOffsetsPerTrigger = 5\n",
            r"source\.minOffsetsPerTrigger: set by the job when blocks\.min_rows = 10")
    # by hand, without min_rows, Spark's own options stay available
    assert cfg("\n[source]\nminOffsetsPerTrigger = 5\n").source == {
        "minOffsetsPerTrigger": "5"}


def test_lock_session_timeout() -> None:
    assert cfg().job.lock_session_timeout == 10.0
    assert cfg(base=MINIMAL.replace("[job]\n", '[job]\nlock_session_timeout = "6s"\n')
               ).job.lock_session_timeout == 6.0
    refused(MINIMAL.replace("[job]\n", '[job]\nlock_session_timeout = "90s"\n'),
            r"lock_session_timeout \(90s\) must be below job\.lock_timeout \(60s\)")
    refused(MINIMAL.replace("[job]\n", '[job]\nlock_session_timeout = "500ms"\n'),
            r"lock_session_timeout: must be at least 1s.*got 0\.5s")


def test_kafka_owned_keys_refused() -> None:
    base = MINIMAL.replace('"bootstrap.servers" = "localhost:9092"',
                           '"bootstrap.servers" = "localhost:9092"\n"{k}" = "{v}"')
    refused(base.format(k="isolation.level", v="read_uncommitted"),
            r'kafka\."isolation\.level".*read_committed')
    refused(base.format(k="group.id", v="g"), r'kafka\."group\.id".*metadata_group_id')
    refused(base.format(k="kafka.bootstrap.servers", v="x"), r"without the \"kafka\.\" prefix")


def test_unquoted_dotted_kafka_key_explained() -> None:
    text = MINIMAL.replace('"bootstrap.servers" = "localhost:9092"',
                           '"bootstrap.servers" = "localhost:9092"\nsecurity.protocol = "SSL"')
    refused(text, r"kafka\.security: expected a value, got a table; quote dotted keys")


def test_bootstrap_required() -> None:
    refused(MINIMAL.replace('"bootstrap.servers" = "localhost:9092"', ""),
            r"bootstrap\.servers.*required")


def test_checkpoint_required() -> None:
    refused(MINIMAL.replace('checkpoint_location = "/tmp/ck"', ""),
            r"job\.checkpoint_location: required")


def test_topics_required_and_shapes() -> None:
    refused(MINIMAL.split("[[topics]]")[0], r"at least one \[\[topics\]\]")
    refused(MINIMAL + '\n[[topics]]\nname = "events"\nreplicas = ["ch3:9000"]\n',
            r"topics\[1\]: duplicate topic 'events'.*topics\[0\]")
    refused(MINIMAL.replace('replicas = ["ch1:9000", "ch2:9000"]', "replicas = []"),
            r"topics\[0\]\.replicas: expected a non-empty list")
    refused(MINIMAL.replace('"ch2:9000"', '"ch2:notaport"'), r"topics\[0\]\.replicas\[1\]")
    refused(MINIMAL.replace('"ch2:9000"', '"ch1:9000"'), r"lists a replica twice")
    refused(MINIMAL.replace('name = "events"', 'name = "events"\npattern = "e.*"'),
            r"exactly one of name or pattern")
    refused(MINIMAL.replace('name = "events"', 'pattern = "e(["'), r"not a valid regex")


def test_topics_as_named_tables_and_patterns() -> None:
    text = MINIMAL.split("[[topics]]")[0] + """
[topics.orders]
replicas = ["a:9000"]

[topics.logs]
pattern = "logs-.*"
replicas = ["b:9000", "c:9001"]
"""
    c = loads(text)
    assert c.topic_for("orders").name == "orders"
    assert c.topic_for("logs-eu").pattern == "logs-.*"
    kind, value = c.subscription
    assert kind == "subscribePattern"
    assert re.fullmatch(value, "orders") and re.fullmatch(value, "logs-x")
    assert not re.fullmatch(value, "ordersx")
    with pytest.raises(ConfigError, match="matches no"):
        c.topic_for("other")


def test_ambiguous_patterns_refused_at_routing() -> None:
    text = MINIMAL.split("[[topics]]")[0] + """
[[topics]]
pattern = "a.*"
replicas = ["a:9000"]
[[topics]]
pattern = ".*b"
replicas = ["b:9000"]
"""
    c = loads(text)
    with pytest.raises(ConfigError, match="several"):
        c.topic_for("ab")


def test_quorum_above_replicas_refused() -> None:
    refused(MINIMAL + "\n[clickhouse]\ninsert_quorum = 3\n",
            r"clickhouse\.insert_quorum = 3 but the shard of events lists only 2")
    c = cfg("\n[clickhouse]\ninsert_quorum = 2\n")
    assert c.clickhouse.insert_quorum == 2
    refused(MINIMAL.replace('name = "events"', 'name = "events"\ninsert_quorum = 5'),
            r"insert_quorum of events = 5")


def test_clickhouse_settings_passthrough_and_owned() -> None:
    c = cfg("\n[clickhouse.settings]\nmax_insert_block_size = 100\nlog_queries = 1\n")
    assert c.clickhouse.settings == {"max_insert_block_size": 100, "log_queries": 1}
    refused(MINIMAL + "\n[clickhouse.settings]\ninsert_quorum = 2\n",
            r"clickhouse\.settings\.insert_quorum: set by the job")


def test_secrets_from_env_and_masked() -> None:
    text = MINIMAL.replace(
        '"bootstrap.servers" = "localhost:9092"',
        '"bootstrap.servers" = "localhost:9092"\n"security.protocol" = "SASL_SSL"\n'
        '"sasl.mechanism" = "SCRAM-SHA-512"\n"sasl.username" = "alice"\n'
        '"sasl.password" = "${env:KPASS}"\n"ssl.key.password" = "plain-secret"',
    ) + '\n[clickhouse]\npassword_env = "CH_PW"\n'
    c = loads(text, env={"KPASS": "hunter2", "CH_PW": "s3cr3t"})
    assert c.clickhouse.password.reveal() == "s3cr3t"
    shown = repr(c) + str(c.summary()) + repr(c.kafka) + f"{c.clickhouse.password}"
    for secret in ("hunter2", "s3cr3t", "plain-secret"):
        assert secret not in shown
    rdk = c.kafka.librdkafka_config()
    assert rdk["sasl.password"] == "hunter2"
    assert rdk["bootstrap.servers"] == "localhost:9092"
    java = c.kafka.spark_source_options()
    assert java["kafka.bootstrap.servers"] == "localhost:9092"
    assert "kafka.sasl.password" not in java
    assert java["kafka.sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required '
        'username="alice" password="hunter2";'
    )
    assert pickle.loads(pickle.dumps(c)).clickhouse.password.reveal() == "s3cr3t"


def test_missing_env_named() -> None:
    refused(MINIMAL + '\n[clickhouse]\npassword_env = "NOPE_X"\n',
            r"clickhouse\.password_env: environment variable NOPE_X is not set", env={})
    refused(MINIMAL + '\n[clickhouse]\nuser = "${env:NOPE_Y}"\n',
            r"clickhouse\.user: environment variable NOPE_Y", env={})
    refused(MINIMAL + '\n[clickhouse]\npassword = "a"\npassword_env = "B"\n',
            r"both set", env={"B": "b"})


def test_kafka_spark_and_librdkafka_subsections() -> None:
    c = cfg("""
[kafka.spark]
"ssl.truststore.location" = "/etc/ts.jks"
"ssl.truststore.password" = "tspw"
[kafka.librdkafka]
"ssl.ca.location" = "/etc/ca.pem"
""")
    java = c.kafka.spark_source_options()
    assert java["kafka.ssl.truststore.location"] == "/etc/ts.jks"
    assert java["kafka.ssl.truststore.password"] == "tspw"
    assert "kafka.ssl.ca.location" not in java
    assert c.kafka.librdkafka_config()["ssl.ca.location"] == "/etc/ca.pem"
    assert "ssl.truststore.location" not in c.kafka.librdkafka_config()
    assert "tspw" not in repr(c)


def test_source_passthrough() -> None:
    c = cfg('\n[source]\n"fetchOffset.numRetries" = 5\nincludeHeaders = true\n')
    assert c.source == {"fetchOffset.numRetries": "5", "includeHeaders": "true"}


def test_overrides_validated_like_keys() -> None:
    c = cfg(overrides={"job.trigger_interval": "250ms", "kafka.bootstrap.servers": "b:1",
                       "job.metadata_group_id": "g2", "metrics.port": None})
    assert c.job.trigger_interval == 0.25
    assert c.kafka.bootstrap_servers == "b:1"
    assert c.job.metadata_group_id == "g2"
    refused(MINIMAL, r"job\.max_offsets_per_trigger: must be >= 1",
            overrides={"job.max_offsets_per_trigger": 0})


def test_registry_and_dlq_topics_must_not_be_data_topics() -> None:
    refused(MINIMAL + '\n[schemas]\ntopic = "events"\n', r"schemas\.topic.*also a data topic")
    refused(MINIMAL + '\n[dead_letters]\ntopic = "events"\n',
            r"dead_letters\.topic.*read back as input")


def test_starting_offsets() -> None:
    assert cfg(overrides={"job.starting_offsets": "latest"}).job.starting_offsets == "latest"
    refused(MINIMAL, r"job\.starting_offsets: expected \"earliest\" or \"latest\"",
            overrides={"job.starting_offsets": "-2"})


def test_invalid_toml() -> None:
    refused("[job\n", r"not valid TOML")


def test_secret_behaviour() -> None:
    s = Secret("x")
    assert repr(s) == "Secret('***')" and str(s) == "Secret('***')" and f"{s}" == "Secret('***')"
    assert s.reveal() == "x" and s == Secret("x") and bool(s) and not Secret("")


def test_dead_letter_missing_blocks_parse_and_refusals() -> None:
    config = cfg(overrides={"job.dead_letter_missing_blocks": ["events:3:17:120-950"]})
    [block] = config.job.dead_letter_missing_blocks
    assert (block.topic, block.partition, block.table_id, block.first, block.last) == (
        "events", 3, 17, 120, 950)
    assert str(block) == "events:3:17:120-950"
    for bad in (["events:3:17:950-120"], ["events:3:17"], "events:3:17:1-2"):
        with pytest.raises(ConfigError, match="dead_letter_missing_blocks"):
            cfg(overrides={"job.dead_letter_missing_blocks": bad})


def test_insert_quorum_defaults_to_every_replica_of_the_shard() -> None:
    config = cfg("""
[[topics]]
name = "single"
replicas = ["ch3:9000"]

[[topics]]
name = "pinned"
replicas = ["ch4:9000", "ch5:9000", "ch6:9000"]
insert_quorum = 2
""")
    quorum = {t.label: config.insert_quorum_for(t) for t in config.topics}
    assert quorum == {"events": 2, "single": 0, "pinned": 2}
    off = cfg("[clickhouse]\ninsert_quorum = 0\n")
    assert off.insert_quorum_for(off.topics[0]) == 0
    assert not cfg().clickhouse.allow_small_dedup_window


def test_allow_tables_without_coordinates_is_a_list_of_table_names() -> None:
    assert cfg().clickhouse.allow_tables_without_coordinates == ()
    allowed = cfg('[clickhouse]\nallow_tables_without_coordinates = ["shop.b", "shop.a"]\n')
    assert allowed.clickhouse.allow_tables_without_coordinates == ("shop.a", "shop.b")
    assert "allow_tables_without_coordinates=('shop.a', 'shop.b')" in repr(allowed.clickhouse)
    refused(MINIMAL + "[clickhouse]\nallow_tables_without_coordinates = true\n",
            r"clickhouse\.allow_tables_without_coordinates: expected a list of "
            r"\"database\.table\" strings, got True")
    refused(MINIMAL + '[clickhouse]\nallow_tables_without_coordinates = ["orders"]\n',
            r"clickhouse\.allow_tables_without_coordinates\[0\]: expected \"database\.table\", "
            r"got 'orders'")
    refused(MINIMAL + '[clickhouse]\nallow_table_without_coordinates = ["shop.a"]\n',
            r"unknown key; did you mean 'allow_tables_without_coordinates'\?")
