"""``spark-submit [spark options] spark/job.py --config blockagg.toml [flags]``

The blockagg job's entry point (see ``docs/running.md``). Flags override the common
keys of the file; ``--set section.key=value`` overrides any other (the value is read
as a TOML value, else as a string). Exit codes: 0 stopped cleanly (SIGTERM/SIGINT,
``--until-caught-up``), 1 the query failed, 2 the configuration is refused.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file by spark-submit: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import click

from blockagg.aggregator import logs
from blockagg.aggregator.config import load
from blockagg.aggregator.exceptions import BlockaggError, ConfigError


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
         checkpoint_location: str | None, trigger_interval: str | None,
         max_offsets_per_trigger: int | None, starting_offsets: str | None,
         metrics_port: int | None, sets: tuple[str, ...], until_caught_up: bool,
         log_level: str | None, log_format: str | None) -> None:
    logs.setup(log_level, log_format)
    log = logs.get("job")
    overrides: dict[str, object] = {
        "kafka.bootstrap.servers": bootstrap_servers,
        "job.metadata_group_id": group,
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
        logs.event(log, "configuration refused", level=40, error=str(exc))
        click.echo(f"blockagg: configuration refused: {exc}", err=True)
        sys.exit(2)
    logs.event(log, "configuration", pid=os.getpid(),
               config={k: repr(v) for k, v in config.summary().items()})

    from blockagg.spark.components import load_components
    from blockagg.spark.driver import Driver, make_spark

    code = 1
    try:
        spark = make_spark(config)
        spark.sparkContext.setLogLevel("WARN")
        spec = os.environ.get("BLOCKAGG_COMPONENTS")
        components = load_components(spec) if spec else None
        driver = Driver(config, spark, components)
        driver.install_signal_handlers()
        driver.metrics.serve(config.metrics.port, config.metrics.host)
        driver.start()
        code = driver.wait(until_caught_up=until_caught_up)
        if isinstance(driver.failure, BlockaggError):
            click.echo(f"blockagg: {driver.failure}", err=True)
    except ConfigError as exc:
        logs.event(log, "configuration refused", level=40, error=str(exc))
        click.echo(f"blockagg: configuration refused: {exc}", err=True)
        code = 2
    except BlockaggError as exc:
        logs.event(log, "refused", level=40, error=str(exc))
        click.echo(f"blockagg: {exc}", err=True)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
