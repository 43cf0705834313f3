"""The metadata contract: what the aggregator commits to Kafka with every offset
commit, and what the verifier reads back from ``__consumer_offsets``.

See ``docs/metadata.md`` for the full contract. In short, a :class:`Metadata` records
for one topic-partition:

* the writer (``run``: a random id per job run) and the micro-batch (``batch``);
* the batch's planned offset range ``[start, end)``;
* the resume offset (also the committed consumer-group offset): every offset below
  it is delivered, and it is at or below every unacknowledged block and every
  buffered message;
* for every table whose last block may still matter (its last offset is at or above
  the resume offset), that block's first and last offset.

* the :class:`Pins`: what besides the messages decided the batch's blocks (the
  schema-registry position, the topic's incarnation, the deduplication mode), so a
  replay decides alike (``docs/protocol.md``, "What a replay depends on").

Encoding: ``"ba1:" + base85(msgpack([run, batch, start, end, resume, packed]))``
or, when strictly shorter, ``msgpack([run, batch, start, end, resume, packed,
[blocks, w1, w2, w3]])``; with pins, ``"ba2:" + base85(msgpack([run, batch, start,
end, resume, packed, widths or nil, [registry, incarnation, dedup(, structure)](,
[attempt(, since_s)])]))``: a commit that records its attempt uses the ``ba2:`` layout
even without pins. Version 3 (``ba3:``, every commit written since issue 28) is
version 2's body (pins ``[0, 0, 0]`` when none) in base32768 instead of base85: 15
bits per character, each in ``[U+4E00, U+CE00)``, 2.3 times shorter as the broker
counts (``String.length()``, UTF-16 units). Either
way the block list holds three values per block, sorted by table id:
``table_id - previous_table_id`` (the first one raw), ``first - start`` and
``end - 1 - last``; the varint layout packs them as unsigned LEB128 varints, the
fixed-width one as bit fields (each column as wide as its largest value, MSB first,
zero-padded). The fixed-width layout bounds a block at about ``log2(tables) + 2 *
log2(batch range)`` bits, so 500 tables fit the broker's default 4096-byte limit for
batch ranges up to about a million offsets wherever the blocks lie in base85, and
1,000 tables in base32768. Offsets themselves are 64-bit. Versions 1 and 2 are ASCII,
version 3 Basic Multilingual Plane characters without surrogates: valid UTF-8 without NUL.

Above 500 lines because every layout version's encoder and decoder sit side by side, so a
version is never changed on one side only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import accumulate
from operator import attrgetter
from typing import Final

import msgpack
import numpy as np

from blockagg.aggregator.core.exceptions import MetadataDecodeError, MetadataError, MetadataTooLarge

PREFIX: Final = "ba1:"
"""Marks a metadata string as blockagg's, version 1 of the layout (no pins)."""

PREFIX_PINNED: Final = "ba2:"
"""Version 2 of the layout: version 1's body followed by the :class:`Pins`."""

PREFIX_WIDE: Final = "ba3:"
"""Version 3: version 2's body in base32768 (15 bits per character) instead of
base85 (6.4), the layout every commit is written in since issue 28."""

PREFIXES: Final = (PREFIX, PREFIX_PINNED, PREFIX_WIDE)

WIDE_FIRST: Final = 0x4E00
"""The first code point of base32768's alphabet: ``U+4E00 + value`` for each 15-bit
value, so every character lies in ``[U+4E00, U+CE00)``: in the Basic Multilingual
Plane (one UTF-16 unit, which is what the broker's ``String.length()`` counts against
``offset.metadata.max.bytes``), below the surrogates, never NUL."""

WIDE_BITS: Final = 15

DEFAULT_MAX_BYTES: Final = 4096
"""Kafka's default ``offset.metadata.max.bytes``."""

CLIENT_TERMINATOR_BYTES: Final = 1
"""What the client adds to the metadata string on the wire: librdkafka sends it with
its trailing NUL, and the broker counts that byte against ``offset.metadata.max.bytes``
(a 4095-character string is accepted under the default 4096, a 4096-character one is
refused: ``tests/integration/test_metadata_store.py``)."""


def longest_metadata(max_bytes: int) -> int:
    """The longest metadata string a broker with ``offset.metadata.max.bytes =
    max_bytes`` accepts."""
    return max_bytes - CLIENT_TERMINATOR_BYTES

DEAD_LETTER_TABLE_ID: Final = 0
"""Table id reserved for the dead-letter table."""

_MAX_OFFSET: Final = 2**63 - 1


@dataclass(frozen=True, order=True, slots=True)
class BlockRange:
    """One table's block: the first and last Kafka offset of the messages in it.

    Both ends are inclusive. The block holds every message of ``table_id`` in
    ``[first, last]`` of its partition, in offset order, and no other message.
    """

    table_id: int
    first: int
    last: int

    def __post_init__(self) -> None:
        if self.table_id < 0:
            raise MetadataError(f"table id must be >= 0, got {self.table_id}")
        if not 0 <= self.first <= self.last <= _MAX_OFFSET:
            raise MetadataError(
                f"block of table {self.table_id} has first={self.first} last={self.last}; "
                "need 0 <= first <= last < 2**63"
            )

    def overlaps(self, other: BlockRange) -> bool:
        """True when both blocks share at least one offset."""
        return self.first <= other.last and other.first <= self.last


class DedupMode(IntEnum):
    """How ClickHouse recognises a retried block, pinned so a replay is recognised
    the same way as its first attempt even across a server upgrade."""

    UNPINNED = 0
    """Not recorded (metadata written before pins existed): the server's current mode."""
    BLOCK_HASH = 1
    """By the hash of the block's content (servers without ``insert_deduplication_token``)."""
    TOKEN = 2
    """By the block's ``insert_deduplication_token``."""


@dataclass(frozen=True, slots=True)
class Pins:
    """What, besides the partition's messages and the thresholds, decided a batch's
    blocks: a replay of an intent must use exactly its pins (invariant 5).

    ``registry`` is the schema-registry position the batch was classified with (the
    registry as of that position decides table or dead letter, schema version and
    column mapping; ``0``: not pinned). ``incarnation`` is a 64-bit fingerprint of the
    Kafka cluster id and the topic id (:func:`incarnation_of`; ``0``: unknown), so a
    recreated topic or another cluster's topic of the same name is recognised, and it
    is part of every block's deduplication token. ``dedup`` is the
    :class:`DedupMode` the blocks were inserted with. ``structure`` is a ZooKeeper
    transaction id at or above the last change of the columns of every table the
    batch may write, read before any of its first attempts (``0``: not pinned):
    under :attr:`DedupMode.BLOCK_HASH` a re-sent block hashes alike only if its
    table's columns did not change since (:mod:`aggregator.clickhouse.structure`).
    """

    registry: int = 0
    incarnation: int = 0
    dedup: int = DedupMode.UNPINNED
    structure: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.registry <= _MAX_OFFSET:
            raise MetadataError(f"registry position must be in [0, 2**63), got {self.registry}")
        if not 0 <= self.incarnation < 2**64:
            raise MetadataError(
                f"topic incarnation must fit in 64 bits unsigned, got {self.incarnation}")
        if self.dedup not in DedupMode._value2member_map_:
            raise MetadataError(f"unknown deduplication mode {self.dedup}")
        if not 0 <= self.structure <= _MAX_OFFSET:
            raise MetadataError(
                f"structure mark must be in [0, 2**63), got {self.structure}")


NO_PINS: Final = Pins()


def incarnation_of(cluster_id: str, topic_id: str) -> int:
    """The topic incarnation fingerprint: a pure function of the Kafka cluster id and
    the topic id (both as Kafka prints them), never 0."""
    digest = hashlib.blake2b(f"{cluster_id}/{topic_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def is_blockagg(text: str) -> bool:
    """True when a committed metadata string claims to be blockagg's (any layout)."""
    return text.rstrip("\x00").startswith(PREFIXES)


_block_order: Final = attrgetter("table_id", "first", "last")
"""The order of ``BlockRange``'s fields, as a sort key (faster than its ``__lt__``)."""


@dataclass(frozen=True, slots=True)
class Metadata:
    """One committed metadata instance for one topic-partition.

    Invariants checked at construction: ``0 <= start <= resume <= end``; every block
    lies inside ``[start, end)`` and ends at or after ``resume`` (a block that ends
    before the resume offset no longer matters and must be left out); at most one
    block per table.

    ``attempt`` names the task attempt that wrote the commit (a random non-zero 32-bit
    nonce per :class:`~blockagg.aggregator.kafka.fencing.FencedAttempt`; ``0``: not
    recorded). Two attempts at the same batch plan byte-identical intents otherwise,
    and an attempt confirms before each insert that the partition's last commit is
    still *its own*: the nonce is what makes "its own" exact (``docs/protocol.md``,
    *Fencing*). ``since_s`` is when the earliest first attempt of a block the commit
    lists may have been sent, in seconds since the epoch (``0``: unknown; never later
    than the real first send): a replay judges with it whether the server may already
    have forgotten the block (``replicated_deduplication_window_seconds``).
    """

    run: int
    batch: int
    start: int
    end: int
    resume: int
    blocks: tuple[BlockRange, ...] = field(default=())
    pins: Pins = NO_PINS
    attempt: int = 0
    since_s: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.run < 2**64:
            raise MetadataError(f"run id must fit in 64 bits unsigned, got {self.run}")
        if not 0 <= self.attempt < 2**32:
            raise MetadataError(f"attempt must fit in 32 bits unsigned, got {self.attempt}")
        if not 0 <= self.since_s < 2**40:
            raise MetadataError(f"since_s must be seconds since the epoch, got {self.since_s}")
        if not 0 <= self.batch < 2**63:
            raise MetadataError(f"batch id must be >= 0, got {self.batch}")
        if not 0 <= self.start <= self.resume <= self.end <= _MAX_OFFSET:
            raise MetadataError(
                f"need 0 <= start <= resume <= end, got start={self.start} "
                f"resume={self.resume} end={self.end}"
            )
        ordered = tuple(sorted(self.blocks, key=_block_order))
        object.__setattr__(self, "blocks", ordered)
        seen: set[int] = set()
        for block in ordered:
            if block.table_id in seen:
                raise MetadataError(f"table {block.table_id} has more than one block")
            seen.add(block.table_id)
            if not self.start <= block.first <= block.last < self.end:
                raise MetadataError(
                    f"block {block} lies outside the batch range [{self.start}, {self.end})"
                )
            if block.last < self.resume:
                raise MetadataError(
                    f"block {block} ends before the resume offset {self.resume}; "
                    "a delivered block must be left out of the metadata"
                )

    @property
    def is_final(self) -> bool:
        """True for the commit that closes a batch: everything below ``end`` delivered."""
        return self.resume == self.end and not self.blocks

    def block_of(self, table_id: int) -> BlockRange | None:
        """The block recorded for ``table_id``, if any."""
        for block in self.blocks:
            if block.table_id == table_id:
                return block
        return None

    @property
    def min_offset(self) -> int:
        """The seed's ``M.min``: the smallest offset this metadata still needs."""
        return min([self.resume, *(b.first for b in self.blocks)])


_B85_ALPHABET: Final = np.frombuffer(
    b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~",
    dtype=np.uint8,
)
_B85_VALUES: Final = np.full(256, 255, dtype=np.uint8)
_B85_VALUES[_B85_ALPHABET] = np.arange(85, dtype=np.uint8)
_POWERS_OF_85: Final = np.array([85**4, 85**3, 85**2, 85, 1], dtype=np.uint64)
_VARINT_LIMITS: Final = np.array([1 << (7 * k) for k in range(1, 9)], dtype=np.uint64)


def _b85encode(data: bytes) -> str:
    """``base64.b85encode(data).decode()``, column-wise: same output, ~20x faster."""
    padding = -len(data) % 4
    words = np.frombuffer(data + b"\0" * padding, dtype=">u4").astype(np.uint64)
    digits = (words[:, None] // _POWERS_OF_85) % 85
    text = _B85_ALPHABET[digits.astype(np.intp)].tobytes()
    return text[: len(text) - padding].decode("ascii")


def _b85decode(text: str) -> bytes:
    """``base64.b85decode(text)``, column-wise; raises :class:`MetadataDecodeError`."""
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError as exc:
        raise MetadataDecodeError("metadata body is not ASCII base85") from exc
    padding = -len(raw) % 5
    values = _B85_VALUES[np.frombuffer(raw + b"~" * padding, dtype=np.uint8)]
    if (values == 255).any():
        raise MetadataDecodeError("bad base85 character in the metadata body")
    words = values.reshape(-1, 5).astype(np.uint64) @ _POWERS_OF_85
    if (words > 0xFFFFFFFF).any():
        raise MetadataDecodeError("base85 overflow in the metadata body")
    data = words.astype(">u4").tobytes()
    return data[: len(data) - padding]


def _pack_varints(values: list[int]) -> bytes:
    """Unsigned LEB128 of every value (each below 2**63), concatenated."""
    if not values:
        return b""
    numbers = np.array(values, dtype=np.uint64)
    lengths = 1 + (numbers[:, None] >= _VARINT_LIMITS).sum(axis=1)
    starts = np.cumsum(lengths) - lengths
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for k in range(int(lengths.max())):
        has = lengths > k
        group = (numbers[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (lengths[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + k] = (group | more).astype(np.uint8)
    return out.tobytes()


def _unpack_varints(data: bytes) -> list[int]:
    """The values of concatenated unsigned LEB128 varints of at most 63 bits."""
    if not data:
        return []
    raw = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(raw < 0x80)
    if ends.size == 0 or ends[-1] != raw.size - 1:
        raise MetadataDecodeError("truncated varint in the block list")
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if int(lengths.max()) > 9:
        raise MetadataDecodeError("varint longer than 63 bits in the block list")
    shifts = (np.arange(raw.size) - np.repeat(starts, lengths)).astype(np.uint64) * np.uint64(7)
    parts = (raw & 0x7F).astype(np.uint64) << shifts
    values: list[int] = np.add.reduceat(parts, starts).tolist()
    return values


def _pack_bits(values: list[int]) -> tuple[bytes, list[int]]:
    """The block list's fixed-width layout: ``values`` (three per block) as bit fields,
    each of the three columns as wide as its largest value, row after row, MSB first,
    zero-padded to whole bytes; returns the bytes and ``[blocks, w1, w2, w3]``."""
    numbers = np.array(values, dtype=np.uint64).reshape(-1, 3)
    widths = [int(column.max()).bit_length() if column.size else 0 for column in numbers.T]
    columns = [
        (numbers[:, [i]] >> np.arange(w - 1, -1, -1, dtype=np.uint64)) & np.uint64(1)
        for i, w in enumerate(widths)
    ]
    bits = np.concatenate(columns, axis=1).astype(np.uint8).reshape(-1)
    return np.packbits(bits).tobytes(), [numbers.shape[0], *widths]


def _unpack_bits(data: bytes, widths: object) -> list[int]:
    """The values of :func:`_pack_bits`' layout; refuses anything it would not write."""
    if (
        not isinstance(widths, list)
        or len(widths) != 4
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in widths)
        or widths[0] < 0
        or not all(0 <= w <= 63 for w in widths[1:])
    ):
        raise MetadataDecodeError(f"bad bit widths in the block list: {widths!r:.80}")
    count, *column_widths = widths
    row = sum(column_widths)
    if count > 8 * len(data) + 1:
        # Checked before anything is allocated: a block takes at least one bit, but
        # for a lone block whose three values are all 0 (row width 0), so a count
        # above the bits there are is a crafted string (2**40 blocks of 0 bits).
        raise MetadataDecodeError(
            f"block list of {len(data)} bytes can't hold {count} blocks")
    total = count * row
    if len(data) != (total + 7) // 8:
        raise MetadataDecodeError(
            f"block list of {len(data)} bytes does not hold {count} blocks of {row} bits"
        )
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if bits[total:].any():
        raise MetadataDecodeError("non-zero padding in the block list")
    matrix = bits[:total].reshape(count, row).astype(np.uint64)
    columns = []
    left = 0
    for w in column_widths:
        weights = np.uint64(1) << np.arange(w - 1, -1, -1, dtype=np.uint64)
        columns.append(matrix[:, left : left + w] @ weights)
        left += w
    values: list[int] = np.stack(columns, axis=1).reshape(-1).tolist()
    return values


def _body(metadata: Metadata, pinned: bool) -> bytes:
    """The msgpack body: version 1's (``pinned=False``, only without pins and
    attempt) or version 2's, whichever of its two block layouts is shorter."""
    fields: list[int] = []
    previous = 0
    for block in metadata.blocks:
        if block.table_id > _MAX_OFFSET:
            raise MetadataError(f"table id must be below 2**63, got {block.table_id}")
        fields += (
            block.table_id - previous,
            block.first - metadata.start,
            metadata.end - 1 - block.last,
        )
        previous = block.table_id
    header = [metadata.run, metadata.batch, metadata.start, metadata.end, metadata.resume]
    pins = metadata.pins
    tail: list[object] = []
    if pinned:
        tail = [[pins.registry, pins.incarnation, int(pins.dedup),
                 *([pins.structure] if pins.structure else [])]]
    if metadata.attempt or metadata.since_s:
        tail.append([metadata.attempt, *([metadata.since_s] if metadata.since_s else [])])
    varints = msgpack.packb([*header, _pack_varints(fields), *([None] if tail else []), *tail],
                            use_bin_type=True)
    packed, widths = _pack_bits(fields)
    bits = msgpack.packb([*header, packed, widths, *tail], use_bin_type=True)
    body: bytes = bits if len(bits) < len(varints) else varints
    return body


def _wide_encode(data: bytes) -> str:
    """Base32768: ``data``'s bits, then a 1 bit and zeros up to a multiple of 15, as
    one character ``U+4E00 + value`` per 15 bits (MSB first)."""
    bits = np.concatenate((np.unpackbits(np.frombuffer(data, dtype=np.uint8)),
                           np.ones(1, dtype=np.uint8)))
    bits = np.concatenate((bits, np.zeros(-bits.size % WIDE_BITS, dtype=np.uint8)))
    weights = np.uint32(1) << np.arange(WIDE_BITS - 1, -1, -1, dtype=np.uint32)
    values = bits.reshape(-1, WIDE_BITS).astype(np.uint32) @ weights + np.uint32(WIDE_FIRST)
    return values.astype("<u4").tobytes().decode("utf-32-le")


def _wide_decode(text: str) -> bytes:
    """The bytes of :func:`_wide_encode`; raises :class:`MetadataDecodeError`."""
    values = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    values = values.astype(np.int64) - WIDE_FIRST
    if values.size == 0 or ((values < 0) | (values >= 1 << WIDE_BITS)).any():
        raise MetadataDecodeError("metadata body is not base32768")
    shifts = np.arange(WIDE_BITS - 1, -1, -1, dtype=np.int64)
    bits = ((values[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)
    ones = np.flatnonzero(bits)
    if ones.size == 0 or bits.size - ones[-1] > WIDE_BITS or ones[-1] % 8:
        raise MetadataDecodeError("bad padding at the end of the base32768 metadata body")
    return np.packbits(bits[: ones[-1]]).tobytes()


def encode(metadata: Metadata, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Encode ``metadata`` as the string committed with the offset (version 3,
    ``ba3:``).

    Raises :class:`MetadataTooLarge` (naming ``offset.metadata.max.bytes``) when the
    result is longer than :func:`longest_metadata` of ``max_bytes`` (the client's
    trailing NUL counts against the broker's limit), so the caller fails before
    inserting instead of the broker refusing the commit on every retry.
    """
    return _checked(PREFIX_WIDE + _wide_encode(_body(metadata, pinned=True)), metadata,
                    max_bytes)


def encode_base85(metadata: Metadata, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """The version 1 or 2 string (base85, ASCII) the job wrote before version 3:
    kept to prove that the decoder reads them alike (``tests/unit/core``) and for
    the size comparison in ``bench/bench_metadata.py``."""
    pinned = metadata.pins != NO_PINS or bool(metadata.attempt or metadata.since_s)
    prefix = PREFIX_PINNED if pinned else PREFIX
    return _checked(prefix + _b85encode(_body(metadata, pinned)), metadata, max_bytes)


def _checked(text: str, metadata: Metadata, max_bytes: int) -> str:
    if len(text) > longest_metadata(max_bytes):
        raise MetadataTooLarge(
            f"metadata for {len(metadata.blocks)} tables encodes to {len(text)} bytes, over "
            f"the limit of {longest_metadata(max_bytes)} (the broker's "
            f"offset.metadata.max.bytes = {max_bytes}, less the client's trailing NUL). Raise "
            "offset.metadata.max.bytes on the brokers and the matching setting here, or "
            "lower the per-partition batch size (maxOffsetsPerTrigger) so offsets stay small."
        )
    return text


def decode(text: str) -> Metadata:
    """Decode a committed metadata string; raises :class:`MetadataDecodeError`.

    Trailing NUL characters, which some clients append, are ignored.
    """
    text = text.rstrip("\x00")
    if not text.startswith(PREFIXES):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise MetadataDecodeError(
            f"not blockagg metadata (expected prefix {PREFIX!r}, {PREFIX_PINNED!r} or "
            f"{PREFIX_WIDE!r}): {shown!r}")
    pinned = text.startswith((PREFIX_PINNED, PREFIX_WIDE))
    try:
        if text.startswith(PREFIX_WIDE):
            body = _wide_decode(text[len(PREFIX_WIDE):])
        else:
            body = _b85decode(text[len(PREFIX):])
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MetadataDecodeError(f"corrupt metadata body: {exc}") from exc
    pins = NO_PINS
    attempt = since_s = 0
    if pinned:
        if not isinstance(fields, list) or len(fields) not in (8, 9):
            raise MetadataDecodeError(
                f"expected 8 or 9 fields in a {PREFIX_PINNED!r} metadata body, got "
                f"{fields!r:.80}")
        if len(fields) == 9:
            attempt, since_s = _decode_attempt(fields.pop())
        pins = _decode_pins(fields.pop())
        if fields[6] is None:
            fields.pop()
    if not isinstance(fields, list) or len(fields) not in (6, 7):
        raise MetadataDecodeError(
            f"expected 6 or 7 fields in the metadata body, got {fields!r:.80}"
        )
    run, batch, start, end, resume, packed = fields[:6]
    if not all(isinstance(v, int) for v in (run, batch, start, end, resume)):
        raise MetadataDecodeError("metadata header fields must be integers")
    if not isinstance(packed, bytes):
        raise MetadataDecodeError("metadata block list must be bytes")
    values = _unpack_varints(packed) if len(fields) == 6 else _unpack_bits(packed, fields[6])
    if len(values) % 3:
        raise MetadataDecodeError("truncated varint in the block list")
    deltas = values[0::3]
    if 0 in deltas[1:]:
        raise MetadataDecodeError("table ids in the block list must be increasing")
    end_1 = end - 1
    try:
        blocks = [
            BlockRange(table_id, start + first_rel, end_1 - tail)
            for table_id, first_rel, tail in zip(
                accumulate(deltas), values[1::3], values[2::3], strict=True
            )
        ]
        return Metadata(run, batch, start, end, resume, tuple(blocks), pins, attempt, since_s)
    except MetadataDecodeError:
        raise
    except MetadataError as exc:
        raise MetadataDecodeError(f"metadata violates the contract: {exc}") from exc


def _decode_attempt(raw: object) -> tuple[int, int]:
    if (
        not isinstance(raw, list)
        or len(raw) not in (1, 2)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
    ):
        raise MetadataDecodeError(f"bad attempt in the metadata body: {raw!r:.80}")
    return raw[0], raw[1] if len(raw) == 2 else 0


def _decode_pins(raw: object) -> Pins:
    if (
        not isinstance(raw, list)
        or len(raw) not in (3, 4)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
    ):
        raise MetadataDecodeError(f"bad pins in the metadata body: {raw!r:.80}")
    try:
        return Pins(*raw)
    except MetadataError as exc:
        raise MetadataDecodeError(f"bad pins in the metadata body: {exc}") from exc


def worst_case_length(table_ids: Iterable[int], span: int) -> int:
    """The longest intent :func:`encode` can write for a partition listing a block of
    every table of ``table_ids`` in a batch range of ``span`` offsets, with every pin,
    the attempt and its time at their widest: the fixed-width layout with both offset
    columns ``span - 1`` wide (the encoder writes it or a shorter one). The start-up
    check compares it with ``offset.metadata.max.bytes`` before anything is committed."""
    ids = sorted(set(table_ids))
    gaps = [b - a for a, b in zip([0, *ids], ids, strict=False)]
    far = max(span - 1, 0)
    packed, widths = _pack_bits([v for gap in gaps for v in (gap, far, far)])
    header = [2**64 - 1, _MAX_OFFSET, _MAX_OFFSET, _MAX_OFFSET, _MAX_OFFSET]
    tail = [[_MAX_OFFSET, 2**64 - 1, int(DedupMode.TOKEN), _MAX_OFFSET], [2**32 - 1, 2**40 - 1]]
    body = msgpack.packb([*header, packed, widths, *tail], use_bin_type=True)
    return len(PREFIX_WIDE) + -(-(8 * len(body) + 1) // WIDE_BITS)


def budget_refusal(table_ids: Iterable[int], span: int, max_bytes: int,
                   broker_max_bytes: int | None) -> str | None:
    """Why the job must not start with these tables and batch ranges (one line naming
    the settings and the value to set), or ``None`` when every intent fits.

    ``max_bytes`` is the job's ``offset_metadata_max_bytes``; ``broker_max_bytes`` the
    brokers' ``offset.metadata.max.bytes`` as they describe it (``None``: not known).
    A broker below the job's setting refuses first: the job would encode strings the
    broker rejects, at the first intent, after the batch began."""
    if broker_max_bytes is not None and broker_max_bytes < max_bytes:
        return (f"the brokers' offset.metadata.max.bytes is {broker_max_bytes}, below the "
                f"job's offset_metadata_max_bytes = {max_bytes}: commits the job would make "
                f"are refused by the brokers; set offset_metadata_max_bytes = "
                f"{broker_max_bytes} in [job] or offset.metadata.max.bytes >= {max_bytes} "
                "on every broker")
    ids = set(table_ids)
    need = worst_case_length(ids, span)
    if need <= longest_metadata(max_bytes):
        return None
    value = need + CLIENT_TERMINATOR_BYTES
    return (f"metadata for {len(ids)} tables in batch ranges of {span} offsets "
            f"per partition needs up to {need} bytes, over the {longest_metadata(max_bytes)} "
            f"that offset.metadata.max.bytes = {max_bytes} allows: set "
            f"offset.metadata.max.bytes >= {value} on every broker and "
            f"offset_metadata_max_bytes = {value} in [job], or lower "
            "[job] max_offsets_per_trigger")
