"""The package's folders follow the data path, and every import runs down it.

Message bytes -> envelope and pinned registry view (``proto``) -> typed columns and
dead-letter decisions (``rows``, pure) -> the core (``aggregator/core``: blocks,
metadata, plan) -> the adapters (``aggregator/kafka``, ``aggregator/clickhouse``) ->
the Spark shell (``spark``) -> the verifier. Registration (``registration``: new
versions judged on how each field becomes a column, and ``ba-schema``) writes what
``proto`` reads; it sits beside the shell, above rows and the adapters. The shared
concerns (the root error, config, logging, TLS settings) sit at the package root,
where everything may import them. Parsed from the source (every ``import``, inside
functions and ``TYPE_CHECKING`` blocks too: a lazy import hides a dependency from the
reader, not from the graph), so an import that climbs back up a layer, or closes a
circle, fails here with its file.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "blockagg"
GENERATED = "blockagg.proto.blockagg"
"""protoc's generated modules (``*_pb2``): not ours to layer."""

ROOT_MODULES = frozenset({"blockagg", "blockagg.exceptions", "blockagg.config", "blockagg.logs",
                          "blockagg.tls", "blockagg.cli_tls"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: p for m, p in found.items() if not m.startswith(GENERATED)}


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The blockagg modules ``name`` imports (``from pkg import mod`` names the module
    when ``pkg.mod`` is one, else the package)."""
    package = name if is_package else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("blockagg") and not target.startswith(GENERATED):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    yield target


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: set(imports_of(name, path.read_text(), path.name == "__init__.py", known))
            for name, path in found.items()}


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_module_imports_in_a_circle(graph: dict[str, set[str]]) -> None:
    """A circle is two modules that each need the other first: no reading order."""
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append([*stack[stack.index(target):], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def bad_edges(graph: dict[str, set[str]], layer: str, allowed: tuple[str, ...],
              exceptions: dict[tuple[str, str], str] | None = None) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if under(m, layer)
                  for t in targets
                  if t not in ROOT_MODULES and not under(t, *allowed)
                  and (m, t) not in (exceptions or {}))


def test_the_core_imports_only_itself_and_the_root(graph: dict[str, set[str]]) -> None:
    assert bad_edges(graph, "blockagg.aggregator.core", ("blockagg.aggregator.core",)) == []


def test_the_rows_stage_imports_only_proto_the_core_and_the_root(
        graph: dict[str, set[str]]) -> None:
    """No ClickHouse connection, no Kafka client: the stage is pure."""
    assert bad_edges(graph, "blockagg.rows", ("blockagg.rows", "blockagg.proto",
                                              "blockagg.aggregator.core")) == []


@pytest.mark.parametrize("adapter", ["blockagg.aggregator.kafka", "blockagg.aggregator.clickhouse"])
def test_an_adapter_imports_only_the_core_the_stages_itself_and_the_root(
        graph: dict[str, set[str]], adapter: str) -> None:
    """Never the Spark shell, the verifier or the other adapter."""
    assert bad_edges(graph, adapter, (adapter, "blockagg.aggregator.core", "blockagg.rows",
                                      "blockagg.proto")) == []


def test_proto_imports_only_itself_and_the_root(graph: dict[str, set[str]]) -> None:
    """The envelope, the registry's read side and the decoder: no column, no Kafka
    client (issue 29: the compatibility judgment, registration and ``ba-schema`` moved
    to ``registration``, the Kafka store to ``aggregator/kafka/log_store``)."""
    assert bad_edges(graph, "blockagg.proto", ("blockagg.proto",)) == []


def test_registration_imports_only_the_stages_the_adapters_itself_and_the_root(
        graph: dict[str, set[str]]) -> None:
    """Registration judges with the column mapping (rows) and checks live tables and
    topics (the adapters); never the Spark shell or the verifier."""
    assert bad_edges(graph, "blockagg.registration", (
        "blockagg.registration", "blockagg.proto", "blockagg.rows", "blockagg.aggregator")) == []


def test_nothing_in_the_job_imports_registration(graph: dict[str, set[str]]) -> None:
    """The job reads the registry (``proto``); only ``ba-schema`` writes it."""
    assert sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if under(t, "blockagg.registration")
                  and not under(m, "blockagg.registration")) == []


def test_the_spark_shell_and_the_verifier_sit_on_top(graph: dict[str, set[str]]) -> None:
    """``spark`` is imported by nothing but itself; the verifier by nothing in the job."""
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if (under(t, "blockagg.spark") and not under(m, "blockagg.spark"))
                    or (under(t, "blockagg.verifier") and not under(m, "blockagg.verifier")))
    assert upward == []


def test_the_parser_sees_lazy_and_type_checking_imports() -> None:
    """The graph counts an import inside a function or an ``if TYPE_CHECKING:`` block."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from blockagg.rows import types\n"
              "def f():\n    from blockagg.aggregator.kafka.fencing import X\n")
    known = {"blockagg.rows", "blockagg.rows.types", "blockagg.aggregator.kafka.fencing"}
    found = set(imports_of("blockagg.rows.probe", source, False, known))
    assert found == {"blockagg.rows.types", "blockagg.aggregator.kafka.fencing"}


def test_a_large_module_says_why_it_is_one() -> None:
    """Issue 29: the writer was split by responsibility (insert with failover, its
    columns, the re-send check, diagnosis, table judgments); a module above 500 lines
    states at its top why it stays one ("Above 500 lines because ...")."""
    unexplained = []
    for path in sorted(p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name):
        source = path.read_text()
        doc = ast.get_docstring(ast.parse(source)) or ""
        if len(source.splitlines()) > 500 and "Above 500 lines" not in doc:
            unexplained.append(f"{path.relative_to(PACKAGE)}: {len(source.splitlines())} lines")
    assert not unexplained, "split these or say why at the top: " + ", ".join(unexplained)
