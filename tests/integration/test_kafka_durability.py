"""The durability start-up check against the real single-broker stack: a development
stack is accepted with one INFO line, in well under the start-up checks' budget. (The
refusals on a cluster of three brokers run against ``scripts/stack up --brokers 3`` in
``tests/faults/test_cluster_stack.py``; ``tests/unit/core/test_kafka_durability.py``
covers the rule with the describe outputs of one.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from blockagg.aggregator.kafka import durability
from blockagg.config import loads
from blockagg.spark import preflight

pytestmark = pytest.mark.integration


def test_a_single_broker_stack_is_accepted_with_one_notice_within_two_seconds(
        kafka_bootstrap: str, new_topic: Callable[..., str],
        caplog: pytest.LogCaptureFixture) -> None:
    topic = new_topic(partitions=2, prefix="dur")
    config = loads(f"""
[job]
checkpoint_location = "/tmp/ck"
[kafka]
"bootstrap.servers" = "{kafka_bootstrap}"
[[topics]]
name = "{topic}"
replicas = ["127.0.0.1:9000"]
""")
    brokers, topics = durability.read(config.kafka.librdkafka_config(), [topic],
                                      {config.job.owners_topic: "ownership records"})
    assert brokers == 1
    assert (topic, 1) in {(t.topic, t.replication_factor) for t in topics}
    assert "__consumer_offsets" in {t.topic for t in topics}
    caplog.clear()
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="blockagg"):
        result = preflight.check_durability(config, {topic: 2})
    seconds = time.monotonic() - started
    print(f"\ndurability check on the stack: {seconds:.3f}s")
    assert result.dev_stack and result.accepted
    said = [r for r in caplog.records if r.name.startswith("blockagg")
            and r.levelno >= logging.INFO]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.INFO, durability.DEV_NOTICE)]
