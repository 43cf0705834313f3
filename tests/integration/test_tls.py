"""TLS to ClickHouse against the stack's secure ports (ClickHouse 18.16's
``tcp_port_secure``, a certificate signed by the stack's own CA, see
``scripts/stack_lib.make_tls_certificates``), with verification on as users run it.

The job, ``ba-schema`` and ``arv audit`` all connect over TLS and the delivery is
exact; a client that cannot verify the server, or speaks TLS to the plain port, gets
one line naming the TLS settings instead of a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from blockagg.aggregator.clickhouse.exceptions import ClickHouseTlsFailed
from blockagg.aggregator.clickhouse.startup import check_replicas, driver_check
from blockagg.registration.cli import cli as ba_schema
from blockagg.tls import tls_arguments
from blockagg.verifier.cli import cli as arv
from tests.integration.test_job_clickhouse import TABLES, ChJob, make_job

pytestmark = pytest.mark.integration


def secure_ports(stack_env: dict[str, str]) -> list[str]:
    return stack_env["BLOCKAGG_CH_SECURE_PORTS"].split(",")


@pytest.fixture
def tls_job(tmp_path: Path, stack_env: dict[str, str], new_topic: Callable[..., str],
            ch_database: str, ch_replicas: list[Any]) -> Iterator[ChJob]:
    """``make_job``'s job with its replicas on the secure ports and TLS verified against
    the stack's CA."""
    job = make_job(tmp_path, stack_env, new_topic(partitions=3, prefix="ittls"), ch_database,
                   ch_replicas)
    text = job.config.read_text()
    for plain, secure in zip(stack_env["BLOCKAGG_CH_PORTS"].split(","),
                             secure_ports(stack_env), strict=True):
        text = text.replace(f':{plain}"', f':{secure}"')
    text = text.replace("[clickhouse]\n", "[clickhouse]\nsecure = true\n"
                        f'ca_certs = "{stack_env["BLOCKAGG_CH_CA_CERTS"]}"\n')
    job.config.write_text(text)
    yield job


def test_job_ba_schema_and_audit_over_tls_are_exact(tls_job: ChJob,
                                                    stack_env: dict[str, str]) -> None:
    host, ca = stack_env["BLOCKAGG_CH_HOST"], stack_env["BLOCKAGG_CH_CA_CERTS"]
    secure = f"{host}:{secure_ports(stack_env)[0]}"
    check = CliRunner().invoke(ba_schema, [
        "--bootstrap-servers", tls_job.bootstrap, "--topic", tls_job.schema_topic,
        "--clickhouse", secure, "--clickhouse-secure", "--clickhouse-ca-certs", ca,
        "check", f"{tls_job.database}.{next(iter(TABLES))}"])
    assert check.exit_code == 0, check.output

    tls_job.feed.good(90)
    out = tls_job.run()
    assert '"secure":true' in out, out[-3000:]
    tls_job.assert_exact()

    audit = [
        "audit", "--bootstrap-servers", tls_job.bootstrap, "--group", tls_job.group,
        "--topic", tls_job.topic, "--clickhouse", secure, "--clickhouse-secure",
        "--database", tls_job.database, "--dead-letter-table", tls_job.dead_table]
    res = CliRunner().invoke(arv, [*audit, "--clickhouse-ca-certs", ca])
    assert res.exit_code == 0, res.output
    assert "0 discrepancies" in res.stderr
    # The system's CAs do not include the stack's: one line, exit 2.
    res = CliRunner().invoke(arv, audit, env={"BLOCKAGG_CH_CA_CERTS": None})
    assert res.exit_code == 2, res.output
    assert re.search(r"TLS with ClickHouse at .* failed: .*certificate verify failed.*"
                     r"--clickhouse-ca-certs", res.stderr), res.stderr
    assert "Traceback" not in res.output


def test_an_unverifiable_server_or_tls_to_the_plain_port_is_one_line(
        stack_env: dict[str, str]) -> None:
    host = stack_env["BLOCKAGG_CH_HOST"]
    secure = int(secure_ports(stack_env)[0])
    plain = int(stack_env["BLOCKAGG_CH_PORTS"].split(",")[0])
    system_cas = tls_arguments(True, True, None)  # the stack's CA is not among them
    with pytest.raises(ClickHouseTlsFailed, match=r"certificate verify failed.*ca_certs"):
        check_replicas([driver_check(host, secure, "default", "", 5.0, tls=system_cas)], None)
    stack_ca = tls_arguments(True, True, stack_env["BLOCKAGG_CH_CA_CERTS"])
    with pytest.raises(ClickHouseTlsFailed, match=rf"at .*:{plain} failed .*secure"):
        check_replicas([driver_check(host, plain, "default", "", 5.0, tls=stack_ca)], None)
    check_replicas([driver_check(host, secure, "default", "", 5.0, tls=stack_ca)], None)
    # Without verification the stack's certificate is accepted (testing only).
    check_replicas([driver_check(host, secure, "default", "", 5.0,
                                 tls=tls_arguments(True, False, None))], None)
