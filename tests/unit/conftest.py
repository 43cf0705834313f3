"""Unit tests never leave the process for another host: a name that would need DNS
(``ch:9000``, ``x:1`` in a test config) fails at once, naming the host, instead of
going through a client's retries and back-off. A unit test that reached a server by
accident used to pass slowly (four minutes in ``test_task_pins``); now it fails. Names
under ``.invalid`` (RFC 6761), which tests use for a host that does not exist, fail as
an unknown name at once, as the resolver would."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "", None})


class NetworkInUnitTest(RuntimeError):
    """A unit test tried to resolve a host other than this machine."""


@pytest.fixture(autouse=True)
def no_remote_hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    resolve = socket.getaddrinfo

    def local_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and name.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, f"{name}: never resolves (RFC 6761)")
        if name not in LOCAL_HOSTS:
            raise NetworkInUnitTest(
                f"a unit test resolved {name!r}: fake the call that reached the network "
                "(or move the test to tests/integration)")
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    yield
