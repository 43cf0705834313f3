"""Helpers to fuzz the decoders of outside bytes: mutations of valid inputs, and a run
under an address-space limit so an allocation sized by a crafted count fails the test
(``MemoryError`` in a forked child) instead of exhausting the machine."""

from __future__ import annotations

import os
import resource
import traceback
from collections.abc import Callable

from hypothesis import strategies as st

HEADROOM = 384 << 20
"""Address space a decoder may add to what the test process already maps."""


def _mapped_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def run_memory_bounded(body: Callable[[], None], headroom: int = HEADROOM) -> None:
    """Run ``body`` in a forked child whose address space is capped at what is mapped
    now plus ``headroom``; re-raise its failure (with the child's traceback) here."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        code, report = 0, b""
        try:
            limit = _mapped_bytes() + headroom
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(
                resource.RLIMIT_AS)[1]))
            body()
        except BaseException:
            code, report = 1, traceback.format_exc().encode()[-20_000:]
        os.write(write, report)
        os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, f"child failed ({code}):\n{b''.join(chunks).decode(errors='replace')}"


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid input with a few random edits: bytes flipped, set to extremes, inserted,
    deleted, or the input truncated (what a bad producer or a bit flip would do)."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(("flip", "extreme", "insert", "delete", "truncate")))
        if op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=9))
        elif pos < len(data):
            if op == "flip":
                data[pos] ^= 1 << draw(st.integers(0, 7))
            elif op == "extreme":
                data[pos] = draw(st.sampled_from((0x00, 0x7F, 0x80, 0xFF)))
            else:
                del data[pos]
    return bytes(data)
