"""``arv``: the Aggregator Runtime Verifier's command line (see ``docs/verifier.md``).

``arv verify`` exits 0 when the history is clean, 1 when it found anomalies, 2 when it
could not run (usage, connection, unreadable ``__consumer_offsets``, records it could not
decode); errors go to stderr, findings to stdout. ``arv audit`` exits 0 when ClickHouse
holds every delivered message exactly once, 1 on discrepancies, 2 when it could not run.

Above 500 lines because it is one ``click`` group: every ``arv`` command with the flags they
share, read in one place as ``arv --help`` shows them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from datetime import UTC, datetime
from types import FrameType
from typing import Any, Final, TextIO

import click
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from blockagg import logs
from blockagg.aggregator.core.metadata import Metadata
from blockagg.aggregator.kafka.ownership import DEFAULT_TOPIC as DEFAULT_OWNERS_TOPIC
from blockagg.cli_tls import default_endpoint, tls_from_flags, tls_options
from blockagg.proto.envelope import is_table_name
from blockagg.verifier import ownership
from blockagg.verifier.audit import DEFAULT_EXAMPLES, AuditReport, audit_partitions, make_plan
from blockagg.verifier.exceptions import VerifierError
from blockagg.verifier.history import DecodeFailure, HistoryReader, Tombstone, parse_settings
from blockagg.verifier.ownership import OwnershipConflict
from blockagg.verifier.rules import Anomaly, AnomalyKind, Commit, Verifier

EXIT_CLEAN: Final = 0
EXIT_ANOMALIES: Final = 1
EXIT_CANNOT_RUN: Final = 2

LAG_INTERVAL_SECONDS: Final = 10.0
DEFAULT_METRICS_PORT: Final = 9465
"""``--metrics-port`` without a value: one above the job's ``[metrics] port`` (9464), so
``arv verify --follow --metrics-port`` runs beside the job on one host without a clash."""


class Metrics:
    """The ``blockagg_arv_*`` Prometheus metrics of one ``arv verify --follow`` run."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.commits = Counter(
            "blockagg_arv_commits_checked", "Offset commits checked by the rules.",
            registry=self.registry)
        self.anomalies = Counter(
            "blockagg_arv_anomalies", "Anomalies (and foreign-writer notices) found, by kind.",
            ["kind"], registry=self.registry)
        self.last_commit = Gauge(
            "blockagg_arv_last_commit_timestamp_seconds",
            "Commit time of the last commit checked, per group/topic/partition.",
            ["group", "topic", "partition"], registry=self.registry)
        self.lag = Gauge(
            "blockagg_arv_lag_records",
            "Records of __consumer_offsets not yet read by arv.", registry=self.registry)
        self.decode_errors = Counter(
            "blockagg_arv_decode_errors",
            "Records of __consumer_offsets of the watched groups that did not decode.",
            registry=self.registry)
        for kind in AnomalyKind:
            self.anomalies.labels(kind=kind.value)

    def commit(self, commit: Commit, anomalies: list[Anomaly]) -> None:
        self.commits.inc()
        self.last_commit.labels(commit.group, commit.topic, str(commit.partition)).set(
            commit.commit_timestamp / 1000)
        for anomaly in anomalies:
            self.anomalies.labels(kind=anomaly.kind.value).inc()


def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    try:
        return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return f"{ms}ms"


def _describe(metadata: Metadata | None, table_id: int | None, raw: str | None = None) -> str:
    if metadata is None:
        if raw is None:
            return "-"
        return f"raw={raw[:40]!r}" + ("..." if len(raw) > 40 else "")
    text = (f"run={metadata.run:x} batch={metadata.batch} [{metadata.start},{metadata.end}) "
            f"resume={metadata.resume} blocks={len(metadata.blocks)}")
    block = metadata.block_of(table_id) if table_id is not None else None
    if block is not None:
        text += f" t{block.table_id}=[{block.first},{block.last}]"
    return text


class Report:
    """Writes anomalies as a human table (default) or JSON lines, and counts them."""

    COLUMNS: Final = ("PARTITION", "COMMIT TIME", "ANOMALY", "PREVIOUS (M)", "CURRENT (M')",
                      "DETAIL")

    def __init__(self, out: TextIO, as_json: bool, strict: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.strict = strict
        self.anomalies = 0
        self.notices = 0
        self._header_written = False

    def add(self, anomaly: Anomaly) -> None:
        notice = anomaly.kind.is_notice and not self.strict
        if notice:
            self.notices += 1
        else:
            self.anomalies += 1
        if self.as_json:
            record = anomaly.as_dict()
            record["severity"] = "notice" if notice else "anomaly"
            self.out.write(json.dumps(record, sort_keys=True) + "\n")
        else:
            if not self._header_written:
                self.out.write("\t".join(self.COLUMNS) + "\n")
                self._header_written = True
            row = (
                f"{anomaly.group}/{anomaly.topic}[{anomaly.partition}]",
                _time(anomaly.commit_timestamp),
                anomaly.kind.value + (" (notice)" if notice else ""),
                _describe(anomaly.previous, anomaly.table_id),
                _describe(anomaly.current, anomaly.table_id, anomaly.raw_metadata),
                anomaly.detail,
            )
            self.out.write("\t".join(row) + "\n")
        self.out.flush()

    def add_conflict(self, conflict: OwnershipConflict) -> None:
        """A group delivering a topic that another group owns: an anomaly."""
        self.anomalies += 1
        if self.as_json:
            self.out.write(json.dumps(conflict.as_dict(), sort_keys=True) + "\n")
        else:
            self.out.write(f"ownership conflict: {conflict.detail}\n")
        self.out.flush()


def _parse_start(values: tuple[str, ...]) -> dict[int, int]:
    start: dict[int, int] = {}
    for value in values:
        partition, sep, offset = value.partition("=")
        try:
            if not sep:
                raise ValueError
            start[int(partition)] = int(offset)
        except ValueError:
            raise click.BadParameter(
                f"{value!r} is not PARTITION=OFFSET (e.g. 17=123456)", param_hint="--from"
            ) from None
        if start[int(partition)] < 0 or int(partition) < 0:
            raise click.BadParameter(f"{value!r} has a negative number", param_hint="--from")
    return start


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """The Aggregator Runtime Verifier: `verify` proves the committed history of a
    group has no backward, overlap or gap; `audit` proves ClickHouse holds each
    delivered message exactly once."""
    logs.setup(os.environ.get("BLOCKAGG_LOG_LEVEL", "WARNING"), "text")


@cli.command()
@click.option("--bootstrap-servers", required=True, metavar="HOST:PORT[,...]",
              help="Kafka bootstrap servers (as bootstrap.servers).")
@click.option("--group", "groups", multiple=True, required=True, metavar="GROUP",
              help="Consumer group of the aggregator job to verify; repeatable.")
@click.option("--topic", "topics", multiple=True, metavar="TOPIC",
              help="Only verify commits for this topic; repeatable. Default: all topics.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line per finding.")
@click.option("--follow", is_flag=True, help="Keep reading new commits until interrupted.")
@click.option("--duration", type=click.FloatRange(min=0), metavar="SECONDS",
              help="With --follow: stop after this many seconds.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), metavar="[PORT]",
              is_flag=False, flag_value=DEFAULT_METRICS_PORT,
              help=f"With --follow: serve Prometheus metrics on this port (without a value: "
                   f"{DEFAULT_METRICS_PORT}, beside the job's 9464).")
@click.option("--metrics-addr", default="0.0.0.0", show_default=True,
              help="With --metrics-port: the address to listen on.")
@click.option("--from", "start", multiple=True, metavar="PARTITION=OFFSET",
              help="Start reading this __consumer_offsets partition at OFFSET instead of "
                   "the beginning; repeatable.")
@click.option("--strict", is_flag=True,
              help="Count foreign-writer notices as anomalies (exit 1).")
@click.option("--require-commits/--no-require-commits", default=True, show_default=True,
              help="Exit 2 when a --group has no offset commit at all (a misspelled group "
                   "must not pass a CI gate).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              metavar="SECONDS", help="Timeout of metadata and watermark requests.")
@click.option("-X", "--setting", "settings", multiple=True, metavar="KEY=VALUE",
              help="Kafka client setting passed through (e.g. -X security.protocol=SSL); "
                   "repeatable.")
@click.option("--owners-topic", default=DEFAULT_OWNERS_TOPIC, show_default=True,
              metavar="TOPIC", help="The ownership records' topic (the job's "
              "job.owners_topic): a group delivering a topic another group owns is an "
              "anomaly.")
def verify(
    bootstrap_servers: str,
    groups: tuple[str, ...],
    topics: tuple[str, ...],
    as_json: bool,
    follow: bool,
    duration: float | None,
    metrics_port: int | None,
    metrics_addr: str,
    start: tuple[str, ...],
    strict: bool,
    require_commits: bool,
    timeout: float,
    settings: tuple[str, ...],
    owners_topic: str,
) -> None:
    """Check the committed metadata history of GROUP(s) for Backward, Overlap and Gap.

    Exit codes: 0 clean, 1 anomalies found, 2 could not run (or, with
    --require-commits, the default, a group without any commit).
    """
    if (metrics_port is not None or duration is not None) and not follow:
        raise click.UsageError("--metrics-port and --duration need --follow")
    start_offsets = _parse_start(start)
    try:
        passthrough = parse_settings(settings)
    except VerifierError as exc:
        raise click.BadParameter(str(exc), param_hint="-X") from None
    try:
        code = _verify(bootstrap_servers, groups, topics, as_json, follow, duration,
                       metrics_port, metrics_addr, start_offsets, strict, timeout, passthrough,
                       require_commits, owners_topic)
    except VerifierError as exc:
        click.echo(f"arv: error: {exc}", err=True)
        sys.exit(EXIT_CANNOT_RUN)
    sys.exit(code)


def _verify(
    bootstrap_servers: str,
    groups: tuple[str, ...],
    topics: tuple[str, ...],
    as_json: bool,
    follow: bool,
    duration: float | None,
    metrics_port: int | None,
    metrics_addr: str,
    start: dict[int, int],
    strict: bool,
    timeout: float,
    settings: dict[str, str],
    require_commits: bool = True,
    owners_topic: str = DEFAULT_OWNERS_TOPIC,
) -> int:
    report = Report(click.get_text_stream("stdout"), as_json, strict)
    metrics = Metrics() if follow else None
    server: Any = None
    decode_failures = 0
    seen_groups: set[str] = set()
    committed_topics: set[tuple[str, str]] = set()
    with HistoryReader(bootstrap_servers, groups, topics, settings, start, timeout) as reader:
        if not reader.partitions:
            click.echo(f"arv: warning: {bootstrap_servers} has no __consumer_offsets topic "
                       "yet: no group has committed an offset there", err=True)
        verifier = Verifier(reader.high_watermark, reader.incarnation)
        if metrics is not None and metrics_port is not None:
            try:
                server, _ = start_http_server(metrics_port, metrics_addr,
                                              registry=metrics.registry)
            except OSError as exc:
                raise _ServeError(f"cannot serve metrics on {metrics_addr}:{metrics_port}: "
                                  f"{exc.strerror or exc}") from exc
        last_lag = -LAG_INTERVAL_SECONDS

        def tick() -> None:
            nonlocal last_lag
            if metrics is not None and time.monotonic() - last_lag >= LAG_INTERVAL_SECONDS:
                metrics.lag.set(reader.lag())
                last_lag = time.monotonic()

        try:
            with _Stopper(duration) as stop:
                for event in reader.events(follow=follow, stop=stop, tick=tick):
                    if isinstance(event, Commit):
                        seen_groups.add(event.group)
                        committed_topics.add((event.group, event.topic))
                        anomalies = verifier.observe(event)
                        for anomaly in anomalies:
                            report.add(anomaly)
                        if metrics is not None:
                            metrics.commit(event, anomalies)
                    elif isinstance(event, Tombstone):
                        verifier.observe_tombstone(event.group, event.topic, event.partition)
                    elif isinstance(event, DecodeFailure):
                        decode_failures += 1
                        if metrics is not None:
                            metrics.decode_errors.inc()
                        click.echo(f"arv: warning: record {event.coordinator_offset} of "
                                   f"__consumer_offsets[{event.coordinator_partition}] skipped: "
                                   f"{event.error}", err=True)
        except KeyboardInterrupt:
            pass
        finally:
            if server is not None:
                server.shutdown()
    owned = ownership.read_conflicts(bootstrap_servers, settings, owners_topic,
                                     committed_topics, timeout)
    for conflict in owned:
        report.add_conflict(conflict)
    missing = sorted(set(groups) - seen_groups)
    for group in missing:
        click.echo(f"arv: {'error' if require_commits else 'warning'}: no offset commit of "
                   f"group {group!r} found"
                   + (f" for topics {', '.join(topics)}" if topics else "")
                   + (": nothing proven (a misspelled --group?); --no-require-commits "
                      "accepts it" if require_commits else ""), err=True)
    click.echo(
        f"arv: checked {verifier.commits_checked} commits of {verifier.partitions} "
        f"partitions ({reader.records_read} records read): {report.anomalies} anomalies, "
        f"{report.notices} notices, {len(owned)} ownership conflicts, "
        f"{verifier.tombstones} tombstones, "
        f"{decode_failures} undecodable records", err=True)
    if report.anomalies:
        return EXIT_ANOMALIES
    if decode_failures:
        click.echo("arv: error: some records of the watched groups did not decode, so the "
                   "history is incomplete; see the warnings above", err=True)
        return EXIT_CANNOT_RUN
    if missing and require_commits:
        return EXIT_CANNOT_RUN
    return EXIT_CLEAN


class _ServeError(VerifierError):
    """The metrics endpoint could not be served."""


class _Stopper:
    """Tells a ``--follow`` loop to stop: after ``duration`` seconds, or on SIGTERM."""

    def __init__(self, duration: float | None) -> None:
        self.deadline = None if duration is None else time.monotonic() + duration
        self.stopping = False
        self._previous: Any = None

    def __enter__(self) -> _Stopper:
        with contextlib.suppress(ValueError):
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def __call__(self) -> bool:
        return self.stopping or (self.deadline is not None and time.monotonic() >= self.deadline)


def _parse_from_offsets(values: tuple[str, ...]) -> dict[tuple[str | None, int], int]:
    start: dict[tuple[str | None, int], int] = {}
    for value in values:
        where, sep, offset = value.rpartition("=")
        topic, colon, partition = where.rpartition(":")
        try:
            if not sep or (colon and not topic):
                raise ValueError
            key, number = (topic or None, int(partition)), int(offset)
        except ValueError:
            raise click.BadParameter(
                f"{value!r} is not [TOPIC:]PARTITION=OFFSET (e.g. orders:3=123456)",
                param_hint="--from-offset") from None
        if number < 0 or key[1] < 0:
            raise click.BadParameter(f"{value!r} has a negative number",
                                     param_hint="--from-offset")
        start[key] = number
    return start


def _parse_table(value: str, option: str) -> str:
    if not is_table_name(value):
        raise click.BadParameter(f"{value!r} is not database.table", param_hint=option)
    return value


@cli.command()
@click.option("--bootstrap-servers", required=True, metavar="HOST:PORT[,...]",
              help="Kafka bootstrap servers (as bootstrap.servers).")
@click.option("--group", required=True, metavar="GROUP",
              help="Consumer group of the aggregator job whose deliveries to audit.")
@click.option("--topic", "topics", multiple=True, metavar="TOPIC",
              help="Audit this topic; repeatable. Default: every topic the group committed.")
@click.option("--from-offset", "from_offsets", multiple=True,
              metavar="[TOPIC:]PARTITION=OFFSET",
              help="Audit the partition from OFFSET on (default: its first offset, as "
                   "retention left it); repeatable.")
@click.option("--clickhouse", "clickhouse", default=None, metavar="HOST:PORT",
              show_default="$BLOCKAGG_CH_HOST:first of $BLOCKAGG_CH_PORTS, or localhost:9000",
              help="ClickHouse native-protocol endpoint (one replica of the shard).")
@tls_options
@click.option("--clickhouse-user", envvar="BLOCKAGG_CH_USER", default="default",
              show_default=True, help="ClickHouse user (env BLOCKAGG_CH_USER).")
@click.option("--clickhouse-password-env", default="BLOCKAGG_CH_PASSWORD", show_default=True,
              metavar="NAME", help="Environment variable holding the ClickHouse password.")
@click.option("--database", "databases", multiple=True, metavar="DB",
              help="Audit the tables with _topic/_partition/_offset of this database; "
                   "repeatable. Default: every database.")
@click.option("--table", "tables", multiple=True, metavar="DB.TABLE",
              help="Audit this table (it must have the coordinate columns); repeatable.")
@click.option("--dead-letter-table", default="blockagg.dead_letters", show_default=True,
              metavar="DB.TABLE", help="The job's dead-letter table ('' for none).")
@click.option("--examples", type=click.IntRange(0, 1000), default=DEFAULT_EXAMPLES,
              show_default=True, metavar="N", help="Offsets shown per kind of discrepancy.")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line per topic/partition/table.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              metavar="SECONDS", help="Timeout of Kafka requests and of connecting.")
@click.option("-X", "--setting", "settings", multiple=True, metavar="KEY=VALUE",
              help="Kafka client setting passed through; repeatable.")
@click.option("--clickhouse-setting", "ch_settings", multiple=True, metavar="KEY=VALUE",
              help="ClickHouse query setting (e.g. max_bytes_before_external_sort=...); "
                   "repeatable.")
@click.option("--owners-topic", default=DEFAULT_OWNERS_TOPIC, show_default=True,
              metavar="TOPIC", help="The ownership records' topic (the job's "
              "job.owners_topic): a group delivering a topic another group owns is an "
              "anomaly.")
def audit(
    bootstrap_servers: str,
    group: str,
    topics: tuple[str, ...],
    from_offsets: tuple[str, ...],
    clickhouse: str | None,
    secure: bool,
    ca_certs: str | None,
    no_verify: bool,
    clickhouse_user: str,
    clickhouse_password_env: str,
    databases: tuple[str, ...],
    tables: tuple[str, ...],
    dead_letter_table: str,
    examples: int,
    as_json: bool,
    timeout: float,
    settings: tuple[str, ...],
    ch_settings: tuple[str, ...],
    owners_topic: str,
) -> None:
    """Prove that ClickHouse holds every message GROUP delivered exactly once.

    For tables with _topic, _partition, _offset columns. Exit codes: 0 clean,
    1 discrepancies found, 2 could not run.
    """
    start = _parse_from_offsets(from_offsets)
    table_names = [_parse_table(t, "--table") for t in tables]
    dlt = _parse_table(dead_letter_table, "--dead-letter-table") if dead_letter_table else None
    clickhouse = clickhouse or default_endpoint(secure)
    tls = tls_from_flags(secure, no_verify, ca_certs)
    host, sep, port = clickhouse.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise click.BadParameter(f"{clickhouse!r} is not HOST:PORT", param_hint="--clickhouse")
    try:
        passthrough = parse_settings(settings)
    except VerifierError as exc:
        raise click.BadParameter(str(exc), param_hint="-X") from None
    query_settings: dict[str, str] = {}
    for pair in ch_settings:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE",
                                     param_hint="--clickhouse-setting")
        query_settings[key.strip()] = value
    password = os.environ.get(clickhouse_password_env, "")
    try:
        code = _audit(bootstrap_servers, group, list(topics), start, host, int(port),
                      clickhouse_user, password, list(databases), table_names, dlt, examples,
                      as_json, timeout, passthrough, query_settings,
                      tls, owners_topic)
    except VerifierError as exc:
        click.echo(f"arv: error: {exc}", err=True)
        sys.exit(EXIT_CANNOT_RUN)
    sys.exit(code)


def _audit(bootstrap_servers: str, group: str, topics: list[str],
           start: dict[tuple[str | None, int], int], host: str, port: int, user: str,
           password: str, databases: list[str], tables: list[str], dlt: str | None,
           examples: int, as_json: bool, timeout: float, settings: dict[str, str],
           query_settings: dict[str, str], tls: dict[str, Any],
           owners_topic: str = DEFAULT_OWNERS_TOPIC) -> int:
    from blockagg.verifier.audit_sources import ClickHouseAuditReader, KafkaAuditReader

    report = AuditReport(click.get_text_stream("stdout"), as_json)
    begun = time.monotonic()
    with KafkaAuditReader(bootstrap_servers, group, settings, timeout) as kafka, \
            ClickHouseAuditReader(host, port, user, password, query_settings,
                                  timeout, tls) as clickhouse:
        warnings: list[str] = []
        plan = make_plan(kafka, clickhouse, topics, tables, databases, dlt, start, examples,
                         warnings)
        for warning in warnings:
            click.echo(f"arv: warning: {warning}", err=True)
        for partition in audit_partitions(kafka, clickhouse, plan):
            for note in partition.notes:
                click.echo(f"arv: warning: {note}", err=True)
            report.add(partition)
    owned = ownership.read_conflicts(bootstrap_servers, settings, owners_topic,
                           [(group, t) for t in plan.topics], timeout)
    for conflict in owned:
        if as_json:
            click.echo(json.dumps(conflict.as_dict(), sort_keys=True))
        else:
            click.echo(f"ownership conflict: {conflict.detail}")
    s = report.summary
    elapsed = time.monotonic() - begun
    click.echo(
        f"arv: audited {len(plan.tables)} tables over {s.partitions} partitions of "
        f"{len(plan.topics)} topics in {elapsed:.1f}s: {s.messages_read} messages read, "
        f"{s.count_rows_read} offset counts read, {s.unaudited_messages} messages of "
        f"unaudited tables, {s.discrepancies} discrepancies, {len(owned)} ownership "
        "conflicts", err=True)
    return EXIT_ANOMALIES if s.discrepancies or owned else EXIT_CLEAN


def main() -> None:
    """Console entry point of ``arv``."""
    cli(prog_name="arv")
