"""The fault suite's components wrap the job's own: every capability the job looks up
on its components must reach the real adapters, or the fault runs test a job with a
safety check silently off (the seed-2 long run ran without the structure mark)."""

from __future__ import annotations

import inspect

from blockagg.spark.components import DefaultComponents
from tests.faults.hooks import FaultComponents


def public_methods(cls: type) -> set[str]:
    return {name for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


def test_the_fault_components_offer_every_capability_of_the_default_ones() -> None:
    missing = public_methods(DefaultComponents) - public_methods(FaultComponents)
    assert not missing, f"FaultComponents does not forward {sorted(missing)}"


def test_the_structure_mark_reaches_the_inner_components() -> None:
    class Inner:
        def structure_mark(self, config: object, topic: object, tables: object) -> int:
            return 383494

    wrapped = FaultComponents(Inner(), None)  # type: ignore[arg-type]
    assert wrapped.structure_mark(None, None, ["db.t"]) == 383494  # type: ignore[arg-type]


def test_the_job_names_pin_capabilities_a_custom_components_lacks() -> None:
    from blockagg.spark.components import missing_pins

    assert missing_pins(DefaultComponents()) == []
    assert missing_pins(FaultComponents(DefaultComponents(), None)) == []
    assert missing_pins(object()) == ["incarnation", "dedup_mode", "structure_mark",
                                     "dedup_windows"]
