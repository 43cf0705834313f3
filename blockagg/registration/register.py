"""Registration: a new version of a table's message type, or a new compatibility
mode, written to the schema registry's store.

The read side (:mod:`proto.registry`) decodes the records and refuses the ones that
break the registry's rules; this side makes the records, and before writing judges the
new version against the table's compatibility mode on how each field becomes a column
(:func:`registration.compat.check`), which is why it sits above the rows stage. The
rules it keeps (see :mod:`proto.registry`): ids are assigned once and never reused,
versions only grow, an identical version is a no-op, and a forced version records the
differences it overrode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from blockagg.proto.descriptors import load_descriptor
from blockagg.proto.envelope import is_table_name
from blockagg.proto.exceptions import CompatibilityError, RegistryError
from blockagg.proto.modes import Mode
from blockagg.proto.registry import Registration, Registry, SchemaVersion, Store
from blockagg.registration.compat import check
from blockagg.registration.exceptions import IncompatibleSchema
from blockagg.rows.columns import Column

log = logging.getLogger(__name__)


def next_registration(registry: Registry, table: str, message_name: str,
                      file_descriptor_set: bytes, now_ms: int | None = None, *,
                      compatibility: Mode | None = None,
                      columns: Sequence[Column] | None = None,
                      force: bool = False) -> Registration | None:
    """The registration that adds this message type as a new version of
    ``table`` in ``registry``, or None when the latest version is identical.

    The new version must keep the table's compatibility mode against the
    registered versions, judged with the live ``columns`` when given
    (:func:`registration.compat.check`); otherwise :class:`IncompatibleSchema` is raised,
    unless ``force``, which records the differences in the new version.
    ``compatibility`` sets the mode of a new table; for a registered table it
    must be the table's mode (change it with :func:`set_compatibility`)."""
    if not is_table_name(table):
        raise RegistryError(f"table {table!r} is not 'database.table'")
    descriptor = load_descriptor(file_descriptor_set, message_name)
    stamp = int(time.time() * 1000) if now_ms is None else now_ms
    old = registry.get(table) if table in registry else None
    if old is not None:
        # Registration times grow with versions, so "latest at time T" is the
        # highest version registered by T, and a new version never takes effect
        # for messages stamped before an existing one did.
        stamp = max(stamp, max(v.registered_at_ms for v in old.versions) + 1)
    recorded = () if columns is None else tuple(
        (c.name, c.type, c.default_kind, c.default_expression) for c in columns)
    if old is None:
        table_id = max(registry.tables(), default=0) + 1
        mode = "" if compatibility is None else compatibility.value
        return Registration(table, table_id, (SchemaVersion(
            1, message_name, file_descriptor_set, stamp, columns=recorded),), mode)
    if compatibility is not None and compatibility != old.mode:
        raise CompatibilityError(
            f"{table} has compatibility mode {old.mode}, not {compatibility}; change it "
            f"first with ba-schema compatibility {table} {compatibility}")
    latest = old.latest
    if (latest.message_name, latest.file_descriptor_set) == (message_name,
                                                             file_descriptor_set) and (
            latest.columns or not recorded):
        # Identical: a no-op, unless it records the columns the latest version was
        # registered without (a new version, so its plan is pinned from now on).
        return None
    differences = [str(d) for d in check(
        old.mode, descriptor, [(v.version, v.descriptor) for v in old.versions], columns)]
    if differences and not force:
        raise IncompatibleSchema(table, old.mode.value, differences)
    return Registration(table, old.table_id, (*old.versions, SchemaVersion(
        latest.version + 1, message_name, file_descriptor_set, stamp,
        tuple(differences), columns=recorded)), old.compatibility)


def register(store: Store, table: str, message_name: str, file_descriptor_set: bytes,
             now_ms: int | None = None, *, compatibility: Mode | None = None,
             columns: Sequence[Column] | None = None,
             force: bool = False) -> tuple[Registration, bool]:
    """Write a new version of ``table`` (re-reading the topic first and after, so a
    concurrent registration is detected). Returns the registration and whether a
    record was written (False: identical to the latest version).

    The version's ``registered_at_ms`` is ``now_ms`` (default: this host's clock),
    raised if needed above every earlier version's: messages with
    ``schema_version = 0`` stamped at or after it decode with the new version.
    A version that breaks the table's compatibility mode raises
    :class:`IncompatibleSchema` before anything is written, unless ``force``
    (see :func:`next_registration`)."""
    registry = Registry.load(store)
    new = next_registration(registry, table, message_name, file_descriptor_set, now_ms,
                            compatibility=compatibility, columns=columns, force=force)
    if new is None:
        return registry.get(table), False
    if new.latest.forced_incompatibilities:
        log.warning("registering %s version %d against its %s compatibility mode "
                    "(--force-incompatible): %s", table, new.latest.version, new.mode.value,
                    "; ".join(new.latest.forced_incompatibilities))
    return _write(store, new), True


def set_compatibility(store: Store, table: str, mode: Mode) -> tuple[Registration, bool]:
    """Set the compatibility mode of registered ``table`` (Confluent's per-subject
    config); it applies to the versions registered from now on. Returns the
    registration and whether a record was written."""
    old = Registry.load(store).get(table)
    if old.compatibility == mode.value:
        return old, False
    new = replace(old, compatibility=mode.value)
    return _write(store, new), True


def _write(store: Store, new: Registration) -> Registration:
    """Write ``new``; return it as read back (with the new version's position)."""
    store.write(new.table.encode(), new.encode())
    after = Registry.load(store).get(new.table)
    stamped = {v.version for v in new.versions if v.position}
    if replace(after, versions=tuple(v if v.version in stamped else replace(v, position=0)
                                     for v in after.versions)) != new:
        raise RegistryError(
            f"a concurrent registration of {new.table} won (now version "
            f"{after.latest.version}, id {after.table_id}); check with ba-schema show "
            f"{new.table} and retry")
    return after
