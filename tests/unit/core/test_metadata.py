"""The metadata codec: what the aggregator commits and the verifier reads back.
Round trips, the 4096-byte budget, and garbage that must only ever raise
MetadataDecodeError."""

from __future__ import annotations

import base64
import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.core.exceptions import MetadataDecodeError, MetadataError, MetadataTooLarge
from aggregator.core.metadata import PREFIX, BlockRange, Metadata, decode, encode

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
def test_encoded_metadata_is_ascii_without_nul(metadata: Metadata) -> None:
    text = encode(metadata, max_bytes=1 << 20)
    assert text.startswith(PREFIX) and text.isascii() and "\x00" not in text


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


def test_too_large_raises_naming_offset_metadata_max_bytes() -> None:
    blocks = tuple(BlockRange(t, 100_000 + t, 1_000_000 - t) for t in range(1, 501))
    metadata = Metadata(1, 1, 0, 4_000_000, 100_000, blocks)
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
    """The layout of docs/metadata.md written the plain way (base64, a varint loop):
    the column-wise codec must produce and accept exactly these strings."""
    packed = bytearray()
    previous = 0
    for block in metadata.blocks:
        for value in (block.table_id - previous, block.first - metadata.start,
                      metadata.end - 1 - block.last):
            while value >= 0x80:
                packed.append((value & 0x7F) | 0x80)
                value >>= 7
            packed.append(value)
        previous = block.table_id
    body = msgpack.packb(
        [metadata.run, metadata.batch, metadata.start, metadata.end, metadata.resume,
         bytes(packed)],
        use_bin_type=True,
    )
    return PREFIX + base64.b85encode(body).decode("ascii")


@settings(max_examples=300, derandomize=True)
@given(metadatas())
def test_wire_format_is_the_documented_layout(metadata: Metadata) -> None:
    text = reference_encode(metadata)
    assert encode(metadata, max_bytes=1 << 20) == text
    assert decode(text) == metadata


@settings(max_examples=300, derandomize=True)
@given(st.binary(max_size=64))
def test_base85_matches_the_standard_library(data: bytes) -> None:
    from aggregator.core.metadata import _b85decode, _b85encode

    text = base64.b85encode(data).decode("ascii")
    assert _b85encode(data) == text
    assert _b85decode(text) == data
