from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.descriptor import Descriptor

from blockagg.proto.descriptors import message_class
from blockagg.proto.envelope import make_envelope
from blockagg.proto.registry import MemoryStore, Registry
from blockagg.registration.register import register
from blockagg.rows.columns import Column, Rows
from blockagg.rows.deadletters import DeadLetter
from blockagg.rows.prepare import Message, Plans, prepare


def test_prepare_routes_and_dead_letters(sample: Descriptor, sample_fds: bytes) -> None:
    store = MemoryStore()
    register(store, "db.t", "blockagg.test.Inner", sample_fds, now_ms=1_600_000_000_000)
    plans = Plans(Registry.load(store), lambda t: [Column("a", "UInt8"),
                                                   Column("b", "String")])
    inner = sample.fields_by_name["inner"].message_type
    assert inner is not None
    cls: Any = message_class(inner)
    ok = make_envelope("db.t", [cls(a=1).SerializeToString(),
                                cls(a=2, b="x").SerializeToString()], 1)
    values = [ok, b"\xff", make_envelope("db.nope", [b""]), make_envelope("db.t", [b""], 9),
              make_envelope("db.t", [cls(a=300).SerializeToString()]), None, ok]
    msgs = [Message(100 + i, 1_700_000_000_000 + i, v) for i, v in enumerate(values)]
    prepared = prepare("top", 3, msgs, plans)
    assert prepared.table_ids.tolist() == [1, 0, 0, 0, 0, 0, 1]
    assert prepared.row_counts.tolist() == [2, 1, 1, 1, 1, 1, 2]
    assert prepared.tables == {1: "db.t", 0: "blockagg.dead_letters"}
    assert prepared.dead_letters == 5
    assert isinstance(prepared.payloads[0], Rows)
    reasons = [p.error for p in prepared.payloads if isinstance(p, DeadLetter)]
    assert "Envelope" in reasons[0] and "not registered" in reasons[1]
    assert "version 9" in reasons[2] and "out of range" in reasons[3]
    dl = prepared.payloads[4]
    assert isinstance(dl, DeadLetter) and (dl.offset, dl.partition) == (104, 3)
    again = prepare("top", 3, msgs, plans)
    assert np.array_equal(again.table_ids, prepared.table_ids)
    assert [p.error for p in again.payloads if isinstance(p, DeadLetter)] == reasons
