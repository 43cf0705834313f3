"""The ClickHouse TLS flags that ``ba-schema`` and ``arv audit`` share, so both
commands spell, default and check them alike (the job reads ``[clickhouse] secure /
verify / ca_certs`` instead; every path ends in ``blockagg.tls.tls_arguments``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final, TypeVar

import click

from blockagg.tls import tls_arguments

F = TypeVar("F", bound=Callable[..., Any])

TLS_FIX: Final = ("--clickhouse-ca-certs (the CA that signed the server's certificate), "
                  "--clickhouse-no-verify, or --clickhouse-secure with the secure port "
                  "(9440 by default; plain 9000)")
"""What a command's user changes when the TLS handshake fails."""


def tls_options(f: F) -> F:
    """``--clickhouse-secure``, ``--clickhouse-ca-certs`` and ``--clickhouse-no-verify``,
    passed to the command as ``secure``, ``ca_certs`` and ``no_verify``."""
    f = click.option("--clickhouse-no-verify", "no_verify", is_flag=True,
                     help="Do not verify the server's certificate (testing only).")(f)
    f = click.option("--clickhouse-ca-certs", "ca_certs", envvar="BLOCKAGG_CH_CA_CERTS",
                     metavar="FILE",
                     help="CA certificates (PEM) to verify the server with, with "
                          "--clickhouse-secure; default: the system's.")(f)
    return click.option("--clickhouse-secure", "secure", is_flag=True,
                        envvar="BLOCKAGG_CH_SECURE",
                        help="TLS to ClickHouse (the default endpoint's port becomes the "
                             "first of $BLOCKAGG_CH_SECURE_PORTS, else 9440).")(f)


def default_endpoint(secure: bool) -> str:
    """``$BLOCKAGG_CH_HOST`` and the first of ``$BLOCKAGG_CH_PORTS`` (else 9000), or of
    ``$BLOCKAGG_CH_SECURE_PORTS`` (else 9440) with TLS: what ``scripts/stack env``
    exports."""
    host = os.environ.get("BLOCKAGG_CH_HOST", "localhost")
    var, port = ("BLOCKAGG_CH_SECURE_PORTS", "9440") if secure else ("BLOCKAGG_CH_PORTS", "9000")
    ports = os.environ.get(var, port).replace(",", " ").split()
    return f"{host}:{ports[0] if ports else port}"


def tls_from_flags(secure: bool, no_verify: bool, ca_certs: str | None) -> dict[str, Any]:
    """clickhouse-driver's TLS arguments for the flags; a CA file that is not there is
    a usage error (checked only with TLS: the stack's env names one either way)."""
    if secure and ca_certs is not None and not os.path.isfile(ca_certs):
        raise click.BadParameter(f"{ca_certs!r} is not a file",
                                 param_hint="--clickhouse-ca-certs ($BLOCKAGG_CH_CA_CERTS)")
    return tls_arguments(secure, not no_verify, ca_certs)
