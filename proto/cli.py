"""``ba-schema``: register protobuf message types for ClickHouse tables, list and show
registrations, and check them against the live table.

Exit codes: 0 ok, 1 check failed (mismatches listed), 2 usage, connection or
registry error. Errors go to stderr; ``--json`` prints one JSON document on stdout.
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

from aggregator.exceptions import BlockaggError
from proto.registry import DEFAULT_TOPIC, KafkaStore, Registration, Registry, Store, register

ColumnsFn = Callable[[str], Sequence[Any]]


@dataclass
class Context:
    as_json: bool
    store: Callable[[], Store]
    columns: ColumnsFn


def _fail(ctx: Context, code: int, message: str, **extra: Any) -> NoReturn:
    if ctx.as_json:
        click.echo(json.dumps({"ok": False, "error": message, **extra}, indent=2))
    click.echo(f"ba-schema: {message}", err=True)
    sys.exit(code)


def _clickhouse_columns(hosts: Sequence[str], user: str, password: str) -> ColumnsFn:
    def fetch(table: str) -> Sequence[Any]:
        from aggregator.clickhouse.writer import ClickHouseBlockWriter, Replica, WriterConfig

        replicas = []
        for h in hosts:
            host, _, port = h.partition(":")
            replicas.append(Replica(host, int(port or 9000)))
        writer = ClickHouseBlockWriter(WriterConfig(tuple(replicas), user=user,
                                                    password=password, max_attempts=2))
        try:
            return writer.describe(table).columns
        finally:
            writer.close()
    return fetch


def _default_hosts() -> tuple[str, ...]:
    host = os.environ.get("BLOCKAGG_CH_HOST", "localhost")
    ports = [p for p in os.environ.get("BLOCKAGG_CH_PORTS", "9000").replace(",", " ").split()
             if p]
    return tuple(f"{host}:{p}" for p in ports[:1] or ["9000"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--bootstrap-servers", envvar="BLOCKAGG_BOOTSTRAP_SERVERS",
              default="localhost:9092", show_default=True, help="Kafka bootstrap.servers.")
@click.option("--topic", envvar="BLOCKAGG_SCHEMA_TOPIC", default=DEFAULT_TOPIC,
              show_default=True, help="The compacted registry topic.")
@click.option("-X", "kafka_props", multiple=True, metavar="KEY=VALUE",
              help="Extra librdkafka setting (SASL/TLS…), repeatable.")
@click.option("--clickhouse", "ch_hosts", multiple=True, metavar="HOST:PORT",
              help="ClickHouse native-protocol endpoint (default: $BLOCKAGG_CH_HOST and "
                   "the first of $BLOCKAGG_CH_PORTS).")
@click.option("--user", envvar="BLOCKAGG_CH_USER", default="default", show_default=True)
@click.option("--password", envvar="BLOCKAGG_CH_PASSWORD", default="")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
@click.pass_context
def cli(ctx: click.Context, bootstrap_servers: str, topic: str, kafka_props: tuple[str, ...],
        ch_hosts: tuple[str, ...], user: str, password: str, as_json: bool) -> None:
    """Register protobuf message types for ClickHouse tables."""
    if isinstance(ctx.obj, Context):
        ctx.obj.as_json = as_json
        return
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers}
    for prop in kafka_props:
        key, sep, value = prop.partition("=")
        if not sep:
            raise click.UsageError(f"-X expects KEY=VALUE, got {prop!r}")
        config[key] = value
    hosts = ch_hosts or _default_hosts()
    ctx.obj = Context(as_json, lambda: KafkaStore(config, topic),
                      _clickhouse_columns(hosts, user, password))


def _summary(reg: Registration) -> dict[str, Any]:
    return {"table": reg.table, "table_id": reg.table_id, "latest": reg.latest.version,
            "message": reg.latest.message_name, "versions": [v.version for v in reg.versions]}


def _check(ctx: Context, table: str, descriptor: Any) -> list[str]:
    from aggregator.clickhouse.rows import match_columns

    try:
        columns = ctx.columns(table)
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    except Exception as exc:
        _fail(ctx, 2, f"can't read the columns of {table} from ClickHouse: {exc}")
    return match_columns(descriptor, columns)[1]


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
@click.option("--no-check", is_flag=True, help="Skip the check against the live table.")
@click.pass_obj
def register_cmd(ctx: Context, table: str, proto_file: Path | None, includes: tuple[Path, ...],
                 descriptor_set: Path | None, message_name: str, dry_run: bool,
                 no_check: bool) -> None:
    """Register MESSAGE as the next schema version of TABLE (database.table)."""
    from proto.descriptors import compile_proto, load_descriptor

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
    mismatches = [] if no_check else _check(ctx, table, descriptor)
    if mismatches:
        _report_check(ctx, table, mismatches)
    try:
        if dry_run:
            registry = Registry.load(ctx.store())
            new = registry.next_registration(table, message_name, fds)
            result = {"ok": True, "dry_run": True, "changed": new is not None,
                      **_summary(new or registry.get(table))}
        else:
            reg, changed = register(ctx.store(), table, message_name, fds)
            result = {"ok": True, "dry_run": False, "changed": changed, **_summary(reg)}
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    if ctx.as_json:
        click.echo(json.dumps(result, indent=2))
        return
    verb = "would register" if dry_run else "registered"
    if not result["changed"]:
        click.echo(f"{table}: unchanged, latest version {result['latest']} is identical")
    else:
        click.echo(f"{verb} {table} version {result['latest']} (table id "
                   f"{result['table_id']}): {message_name}")


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
    from aggregator.clickhouse.types import describe

    fields = [{"name": f.name, "number": f.number, "type": describe(f)}
              for f in descriptor.fields]
    if ctx.as_json:
        click.echo(json.dumps({**_summary(reg), "version": v.version,
                               "message": v.message_name, "fields": fields,
                               "registered_at_ms": v.registered_at_ms}, indent=2))
        return
    click.echo(f"{reg.table} (table id {reg.table_id}) version {v.version} of "
               f"{', '.join(str(x.version) for x in reg.versions)}: {v.message_name}")
    for f in fields:
        click.echo(f"  {f['number']:>4}  {f['name']:<30} {f['type']}")


@cli.command("check")
@click.argument("table")
@click.option("--version", "version", type=int, default=0, help="0 = latest.")
@click.pass_obj
def check_cmd(ctx: Context, table: str, version: int) -> None:
    """Re-check TABLE's registered message type against the live table."""
    try:
        v = _registry(ctx).get(table).version(version)
        descriptor = v.descriptor
    except BlockaggError as exc:
        _fail(ctx, 2, str(exc))
    mismatches = _check(ctx, table, descriptor)
    if mismatches:
        _report_check(ctx, table, mismatches)
    if ctx.as_json:
        click.echo(json.dumps({"ok": True, "table": table, "version": v.version,
                               "mismatches": []}, indent=2))
    else:
        click.echo(f"{table}: version {v.version} ({v.message_name}) matches the table")


def main() -> None:
    cli(prog_name="ba-schema")
