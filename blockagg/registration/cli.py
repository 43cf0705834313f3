"""``ba-schema``: register protobuf message types for ClickHouse tables, list and show
registrations, set a table's compatibility mode, and check every version against the
live table.

Exit codes: 0 ok, 1 check failed (mismatches or compatibility differences listed),
2 usage, connection or registry error. Errors go to stderr; ``--json`` prints one
JSON document on stdout.
Connection settings default to the ``BLOCKAGG_*`` environment variables that
``scripts/stack env`` exports.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from blockagg import logs
from blockagg.cli_tls import (
    TLS_FIX,
    default_endpoint,
    tls_from_flags,
    tls_options,
)
from blockagg.exceptions import BlockaggError
from blockagg.proto.modes import DEFAULT_MODE, Mode
from blockagg.proto.registry import DEFAULT_TOPIC, Registration, Registry, Store
from blockagg.registration.exceptions import IncompatibleSchema
from blockagg.registration.register import next_registration, register, set_compatibility

ColumnsFn = Callable[[str], Sequence[Any]]
DedupFn = Callable[[str], "str | None"]
CHECK_TIMEOUT = 8.0


def _no_dedup_check(table: str) -> str | None:
    return None


@dataclass
class Context:
    as_json: bool
    store: Callable[[], Store]
    columns: ColumnsFn
    dedup: DedupFn = _no_dedup_check
    """Why the live table would not drop a retried block (``writer.check_tables``),
    or None."""


def _fail(ctx: Context, code: int, message: str, **extra: Any) -> NoReturn:
    if ctx.as_json:
        click.echo(json.dumps({"ok": False, "error": message, **extra}, indent=2))
    click.echo(f"ba-schema: {message}", err=True)
    sys.exit(code)


def _clickhouse(hosts: Sequence[str], user: str, password: str,
                tls: dict[str, Any]) -> tuple[ColumnsFn, DedupFn]:
    """The live table's columns, and why it would not drop a retried block, each read
    from the shard given by ``--clickhouse``."""
    from blockagg.aggregator.clickhouse.writer import ClickHouseBlockWriter

    def connect() -> ClickHouseBlockWriter:
        from blockagg.aggregator.clickhouse.startup import Fixes, check_replicas, driver_check
        from blockagg.aggregator.clickhouse.writer import Replica, WriterConfig

        replicas = []
        for h in hosts:
            host, _, port = h.partition(":")
            replicas.append(Replica(host, int(port or 9000)))
        # one bounded, unretried query per endpoint first: a server that is down or
        # refuses the user is one line naming it, not the writer's retries
        fixes = Fixes("--clickhouse HOST:PORT ($BLOCKAGG_CH_HOST, $BLOCKAGG_CH_PORTS)",
                      "--user / --password ($BLOCKAGG_CH_USER, $BLOCKAGG_CH_PASSWORD)",
                      TLS_FIX)
        check_replicas((driver_check(r.host, r.port, user, password, CHECK_TIMEOUT, fixes,
                                     tls) for r in replicas), None)
        return ClickHouseBlockWriter(WriterConfig(tuple(replicas), user=user,
                                                  password=password, max_attempts=2,
                                                  tls=tls))

    def columns(table: str) -> Sequence[Any]:
        writer = connect()
        try:
            return writer.describe(table).columns
        finally:
            writer.close()

    def dedup(table: str) -> str | None:
        from blockagg.aggregator.clickhouse.exceptions import (
            CoordinatesMissing,
            DedupNotConfigured,
        )

        writer = connect()
        try:
            writer.check_tables([table])
        except CoordinatesMissing:  # the job's own check, with its opt-out
            return None
        except DedupNotConfigured as exc:
            return str(exc)
        finally:
            writer.close()
        return None

    return columns, dedup


def _reachable_store(config: dict[str, Any], topic: str) -> Store:
    """The registry topic's store, once Kafka answered (one line naming the
    bootstrap servers otherwise, within ``CHECK_TIMEOUT``)."""
    from blockagg.aggregator.kafka.log_store import KafkaStore
    from blockagg.aggregator.kafka.startup import list_topics

    list_topics(config, CHECK_TIMEOUT,
                fix="--bootstrap-servers (or $BLOCKAGG_BOOTSTRAP_SERVERS)")
    return KafkaStore(config, topic)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bootstrap-servers", envvar="BLOCKAGG_BOOTSTRAP_SERVERS",
              default="localhost:9092",
              show_default="$BLOCKAGG_BOOTSTRAP_SERVERS, else localhost:9092",
              help="Kafka bootstrap.servers.")
@click.option("--topic", envvar="BLOCKAGG_SCHEMA_TOPIC", default=DEFAULT_TOPIC,
              show_default=True, help="The compacted registry topic.")
@click.option("-X", "kafka_props", multiple=True, metavar="KEY=VALUE",
              help="Extra librdkafka setting (SASL/TLS…), repeatable.")
@click.option("--clickhouse", "ch_hosts", multiple=True, metavar="HOST:PORT",
              help="ClickHouse native-protocol endpoint (default: $BLOCKAGG_CH_HOST and "
                   "the first of $BLOCKAGG_CH_PORTS).")
@click.option("--user", envvar="BLOCKAGG_CH_USER", default="default", show_default=True)
@click.option("--password", envvar="BLOCKAGG_CH_PASSWORD", default="")
@tls_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.pass_context
def cli(ctx: click.Context, bootstrap_servers: str, topic: str, kafka_props: tuple[str, ...],
        ch_hosts: tuple[str, ...], user: str, password: str, secure: bool,
        ca_certs: str | None, no_verify: bool, as_json: bool) -> None:
    """Register protobuf message types for ClickHouse tables."""
    logs.setup(os.environ.get("BLOCKAGG_LOG_LEVEL", "WARNING"), "text")
    if isinstance(ctx.obj, Context):
        ctx.obj.as_json = as_json
        return
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers}
    for prop in kafka_props:
        key, sep, value = prop.partition("=")
        if not sep:
            raise click.UsageError(f"-X expects KEY=VALUE, got {prop!r}")
        config[key] = value
    hosts = ch_hosts or (default_endpoint(secure),)
    tls = tls_from_flags(secure, no_verify, ca_certs)
    columns, dedup = _clickhouse(hosts, user, password, tls)
    ctx.obj = Context(as_json, lambda: _reachable_store(config, topic), columns, dedup)


def _summary(reg: Registration) -> dict[str, Any]:
    return {"table": reg.table, "table_id": reg.table_id, "latest": reg.latest.version,
            "message": reg.latest.message_name, "versions": [v.version for v in reg.versions],
            "compatibility": reg.compatibility or DEFAULT_MODE.value}


def _columns(ctx: Context, table: str) -> Sequence[Any]:
    try:
        return ctx.columns(table)
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    except Exception as exc:
        _fail(ctx, 2, f"can't read the columns of {table} from ClickHouse: {exc}")


def _mismatches(descriptor: Any, columns: Sequence[Any]) -> list[str]:
    from blockagg.rows.columns import match_columns

    return match_columns(descriptor, columns)[1]


def _changed(table_id: int, version: Any, columns: Sequence[Any]) -> list[str]:
    """For a version registered with its columns: what the live table lost of them
    (the job refuses that version's batches, ``ColumnsChanged``)."""
    if not version.columns:
        return []
    from blockagg.rows.columns import Column, make_plan
    from blockagg.rows.prepare import column_changes

    plan, _ = make_plan("", table_id, version.version, version.descriptor,
                        [Column(*c) for c in version.columns])
    return [f"{p} since registration (the job refuses this version's batches)"
            for p in column_changes(plan, columns)]


_MODE = click.Choice([m.value for m in Mode], case_sensitive=False)


@cli.command("register")
@click.argument("table")
@click.option("--proto", "proto_file", type=click.Path(dir_okay=False, path_type=Path),
              help=".proto file, compiled now with the bundled protoc.")
@click.option("-I", "--include", "includes", multiple=True,
              type=click.Path(file_okay=False, path_type=Path), help="protoc -I directory.")
@click.option("--descriptor-set", type=click.Path(dir_okay=False, path_type=Path),
              help="FileDescriptorSet from protoc --include_imports --descriptor_set_out.")
@click.option("--message", "message_name", required=True, help="Full message name.")
@click.option("--dry-run", is_flag=True, help="Check and show, write nothing.")
@click.option("--no-check", is_flag=True,
              help="Skip the check against the live table (compatibility is then judged on "
                   "the descriptors alone).")
@click.option("--compatibility", "mode", type=_MODE, default=None, metavar="MODE",
              help="The table's compatibility mode (" + ", ".join(m.value for m in Mode)
                   + "), set with its first registration (default "
                   f"{DEFAULT_MODE.value}); for a registered table it must be its mode "
                   "(change it with 'ba-schema compatibility').")
@click.option("--force-incompatible", is_flag=True,
              help="Register even if the version breaks the table's compatibility mode; "
                   "the differences are printed and recorded with the version.")
@click.option("--allow-no-dedup", is_flag=True,
              help="Register even if the table does not drop a retried block (a warning "
                   "on stderr); the job still refuses to start while it can't.")
@click.pass_obj
def register_cmd(ctx: Context, table: str, proto_file: Path | None, includes: tuple[Path, ...],
                 descriptor_set: Path | None, message_name: str, dry_run: bool,
                 no_check: bool, mode: str | None, force_incompatible: bool,
                 allow_no_dedup: bool) -> None:
    """Register MESSAGE as the next schema version of TABLE (database.table).

    The version must fit the live table's columns and keep the table's
    compatibility mode against the registered versions (BACKWARD by default: the
    new version reads data written with the latest one). Exit 1 lists every
    mismatch or difference; nothing is written."""
    from blockagg.proto.descriptors import compile_proto, load_descriptor

    if (proto_file is None) == (descriptor_set is None):
        _fail(ctx, 2, "give exactly one of --proto FILE or --descriptor-set FILE")
    try:
        if proto_file is not None:
            fds = compile_proto(proto_file, list(includes) or None)
        else:
            assert descriptor_set is not None
            fds = descriptor_set.read_bytes()
        descriptor = load_descriptor(fds, message_name)
    except (BlockaggError, OSError) as exc:
        _fail(ctx, 2, str(exc))
    columns = None if no_check else _columns(ctx, table)
    mismatches = [] if columns is None else _mismatches(descriptor, columns)
    if mismatches:
        _report_check(ctx, table, mismatches)
    if not no_check:
        _check_dedup(ctx, table, allow_no_dedup)
    compatibility = None if mode is None else Mode(mode.upper())
    try:
        if dry_run:
            registry = Registry.load(ctx.store())
            new = next_registration(registry, table, message_name, fds,
                                    compatibility=compatibility, columns=columns,
                                    force=force_incompatible)
            reg, changed = new or registry.get(table), new is not None
        else:
            reg, changed = register(ctx.store(), table, message_name, fds,
                                    compatibility=compatibility, columns=columns,
                                    force=force_incompatible)
    except IncompatibleSchema as exc:
        _report_incompatible(ctx, exc)
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    forced = list(reg.latest.forced_incompatibilities) if changed else []
    if forced:
        verb = "would register" if dry_run else "registering"
        click.echo(f"ba-schema: WARNING: {verb} {table} version {reg.latest.version} although "
                   f"it is NOT {reg.mode.value} compatible (--force-incompatible); recorded "
                   "with the version:", err=True)
        for d in forced:
            click.echo(f"  ! {d}", err=True)
    result = {"ok": True, "dry_run": dry_run, "changed": changed, **_summary(reg),
              "forced_incompatibilities": forced}
    if ctx.as_json:
        click.echo(json.dumps(result, indent=2))
        return
    verb = "would register" if dry_run else "registered"
    if not result["changed"]:
        click.echo(f"{table}: unchanged, latest version {result['latest']} is identical")
    else:
        click.echo(f"{verb} {table} version {result['latest']} (table id "
                   f"{result['table_id']}): {message_name}")


def _check_dedup(ctx: Context, table: str, allow: bool) -> None:
    """Refuse (exit 1) a table that would not drop a retried block: the job refuses to
    start on it (invariant 3), so registering it only defers the refusal.
    ``--allow-no-dedup`` registers it anyway, with the reason on stderr."""
    try:
        reason = ctx.dedup(table)
    except BlockaggError as exc:
        _fail(ctx, 2, f"can't read the engine and settings of {table} from ClickHouse: {exc}")
    if reason is None:
        return
    if allow:
        click.echo(f"ba-schema: WARNING: {reason}; registering anyway (--allow-no-dedup): "
                   "the job refuses to start while it does not deduplicate", err=True)
        return
    _fail(ctx, 1, f"{reason}; nothing was registered (or register anyway with "
                  "--allow-no-dedup: the job refuses to start on it until it deduplicates)",
          table=table)


def _report_incompatible(ctx: Context, exc: IncompatibleSchema) -> NoReturn:
    if ctx.as_json:
        click.echo(json.dumps({"ok": False, "table": exc.table, "compatibility": exc.mode,
                               "differences": exc.differences}, indent=2))
    click.echo(f"ba-schema: {exc.table}: the new version is not {exc.mode} compatible; "
               "nothing was registered:", err=True)
    for d in exc.differences:
        click.echo(f"  - {d}", err=True)
    click.echo(f"fix the message type, or change the mode (ba-schema compatibility "
               f"{exc.table} MODE), or override this once with --force-incompatible",
               err=True)
    sys.exit(1)


def _report_check(ctx: Context, table: str, mismatches: list[str]) -> NoReturn:
    if ctx.as_json:
        click.echo(json.dumps({"ok": False, "table": table, "mismatches": mismatches},
                              indent=2))
    click.echo(f"ba-schema: {table} does not match its message type:", err=True)
    for m in mismatches:
        click.echo(f"  - {m}", err=True)
    sys.exit(1)


def _registry(ctx: Context) -> Registry:
    try:
        return Registry.load(ctx.store())
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))


@cli.command("list")
@click.pass_obj
def list_cmd(ctx: Context) -> None:
    """List registered tables with their id and latest version."""
    regs = _registry(ctx).registrations()
    if ctx.as_json:
        click.echo(json.dumps([_summary(r) for r in regs], indent=2))
        return
    for r in regs:
        click.echo(f"{r.table_id:>5}  {r.table:<40} v{r.latest.version:<4} "
                   f"{r.latest.message_name}")


@cli.command("show")
@click.argument("table")
@click.option("--version", "version", type=int, default=0, help="0 = latest.")
@click.pass_obj
def show_cmd(ctx: Context, table: str, version: int) -> None:
    """Show a registration: id, versions and the message's fields."""
    try:
        reg = _registry(ctx).get(table)
        v = reg.version(version)
        descriptor = v.descriptor
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    from blockagg.rows.types import describe

    fields = [{"name": f.name, "number": f.number, "type": describe(f)}
              for f in descriptor.fields]
    if ctx.as_json:
        click.echo(json.dumps({**_summary(reg), "version": v.version,
                               "message": v.message_name, "fields": fields,
                               "registered_at_ms": v.registered_at_ms,
                               "position": v.position,
                               "columns": [{"name": n, "type": t, "default_kind": k,
                                            "default_expression": e}
                                           for n, t, k, e in v.columns],
                               "forced_incompatibilities": list(v.forced_incompatibilities)},
                              indent=2))
        return
    click.echo(f"{reg.table} (table id {reg.table_id}, compatibility "
               f"{reg.compatibility or DEFAULT_MODE.value}) version {v.version} of "
               f"{', '.join(str(x.version) for x in reg.versions)}: {v.message_name}")
    if v.forced_incompatibilities:
        click.echo("  registered with --force-incompatible over:")
        for d in v.forced_incompatibilities:
            click.echo(f"    ! {d}")
    for f in fields:
        click.echo(f"  {f['number']:>4}  {f['name']:<30} {f['type']}")
    if v.columns:
        click.echo(f"  registered against the columns (registry position {v.position}): "
                   + ", ".join(f"{n} {t}" for n, t, _, _ in v.columns))
    else:
        click.echo("  registered without columns (--no-check): plans against the live "
                   "table; register it again with the check to pin them")


@cli.command("check")
@click.argument("table")
@click.option("--version", "version", type=int, default=None,
              help="Check only this version (0 = latest); default: every version.")
@click.pass_obj
def check_cmd(ctx: Context, table: str, version: int | None) -> None:
    """Check every registered version of TABLE against the live table's columns.

    Every version stays live (a producer may pin it, and schema_version 0 resolves
    to older versions for older messages), so after an ALTER TABLE each one must
    still fit. Exit 1 lists each version, field and column that doesn't."""
    try:
        reg = _registry(ctx).get(table)
        versions = reg.versions if version is None else (reg.version(version),)
        descriptors = [(v, v.descriptor) for v in versions]
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    columns = _columns(ctx, table)
    per_version = {v.version: _mismatches(d, columns) + _changed(reg.table_id, v, columns)
                   for v, d in descriptors}
    failed = {n: m for n, m in per_version.items() if m}
    if failed:
        if ctx.as_json:
            click.echo(json.dumps({
                "ok": False, "table": table,
                "mismatches": [f"version {n}: {m}" for n, ms in failed.items() for m in ms],
                "versions": {str(n): ms for n, ms in per_version.items()}}, indent=2))
        click.echo(f"ba-schema: {table}: {len(failed)} of {len(per_version)} version(s) do "
                   "not match the table:", err=True)
        for n, ms in failed.items():
            for m in ms:
                click.echo(f"  - version {n}: {m}", err=True)
        sys.exit(1)
    if ctx.as_json:
        click.echo(json.dumps({"ok": True, "table": table,
                               "versions": {str(n): [] for n in per_version},
                               "mismatches": []}, indent=2))
    else:
        for v, _ in descriptors:
            click.echo(f"{table}: version {v.version} ({v.message_name}) matches the table")


@cli.command("compatibility")
@click.argument("table")
@click.argument("mode", type=_MODE, required=False, metavar="[MODE]")
@click.pass_obj
def compatibility_cmd(ctx: Context, table: str, mode: str | None) -> None:
    """Show TABLE's compatibility mode, or set it to MODE.

    \b
    BACKWARD             new version reads data of the latest one (default)
    FORWARD              latest version reads data of the new one
    FULL                 both
    *_TRANSITIVE         the same against every registered version
    NONE                 no check

    The mode applies to versions registered from now on."""
    if mode is None:
        try:
            reg = _registry(ctx).get(table)
        except BlockaggError as exc:
            _fail(ctx, 2, str(exc))
        changed = False
    else:
        try:
            reg, changed = set_compatibility(ctx.store(), table, Mode(mode.upper()))
        except BlockaggError as exc:
            _fail(ctx, 2, str(exc))
    current = reg.compatibility or DEFAULT_MODE.value
    if ctx.as_json:
        click.echo(json.dumps({"ok": True, "table": table, "compatibility": current,
                               "changed": changed}, indent=2))
    elif mode is None:
        click.echo(f"{table}: {current}")
    else:
        click.echo(f"{table}: compatibility {current}" + ("" if changed else " (unchanged)"))


def main() -> None:
    cli(prog_name="ba-schema")
