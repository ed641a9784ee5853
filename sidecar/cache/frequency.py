"""How often each adapter was asked for, lately: a count-min sketch of fixed size that outlives
evictions, halved every so many requests (aging), and kept on disk across restarts.

Memory is the sketch's alone, whatever the number of ids: DEPTH x WIDTH counters of one byte
(512 KiB), so a registry of 100,000 ids or of ten million costs the same. A count is
over-estimated only where an id shares all DEPTH counters with others: with 100,000 ids each
seen once, fewer than one in ten reads more than 1.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import zlib
from array import array
from pathlib import Path

from ..core.fsutil import replace_file
from ..core.logs import fields

log = logging.getLogger(__name__)

FREQUENCY_FILE_NAME = ".frequency"
DEPTH = 4  # `add` reads the rows' four counters by name
WIDTH = 1 << 17
# Counts stop at 31: with halvings AGING (40) x adapters on disk apart, the adapters at the
# edge of the room reach counts of 10-20, which a cap of 15 would flatten; a very popular
# adapter still loses its lead within five halvings once asked for no more (measured in
# benchmarks/policy.py).
COUNTER_MAX = 31
_MAGIC = b"LSFREQ1\n"
_HEADER = struct.Struct("<8sIIQQ")  # magic, depth, width, requests since halving, period
_CRC = struct.Struct("<I")
# Halving works block by block, and only on blocks holding a non-zero counter: with few
# adapters on disk the period is short (AGING x adapters on disk), and halving the whole
# sketch every few requests was the largest cost of a /stage hit (benchmarks/README.md, "hit
# path"). A block is halved by one shift of one integer and a mask.
BLOCK = 4096
_BLOCKS = DEPTH * WIDTH // BLOCK
_HALF_MASK = int.from_bytes(b"\x7f" * BLOCK, "little")


@functools.lru_cache(maxsize=8192)
def _slots(adapter_id: str) -> tuple[int, ...]:
    """The counter of each row for an id: stable across processes (no salted hash())."""
    digest = hashlib.blake2b(adapter_id.encode(), digest_size=4 * DEPTH).digest()
    return tuple(row * WIDTH + (int.from_bytes(digest[4 * row:4 * row + 4], "little") % WIDTH)
                 for row in range(DEPTH))


class FrequencySketch:
    """Request counts by adapter id, approximate from above, bounded in memory.

    Every `period` requests each counter is halved: what was popular an hour ago fades, so a
    shift in popularity is followed within a few periods (never-aged counts would keep a
    formerly hot adapter forever).
    """

    def __init__(self, period: int = 0) -> None:
        self._counters = array("B", bytes(DEPTH * WIDTH))
        self._busy: set[int] = set()  # blocks that may hold a non-zero counter (<= _BLOCKS)
        self.period = period  # requests between halvings; 0: set by the policy
        self.since_halving = 0
        self.halvings = 0  # how many times the counts were halved, for tests and the policy

    @property
    def size_bytes(self) -> int:
        return self._counters.itemsize * len(self._counters)

    def estimate(self, adapter_id: str) -> int:
        counters = self._counters
        return min(map(counters.__getitem__, _slots(adapter_id)))

    def add(self, adapter_id: str) -> int:
        """Count one request (conservative update: only the smallest counters grow, which keeps
        over-estimates small); returns the new estimate. May halve every count first."""
        self.since_halving += 1
        if self.period and self.since_halving > self.period:
            self.halve()
            self.since_halving = 1
        counters = self._counters
        slots = _slots(adapter_id)
        a, b, c, d = slots  # the DEPTH rows' counters, read without a call each (hit path)
        new = min(counters[a], counters[b], counters[c], counters[d]) + 1
        if new > COUNTER_MAX:
            return COUNTER_MAX
        busy = self._busy
        for slot in slots:
            if counters[slot] < new:
                counters[slot] = new
                busy.add(slot // BLOCK)
        return new

    def halve(self) -> None:
        """Every counter halved, in place; blocks left all zero are no longer visited."""
        view = memoryview(self._counters)
        for block in list(self._busy):
            start = block * BLOCK
            packed = int.from_bytes(view[start:start + BLOCK], "little")
            halved = (packed >> 1) & _HALF_MASK
            view[start:start + BLOCK] = halved.to_bytes(BLOCK, "little")
            if not halved:
                self._busy.discard(block)
        self.halvings += 1

    # ---- on disk: <cache-root>/.frequency, replaced whole ------------------------------------

    def to_bytes(self) -> bytes:
        body = _HEADER.pack(_MAGIC, DEPTH, WIDTH, self.since_halving, self.period)
        body += self._counters.tobytes()
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes) -> FrequencySketch:
        """ValueError when the data is not a whole sketch of this shape."""
        if len(data) != _HEADER.size + DEPTH * WIDTH + _CRC.size:
            raise ValueError(f"{len(data)} bytes, not a sketch of {DEPTH}x{WIDTH}")
        body, (crc,) = data[:-_CRC.size], _CRC.unpack(data[-_CRC.size:])
        if zlib.crc32(body) != crc:
            raise ValueError("checksum mismatch")
        magic, depth, width, since, period = _HEADER.unpack(body[:_HEADER.size])
        if magic != _MAGIC or (depth, width) != (DEPTH, WIDTH):
            raise ValueError("not a frequency sketch of this version")
        sketch = cls(period)
        sketch._counters = array("B")
        sketch._counters.frombytes(body[_HEADER.size:])
        view, zero = memoryview(sketch._counters), bytes(BLOCK)
        sketch._busy = {block for block in range(_BLOCKS)
                        if view[block * BLOCK:(block + 1) * BLOCK] != zero}
        sketch.since_halving = since
        return sketch


def save_sketch(root: Path, data: bytes) -> None:
    """Write the sketch's bytes whole, or leave the previous file (blocking: run in a thread)."""
    replace_file(root / FREQUENCY_FILE_NAME, data)


def load_sketch(root: Path) -> FrequencySketch | None:
    """The sketch saved under `root`, or None when there is none or it cannot be used (said in
    the log: the counts start again from zero, nothing else is affected)."""
    path = root / FREQUENCY_FILE_NAME
    (root / f"{FREQUENCY_FILE_NAME}.new").unlink(missing_ok=True)  # a save cut short
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = exc.strerror or str(exc)
    else:
        try:
            return FrequencySketch.from_bytes(data)
        except ValueError as exc:
            problem = str(exc)
    log.warning("cannot read the request counts in %s (%s): eviction starts without them",
                path, problem, extra=fields(event="frequency_unreadable", reason=problem))
    return None
