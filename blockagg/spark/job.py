"""``spark-submit [spark options] spark/job.py --config blockagg.toml [flags]``

The blockagg job's entry point (see ``docs/running.md``). Flags override the common
keys of the file; ``--set section.key=value`` overrides any other (the value is read
as a TOML value, else as a string). Exit codes: 0 stopped cleanly (SIGTERM/SIGINT,
``--until-caught-up``), 1 the query failed or the start was refused, 2 the
configuration is refused.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file by spark-submit: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import click

from blockagg import logs
from blockagg.config import SECRET_KEY_PARTS, Config, Secret, load
from blockagg.exceptions import BlockaggError, ConfigError
from blockagg.spark import preflight


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="The TOML configuration file.")
@click.option("--bootstrap-servers", help="Override [kafka] bootstrap.servers.")
@click.option("--group", help="Override [job] metadata_group_id.")
@click.option("--take-over", "take_over", metavar="GROUP",
              help="Take over the delivery of the topics from GROUP, which owns it now "
                   "(job.take_over_from); its job must be stopped.")
@click.option("--checkpoint-location", help="Override [job] checkpoint_location.")
@click.option("--trigger-interval", help="Override [job] trigger_interval, e.g. 1s.")
@click.option("--max-offsets-per-trigger", type=int,
              help="Override [job] max_offsets_per_trigger.")
@click.option("--starting-offsets", type=click.Choice(["earliest", "latest"]),
              help="Override [job] starting_offsets.")
@click.option("--metrics-port", type=int, help="Override [metrics] port (0 = off).")
@click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override any key, e.g. --set blocks.max_rows=500000.")
@click.option("--until-caught-up", is_flag=True,
              help="Stop cleanly once every partition is caught up (demos, backfills).")
@click.option("--log-level", default=None, help="DEBUG, INFO (default), WARNING.")
@click.option("--log-format", type=click.Choice(["json", "text"]), default=None,
              help="Log lines as JSON (default) or key=value text.")
def main(config_path: str, bootstrap_servers: str | None, group: str | None,
         take_over: str | None,
         checkpoint_location: str | None, trigger_interval: str | None,
         max_offsets_per_trigger: int | None, starting_offsets: str | None,
         metrics_port: int | None, sets: tuple[str, ...], until_caught_up: bool,
         log_level: str | None, log_format: str | None) -> None:
    logs.setup(log_level, log_format)
    log = logs.get("job")
    overrides: dict[str, object] = {
        "kafka.bootstrap.servers": bootstrap_servers,
        "job.metadata_group_id": group,
        "job.take_over_from": take_over,
        "job.checkpoint_location": checkpoint_location,
        "job.trigger_interval": trigger_interval,
        "job.max_offsets_per_trigger": max_offsets_per_trigger,
        "job.starting_offsets": starting_offsets,
        "metrics.port": metrics_port,
    }
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"expected SECTION.KEY=VALUE, got {item!r}",
                                     param_hint="--set")
        overrides[key.strip()] = _toml_value(value.strip())
    try:
        config = load(config_path, overrides)
    except ConfigError as exc:
        logs.event(log, f"configuration refused: {exc}", level=40, exit=2)
        sys.exit(2)
    logs.event(log, "configuration", pid=os.getpid(), parent_pid=os.getppid(),
               config=plain(config.summary()))
    sys.exit(run(config, until_caught_up))


def plain(value: Any) -> Any:
    """A configuration value as plain JSON data (dataclasses as objects, secrets
    masked), so the configuration line is JSON all the way down."""
    if isinstance(value, Secret):
        return "***" if value else ""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): "***" if value[k] and any(p in str(k).lower()
                                                  for p in SECRET_KEY_PARTS)
                else plain(value[k]) for k in value}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def run(config: Config, until_caught_up: bool) -> int:
    """Start-up checks, Spark, the query; the exit code. A refusal or failure is one
    log line naming the thing and the fix (its trace only at DEBUG)."""
    log = logs.get("job")
    run_id = config.job.run_id if config.job.run_id is not None else secrets.randbits(64)
    try:
        from blockagg.spark.components import DefaultComponents, load_components, missing_pins
        from blockagg.spark.metrics import JobMetrics
        from blockagg.spark.tables import TableGuard

        spec = os.environ.get("BLOCKAGG_COMPONENTS")
        components = load_components(spec) if spec else None
        tables = TableGuard(config, components or DefaultComponents())
        metrics = JobMetrics()
        try:
            preflight.run(config, clickhouse=not spec, run_id=f"{run_id:016x}",
                          tables=tables, spark=True, metrics=metrics)
        finally:
            if os.environ.get("PYSPARK_GATEWAY_PORT"):  # under spark-submit, the JVM
                from blockagg.spark.driver import spark_log_level  # runs: keep its exit

                spark_log_level()  # quiet (after the checks: they answer first)
        from blockagg.spark.driver import Driver, make_spark

        spark = make_spark(config)
        if components is not None and (missing := missing_pins(components)):
            logs.event(log, "components without pins", level=30, components=spec,
                       missing=missing, effect="a replay is not held to what its first "
                       "attempt was prepared under (docs/protocol.md, What a replay "
                       "depends on), or a batch's blocks to the tables' deduplication "
                       "windows (dedup_windows): forward these from the components you "
                       "wrap")
        driver = Driver(config, spark, components, metrics=metrics, run_id=run_id,
                        tables=tables)
        driver.install_signal_handlers()
        try:
            driver.start()
        except BaseException:
            if driver.lock is not None:  # leave the lock group now, not at session timeout
                driver.lock.release()
            raise
        return driver.wait(until_caught_up=until_caught_up)
    except ConfigError as exc:
        logs.event(log, f"configuration refused: {exc}", level=40, exit=2)
        return 2
    except KeyboardInterrupt:  # Ctrl-C during the start-up checks: nothing written yet
        logs.event(log, "stopped", signal="SIGINT", before="the query started")
        return 0
    except BlockaggError as exc:
        log.debug("refused", exc_info=exc)
        logs.event(log, f"start refused: {exc}", level=40, exit=1)
        return 1
    except Exception as exc:
        from blockagg.spark.driver import root_cause

        logs.event(log, f"failed: {root_cause(exc)}", level=40, exit=1)
        return 1


if __name__ == "__main__":
    main()
