"""What the job checks before it starts Spark: the services it needs, each in one
bounded request, each failure one line naming the thing and the fix.

* Kafka answers and every configured topic exists (a pattern matches a topic);
* every ClickHouse replica of every shard answers and accepts the user;
* the dead-letter table exists with the expected columns on every replica;
* the job's group may deliver each topic into its shard (``spark.ownership``: one
  group per topic and shard; this check writes the ownership record of a first
  claim or a take-over, after every other check passed).

The registry's tables are checked later (``Driver.check_tables``), once the registry
is read. Nothing else is written: a refused start leaves no commit and no row.
"""

from __future__ import annotations

import time

from blockagg.aggregator import logs
from blockagg.aggregator.clickhouse.startup import check_replicas, driver_check
from blockagg.aggregator.clickhouse.writer import tls_arguments
from blockagg.aggregator.config import Config
from blockagg.aggregator.kafka.startup import check_topics
from blockagg.spark import ownership

log = logs.get("job")

CLICKHOUSE_TIMEOUT = 5.0


def run(config: Config, clickhouse: bool = True, run_id: str = "") -> None:
    """All start-up checks; raises the first failure (a ``BlockaggError``).
    ``clickhouse=False`` when the sinks are not ClickHouse (the
    ``BLOCKAGG_COMPONENTS`` testing hook): only Kafka is checked."""
    started = time.monotonic()
    names = [t.name for t in config.topics if t.name is not None]
    patterns = [t.pattern for t in config.topics if t.pattern is not None]
    found = check_topics(config.kafka.librdkafka_config(), names, patterns)
    timeout = min(CLICKHOUSE_TIMEOUT, config.clickhouse.connect_timeout)
    seen: set[tuple[str, int]] = set()
    ch = config.clickhouse
    tls = tls_arguments(ch.secure, ch.verify, ch.ca_certs)
    for topic in config.topics if clickhouse else ():
        replicas = [r for r in topic.replicas if (r.host, r.port) not in seen]
        seen.update((r.host, r.port) for r in replicas)
        check_replicas(
            (driver_check(r.host, r.port, config.clickhouse.user,
                          config.clickhouse.password.reveal(), timeout, tls=tls)
             for r in replicas),
            config.dead_letters.table)
    ownership.check(config, found, clickhouse, run_id)
    logs.event(log, "start-up checks passed", seconds=round(time.monotonic() - started, 3),
               topics=len(config.topics), replicas=len(seen))
