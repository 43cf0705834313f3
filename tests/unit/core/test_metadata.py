"""The metadata codec: what the aggregator commits and the verifier reads back.
Round trips, the 4096-byte budget, and garbage that must only ever raise
MetadataDecodeError."""

from __future__ import annotations

import base64
import contextlib
import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockagg.aggregator.core.exceptions import MetadataDecodeError, MetadataError, MetadataTooLarge
from blockagg.aggregator.core.metadata import (
    DEFAULT_MAX_BYTES,
    NO_PINS,
    PREFIX,
    PREFIX_WIDE,
    BlockRange,
    Metadata,
    Pins,
    decode,
    encode,
    encode_base85,
    longest_metadata,
)
from tests.unit.core.fakes import metadata_of_length

MAX_OFFSET = 2**63 - 1


@st.composite
def metadatas(draw: st.DrawFn) -> Metadata:
    start = draw(st.integers(min_value=0, max_value=MAX_OFFSET - 1))
    end = draw(st.integers(min_value=start, max_value=min(MAX_OFFSET, start + 2**40)))
    resume = draw(st.integers(min_value=start, max_value=end))
    blocks = []
    if resume < end:
        table_ids = draw(st.sets(st.integers(min_value=0, max_value=2**31), max_size=20))
        for table_id in table_ids:
            first = draw(st.integers(min_value=resume, max_value=end - 1))
            last = draw(st.integers(min_value=first, max_value=end - 1))
            blocks.append(BlockRange(table_id, first, last))
    return Metadata(
        run=draw(st.integers(min_value=0, max_value=2**64 - 1)),
        batch=draw(st.integers(min_value=0, max_value=2**63 - 1)),
        start=start,
        end=end,
        resume=resume,
        blocks=tuple(blocks),
    )


@settings(max_examples=300, derandomize=True)
@given(metadatas())
def test_round_trip_preserves_every_field(metadata: Metadata) -> None:
    assert decode(encode(metadata, max_bytes=1 << 20)) == metadata


@settings(max_examples=100, derandomize=True)
@given(metadatas())
def test_encoded_metadata_is_one_utf16_unit_per_character_without_nul(
        metadata: Metadata) -> None:
    """Version 3: every character of the body in [U+4E00, U+CE00), so valid UTF-8,
    no NUL, and each one UTF-16 unit (what the broker's limit counts); the earlier
    base85 versions stay ASCII."""
    text = encode(metadata, max_bytes=1 << 20)
    assert text.startswith(PREFIX_WIDE) and "\x00" not in text
    assert all(0x4E00 <= ord(c) < 0xCE00 for c in text[len(PREFIX_WIDE):])
    assert len(text.encode("utf-16-le")) == 2 * len(text)
    old = encode_base85(metadata, max_bytes=1 << 20)
    assert old.startswith(PREFIX) and old.isascii() and "\x00" not in old


def test_500_tables_fit_the_default_limit_for_a_100k_offset_batch() -> None:
    start, end = 7_000_000_000, 7_000_100_000
    blocks = tuple(
        BlockRange(table_id, start + 100 * table_id, end - 1 - 30 * table_id)
        for table_id in range(1, 501)
    )
    metadata = Metadata(2**64 - 1, 10**9, start, end, start + 100, blocks)
    text = encode(metadata)
    assert len(text) <= 4096
    assert decode(text) == metadata


def test_500_tables_fit_a_mid_batch_intent_over_a_million_offsets() -> None:
    """The worst case of the varint layout (blocks far from both batch edges) fits in
    the fixed-width layout: about 9 + 2 * 20 bits per block."""
    start, end = 3_000_000_000, 3_001_000_000
    spread = [(t * 7_919**2) % 990_000 for t in range(1, 501)]
    blocks = tuple(
        BlockRange(t, start + 5_000 + s, start + 5_000 + s + (t * 104_729) % 4_000)
        for t, s in zip(range(1, 501), spread, strict=True)
    )
    metadata = Metadata(2**64 - 1, 10**9, start, end, start + 5_000, blocks)
    text = encode(metadata)
    assert len(text) <= 4096
    assert decode(text) == metadata


def test_too_large_raises_naming_offset_metadata_max_bytes() -> None:
    blocks = tuple(
        BlockRange(t, (t * 7_919**3) % 2**40, (t * 7_919**3) % 2**40 + (t * 104_729) % 2**38)
        for t in range(1, 2001)
    )
    metadata = Metadata(1, 1, 0, 2**41, 0, blocks)
    with pytest.raises(MetadataTooLarge, match=r"offset\.metadata\.max\.bytes"):
        encode(metadata)


def test_trailing_nul_characters_are_accepted() -> None:
    metadata = Metadata(5, 6, 100, 200, 150, (BlockRange(3, 150, 199),))
    assert decode(encode(metadata) + "\x00\x00") == metadata


def test_foreign_string_is_a_decode_error_naming_the_prefix() -> None:
    with pytest.raises(MetadataDecodeError, match="ba1:"):
        decode("")


@pytest.mark.parametrize(
    "text",
    [
        "ba1:",
        "ba1:~~~~~",
        "ba1:abc",
        PREFIX + "VPRomVPRomVPRom",
        encode(Metadata(1, 1, 0, 10, 0, (BlockRange(1, 0, 9),)))[:-3],
    ],
    ids=["empty_body", "base85_overflow", "not_msgpack", "wrong_shape", "truncated"],
)
def test_corrupt_metadata_raises_decode_error(text: str) -> None:
    with pytest.raises(MetadataDecodeError):
        decode(text)


def test_invalid_metadata_is_refused_at_construction() -> None:
    with pytest.raises(MetadataError):
        Metadata(1, 1, 10, 20, 21)
    with pytest.raises(MetadataError):
        Metadata(1, 1, 0, 20, 10, (BlockRange(1, 5, 9),))
    with pytest.raises(MetadataError):
        Metadata(1, 1, 0, 20, 0, (BlockRange(1, 0, 3), BlockRange(1, 5, 9)))


@settings(max_examples=500, derandomize=True)
@given(st.text(max_size=200))
def test_any_text_decodes_or_raises_decode_error_only(text: str) -> None:
    with contextlib.suppress(MetadataDecodeError):
        decode(text)


@settings(max_examples=500, derandomize=True)
@given(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=120))
def test_any_prefixed_text_decodes_or_raises_decode_error_only(body: str) -> None:
    with contextlib.suppress(MetadataDecodeError):
        decode(PREFIX + body)


@settings(max_examples=500, derandomize=True)
@given(st.binary(max_size=120))
def test_any_msgpack_body_decodes_or_raises_decode_error_only(body: bytes) -> None:
    with contextlib.suppress(MetadataDecodeError):
        decode(PREFIX + base64.b85encode(body).decode("ascii"))


@settings(max_examples=300, derandomize=True)
@given(
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), min_size=5, max_size=5),
    st.binary(max_size=40),
)
def test_any_fields_decode_or_raise_decode_error_only(header: list[int], packed: bytes) -> None:
    try:
        body = msgpack.packb([*header, packed], use_bin_type=True)
    except OverflowError:
        return
    with contextlib.suppress(MetadataDecodeError):
        decode(PREFIX + base64.b85encode(body).decode("ascii"))


def reference_encode(metadata: Metadata) -> str:
    """The layouts of docs/metadata.md written the plain way (base64, a varint loop, a
    string of bits): the column-wise codec must produce and accept exactly these
    strings, choosing the fixed-width layout only when it is strictly shorter."""
    values: list[int] = []
    previous = 0
    for block in metadata.blocks:
        values += (block.table_id - previous, block.first - metadata.start,
                   metadata.end - 1 - block.last)
        previous = block.table_id
    header = [metadata.run, metadata.batch, metadata.start, metadata.end, metadata.resume]
    packed = bytearray()
    for value in values:
        while value >= 0x80:
            packed.append((value & 0x7F) | 0x80)
            value >>= 7
        packed.append(value)
    varints = msgpack.packb([*header, bytes(packed)], use_bin_type=True)
    widths = [max(values[i::3], default=0).bit_length() for i in range(3)]
    bits = "".join(
        format(value, f"0{widths[i % 3]}b") if widths[i % 3] else ""
        for i, value in enumerate(values)
    )
    bits += "0" * (-len(bits) % 8)
    fixed = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
    fixed_body = msgpack.packb(
        [*header, fixed, [len(metadata.blocks), *widths]], use_bin_type=True
    )
    body = fixed_body if len(fixed_body) < len(varints) else varints
    return PREFIX + base64.b85encode(body).decode("ascii")


@settings(max_examples=300, derandomize=True)
@given(metadatas())
def test_wire_format_is_the_documented_layout(metadata: Metadata) -> None:
    text = reference_encode(metadata)
    assert encode_base85(metadata, max_bytes=1 << 20) == text
    assert decode(text) == metadata


def reference_wide(metadata: Metadata) -> str:
    """Version 3 written the plain way: version 2's body (pins ``[0, 0, 0]`` when
    none) as a string of bits, a 1, zeros to a multiple of 15, a character
    ``U+4E00 + value`` per 15 bits."""
    pinned = metadata if metadata.pins != NO_PINS else dataclasses.replace(
        metadata, pins=Pins(registry=1))
    body = msgpack.unpackb(base64.b85decode(encode_base85(pinned, max_bytes=1 << 20)[4:]))
    body[7] = [0, 0, 0] if metadata.pins == NO_PINS else body[7]
    bits = "".join(format(b, "08b") for b in msgpack.packb(body, use_bin_type=True)) + "1"
    bits += "0" * (-len(bits) % 15)
    return PREFIX_WIDE + "".join(chr(0x4E00 + int(bits[i:i + 15], 2))
                                 for i in range(0, len(bits), 15))


@settings(max_examples=300, derandomize=True)
@given(metadatas())
def test_version_3_is_the_documented_layout(metadata: Metadata) -> None:
    text = reference_wide(metadata)
    assert encode(metadata, max_bytes=1 << 20) == text
    assert decode(text) == metadata


@settings(max_examples=300, derandomize=True)
@given(metadatas())
def test_a_base85_string_written_before_version_3_decodes_alike(metadata: Metadata) -> None:
    """A job upgraded mid-stream replays what the old version committed: the old
    string and the new one decode to the same metadata."""
    assert decode(reference_encode(metadata)) == decode(encode(metadata, 1 << 20)) == metadata


@settings(max_examples=300, derandomize=True)
@given(st.binary(max_size=64))
def test_base85_matches_the_standard_library(data: bytes) -> None:
    from blockagg.aggregator.core.metadata import _b85decode, _b85encode

    text = base64.b85encode(data).decode("ascii")
    assert _b85encode(data) == text
    assert _b85decode(text) == data


@settings(max_examples=500, derandomize=True)
@given(
    st.binary(max_size=48),
    st.lists(st.integers(min_value=-2, max_value=2**20), min_size=0, max_size=5)
    | st.lists(st.booleans(), max_size=4)
    | st.text(max_size=4),
)
def test_garbage_fixed_width_block_lists_are_decode_errors(data: bytes, widths: object) -> None:
    body = msgpack.packb([1, 2, 0, 1_000, 10, data, widths], use_bin_type=True)
    with contextlib.suppress(MetadataDecodeError):
        decode(PREFIX + base64.b85encode(body).decode("ascii"))


def test_the_limit_leaves_room_for_the_clients_trailing_nul() -> None:
    """librdkafka sends the string NUL-terminated and the broker counts the NUL, so
    the longest string a broker with offset.metadata.max.bytes = N accepts is N - 1."""
    metadata = metadata_of_length(3004)
    assert len(encode(metadata, max_bytes=3005)) == 3004
    with pytest.raises(MetadataTooLarge, match=r"offset\.metadata\.max\.bytes = 3004"):
        encode(metadata, max_bytes=3004)
    assert longest_metadata(DEFAULT_MAX_BYTES) == 4095
    with pytest.raises(MetadataTooLarge):
        encode(metadata_of_length(4096))
    assert len(encode(metadata_of_length(4094))) == 4094


@settings(max_examples=200, derandomize=True)
@given(metadatas(), st.integers(min_value=0, max_value=2**32 - 1),
       st.integers(min_value=0, max_value=2**40 - 1), st.booleans())
def test_the_attempt_and_its_time_round_trip_with_or_without_pins(
        metadata: Metadata, attempt: int, since_s: int, pinned: bool) -> None:
    from dataclasses import replace

    from blockagg.aggregator.core.metadata import Pins

    written = replace(metadata, attempt=attempt, since_s=since_s,
                      pins=Pins(3, 2**64 - 1, 2, 7) if pinned else metadata.pins)
    assert decode(encode(written, max_bytes=1 << 20)) == written


def test_a_commit_written_before_attempts_were_recorded_still_decodes() -> None:
    """The ``ba2:`` body of 8 fields (no attempt) is what jobs before the attempt nonce
    committed; it decodes with ``attempt = since_s = 0``."""
    from blockagg.aggregator.core.metadata import Pins

    old = encode(Metadata(5, 6, 100, 200, 150, (BlockRange(3, 150, 199),), Pins(1, 2, 1)))
    decoded = decode(old)
    assert decoded.attempt == 0 and decoded.since_s == 0 and decoded.pins == Pins(1, 2, 1)
