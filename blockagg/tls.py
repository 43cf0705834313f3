"""The TLS keyword arguments of every ClickHouse connection, from the settings or flags
that name them: a pure function at the package root, so the CLI flag plumbing
(``cli_tls``), the Spark shell and the ClickHouse adapter share one spelling without
the CLIs importing the adapter."""

from __future__ import annotations

from typing import Any


def tls_arguments(secure: bool, verify: bool, ca_certs: str | None) -> dict[str, Any]:
    """clickhouse-driver's TLS keyword arguments for ``[clickhouse] secure / verify /
    ca_certs``: every connection the job, ``ba-schema`` and the start-up checks open
    takes these, so a TLS setting never applies to some connections only."""
    if not secure:
        return {}
    arguments: dict[str, Any] = {"secure": True, "verify": verify}
    if ca_certs is not None:
        arguments["ca_certs"] = ca_certs
    return arguments
