"""Every decoder of outside bytes, fuzzed under a memory limit: the offset-metadata
codec, the envelope, registry records and ``__consumer_offsets`` records.

Inputs are random bytes and mutations of valid encodings (seeded hypothesis). Each
decoder either returns a value or raises its own decode error, never another exception,
and no input makes it allocate beyond :data:`tests.unit.fuzzing.HEADROOM` (each test runs
in a forked child under ``RLIMIT_AS``, where such an allocation is a ``MemoryError``).
"""

from __future__ import annotations

import base64
import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.exceptions import MetadataDecodeError
from blockagg.aggregator.core.metadata import (
    PREFIX,
    PREFIX_PINNED,
    PREFIX_WIDE,
    decode,
    encode,
    encode_base85,
)
from blockagg.aggregator.kafka.exceptions import OffsetsDecodeError
from blockagg.aggregator.kafka.offsets_codec import (
    OffsetCommitKey,
    OffsetCommitValue,
    decode_record,
    encode_key,
    encode_value,
)
from blockagg.proto.envelope import Parsed, decode_envelope, make_envelope, parse_envelope
from blockagg.proto.exceptions import EnvelopeDecodeError, RegistryDecodeError
from blockagg.proto.registry import Registration, SchemaVersion
from tests.unit.core.test_metadata import metadatas
from tests.unit.fuzzing import mutated, run_memory_bounded

FUZZ = settings(max_examples=400, derandomize=True, database=None, deadline=None)

CRAFTED = PREFIX + base64.b85encode(
    msgpack.packb([1, 0, 0, 10, 10, b"", [2**40, 0, 0, 0]], use_bin_type=True)).decode()
"""The issue's 31-byte string: 2**40 blocks of zero-bit fields."""


def _metadata_body(text: str) -> bytes:
    return base64.b85decode(text[len(PREFIX):])


def _rewrap(prefix: str, body: bytes) -> str:
    return prefix + base64.b85encode(body).decode()


def _decode_metadata(text: str) -> None:
    with contextlib.suppress(MetadataDecodeError):
        decode(text)


def test_the_crafted_31_byte_string_is_a_decode_error_within_the_limit() -> None:
    assert len(CRAFTED) == 31

    def body() -> None:
        with pytest.raises(MetadataDecodeError, match="can't hold 1099511627776 blocks"):
            decode(CRAFTED)

    run_memory_bounded(body)


def test_metadata_strings_decode_or_raise_their_error() -> None:
    valid = metadatas().map(lambda m: encode_base85(m, max_bytes=1 << 20))
    wide = metadatas().map(lambda m: encode(m, max_bytes=1 << 20))

    @FUZZ
    @given(st.one_of(
        st.binary(max_size=200).map(lambda b: _rewrap(PREFIX, b)),
        st.binary(max_size=200).map(lambda b: _rewrap(PREFIX_PINNED, b)),
        st.text(max_size=80).map(lambda t: PREFIX + t),
        valid,
        wide,
        st.text(max_size=80).map(lambda t: PREFIX_WIDE + t),
        wide.flatmap(lambda text: mutated(st.just(text.encode())).map(
            lambda raw: raw.decode("utf-8", "replace"))),
        valid.flatmap(lambda text: mutated(st.just(_metadata_body(text))).map(
            lambda body: _rewrap(text[:len(PREFIX)], body))),
        valid.flatmap(lambda text: mutated(st.just(text.encode())).map(
            lambda raw: raw.decode("latin-1"))),
    ))
    def fuzz(text: str) -> None:
        _decode_metadata(text)

    run_memory_bounded(fuzz)


def _envelopes() -> st.SearchStrategy[bytes]:
    return st.builds(make_envelope, st.sampled_from(["db.t", "a.b", "x"]),
                     st.lists(st.binary(max_size=20), max_size=8), st.integers(0, 2**31))


def test_envelopes_decode_or_raise_their_error() -> None:
    @FUZZ
    @given(st.one_of(st.binary(max_size=300), mutated(_envelopes())))
    def fuzz(value: bytes) -> None:
        try:
            parsed = decode_envelope(value)
        except EnvelopeDecodeError as exc:
            assert parse_envelope(value).reason == str(exc)  # type: ignore[union-attr]
        else:
            assert isinstance(parsed, Parsed) and len(parsed.rows) <= len(value) // 2

    run_memory_bounded(fuzz)


def _registrations() -> st.SearchStrategy[bytes]:
    version = st.builds(SchemaVersion, st.integers(1, 5), st.sampled_from(["p.v1.Row", ""]),
                        st.binary(max_size=30), st.integers(0, 2**40),
                        st.lists(st.text(max_size=10), max_size=2).map(tuple))
    return st.builds(Registration, st.sampled_from(["db.t", "a.b"]), st.integers(0, 2**32 - 1),
                     st.lists(version, max_size=3).map(tuple),
                     st.sampled_from(["", "BACKWARD"])).map(lambda r: r.encode())


def test_registry_records_decode_or_raise_their_error() -> None:
    @FUZZ
    @given(st.sampled_from([None, b"db.t", b"\xff"]),
           st.one_of(st.binary(max_size=300), mutated(_registrations())))
    def fuzz(key: bytes | None, value: bytes) -> None:
        with contextlib.suppress(RegistryDecodeError):
            Registration.decode(key, value)

    run_memory_bounded(fuzz)


def _offset_values() -> st.SearchStrategy[bytes]:
    tagged = st.lists(st.tuples(st.integers(0, 5), st.binary(max_size=16)), max_size=3,
                      unique_by=lambda t: t[0]).map(lambda tags: tuple(sorted(tags)))
    return st.builds(
        lambda version, offset, metadata, stamp, epoch, tags: encode_value(OffsetCommitValue(
            offset, metadata, stamp, version, epoch if version >= 3 else -1,
            stamp if version == 1 else -1, tags if version >= 4 else ())),
        st.integers(0, 4), st.integers(-1, 2**63 - 1), st.text(max_size=40),
        st.integers(0, 2**62), st.integers(-1, 2**31 - 1), tagged)


def _offset_keys() -> st.SearchStrategy[bytes]:
    return st.builds(lambda g, t, p, r: encode_key(OffsetCommitKey(g, t, p, r)),
                     st.text(max_size=20), st.text(max_size=20), st.integers(-1, 2**31 - 1),
                     st.sampled_from([0, 1]))


def test_consumer_offsets_records_decode_or_raise_their_error() -> None:
    @FUZZ
    @given(st.one_of(st.none(), st.binary(max_size=60), _offset_keys(), mutated(_offset_keys())),
           st.one_of(st.none(), st.binary(max_size=120), mutated(_offset_values())))
    def fuzz(key: bytes | None, value: bytes | None) -> None:
        with contextlib.suppress(OffsetsDecodeError):
            decode_record(key, value)

    run_memory_bounded(fuzz)


def test_a_tagged_field_count_beyond_the_bytes_left_is_refused_before_the_loop() -> None:
    value = bytearray(encode_value(OffsetCommitValue(5, "m", 7, version=4)))
    value[-1:] = b"\xff\xff\xff\xff\x0f"  # 2**32 - 1 tagged fields in 0 bytes
    with pytest.raises(OffsetsDecodeError, match="tagged fields can't fit"):
        decode_record(encode_key(OffsetCommitKey("g", "t", 0)), bytes(value))
