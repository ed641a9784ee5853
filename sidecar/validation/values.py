"""NaN and infinity in an adapter's tensors, found in the bytes as they are read: by the
download's worker threads, part by part in any order, or in one pass over a file on disk.

vLLM serves an adapter holding one NaN weight with empty text, and the next answer of another
tenant's adapter comes out corrupted, so the gate refuses them (F16, BF16 and F32; numpy has
no bfloat16, so every format is checked on its exponent bits: all ones is NaN or infinity).

A scan learns the tensors' layout from the header as its bytes arrive. Chunks that land
before the header is known are remembered as ranges and checked from the file at the end, as
are the few elements cut in two by a boundary between chunks that were not read in sequence
(part starts, resumed parts): memory stays bounded by the count of those boundaries.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .safetensors_check import HEADER_MAX_BYTES, TensorInfo, parse_header

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024  # reads of a file on disk, into one reused buffer
# How long a part that arrives first waits for the header (carried by the first part, which
# starts first) before it leaves its bytes to be checked from the file at the end.
HEADER_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class _Format:
    size: int  # bytes per element
    word: np.dtype[Any]  # unsigned integer of that size, little-endian
    magnitude: Any  # every bit but the sign, as a numpy scalar of `word`
    exponent: Any  # the exponent bits: a magnitude at least this is NaN or infinity


_FORMATS = {
    "F16": _Format(2, np.dtype("<u2"), np.uint16(0x7FFF), np.uint16(0x7C00)),
    "BF16": _Format(2, np.dtype("<u2"), np.uint16(0x7FFF), np.uint16(0x7F80)),
    "F32": _Format(4, np.dtype("<u4"), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)),
}


@dataclass(frozen=True, slots=True)
class NonFinite:
    """One tensor's NaN and infinite values."""

    tensor: str
    shape: tuple[int, ...]
    count: int
    first_index: int  # of the first one, counted over the flattened tensor
    first_is_nan: bool  # else an infinity

    def describe(self) -> str:
        where = np.unravel_index(self.first_index, self.shape) if self.shape else ()
        kind = "NaN" if self.first_is_nan else "an infinity"
        return (f"{self.count} non-finite value{'s' if self.count != 1 else ''} (NaN or "
                f"infinity); the first is {kind} at index {list(map(int, where))} of shape "
                f"{list(self.shape)}")


@dataclass(frozen=True, slots=True)
class ValueReport:
    complete: bool  # every value of every float tensor was checked (false: unreadable header)
    nonfinite: tuple[NonFinite, ...]  # in the header's order


@dataclass(frozen=True, slots=True)
class _Span:
    """A float tensor's bytes, as offsets into the file."""

    begin: int
    end: int
    form: _Format
    tensor: int  # index into Layout.tensors


class Layout:
    """Where each float tensor lies in the file."""

    def __init__(self, tensors: Sequence[TensorInfo], data_start: int) -> None:
        self.tensors = tuple(tensors)
        spans = sorted(
            (_Span(data_start + t.begin, data_start + t.end, _FORMATS[t.dtype], i)
             for i, t in enumerate(self.tensors) if t.dtype in _FORMATS and t.end > t.begin),
            key=lambda s: s.begin,
        )
        self.spans = spans
        self._begins = [s.begin for s in spans]

    def overlapping(self, start: int, end: int) -> list[_Span]:
        first = max(0, bisect.bisect_right(self._begins, start) - 1)
        found = []
        for span in self.spans[first:]:
            if span.begin >= end:
                break
            if span.end > start:
                found.append(span)
        return found

    def element_at(self, offset: int) -> tuple[_Span, int] | None:
        """The span holding byte `offset`, and the offset where that byte's element begins."""
        index = bisect.bisect_right(self._begins, offset) - 1
        if index < 0 or offset >= self.spans[index].end:
            return None
        span = self.spans[index]
        return span, offset - (offset - span.begin) % span.form.size


_UNUSABLE = Layout((), 0)  # a header that cannot be read: validation refuses the file anyway


class ValueScan:
    """The value check of one safetensors file of `size_bytes`, fed by several threads."""

    def __init__(self, size_bytes: int, layout: Layout | None = None) -> None:
        self.size_bytes = size_bytes
        self._lock = threading.Lock()
        self._layout = layout
        self._known = threading.Event()
        if layout is not None:
            self._known.set()
        self._gave_up = False  # a wait for the header timed out: later chunks do not wait
        self._header = bytearray()  # the file's first bytes, gathered until the header parses
        self._deferred: list[tuple[int, int]] = []  # ranges that landed before the layout
        self._edges: set[int] = set()  # elements cut by a boundary no stream read across
        self._found: dict[int, list[int]] = {}  # tensor -> [count, first index, NaN: 1]

    def stream(self, offset: int) -> Callable[[int, memoryview], None]:
        """The feed of one sequential read starting at `offset`: call it with each chunk, in
        order, from one thread at a time. It may overwrite the chunk (its scratch space)."""
        return _Stream(self, offset).feed

    # ---- the header -------------------------------------------------------------------

    def _gather_header(self, offset: int, chunk: memoryview) -> bool:
        """Keep the part of `chunk` that extends the header gathered so far (the file's first
        bytes, whichever read brings them); True if the chunk carried some of it."""
        with self._lock:
            have = len(self._header)
            if self._layout is not None or not offset <= have < offset + len(chunk):
                return False
            position = have - offset
            while True:
                wanted = self._header_wanted()
                if wanted is None:
                    self._set_layout(_UNUSABLE)
                    return True
                take = chunk[position: position + wanted - len(self._header)]
                self._header += take
                position += len(take)
                if len(self._header) < wanted:
                    return True  # the rest comes with a later chunk
                if wanted > 8:
                    self._set_layout(_read_layout(bytes(self._header[8:]), self.size_bytes))
                    return True

    def _header_wanted(self) -> int | None:
        """How many of the file's first bytes the header takes: 8 until its length is known;
        None for a length no valid file has."""
        if len(self._header) < 8:
            return 8
        (length,) = struct.unpack_from("<Q", self._header)
        if length > HEADER_MAX_BYTES or 8 + length > self.size_bytes:
            return None
        return 8 + int(length)

    def _set_layout(self, layout: Layout) -> None:
        self._layout = layout
        self._header = bytearray()
        self._known.set()

    def _layout_for(self, carried_header: bool) -> Layout | None:
        """The layout, waiting a little for it unless this chunk carried the header (the read
        that brings the header never waits) or a wait timed out already."""
        if self._layout is None and not carried_header and not self._gave_up:
            if not self._known.wait(HEADER_WAIT_S):
                self._gave_up = True
        return self._layout

    # ---- findings -----------------------------------------------------------------------

    def _defer(self, offset: int, length: int) -> None:
        with self._lock:
            self._deferred.append((offset, length))

    def _edge(self, element: int) -> None:
        with self._lock:
            self._edges.add(element)

    def _check_run(self, span: _Span, start: int, data: memoryview) -> None:
        """Check whole elements: `data` holds the span's bytes from `start` (an element
        boundary), a whole number of elements. Overwrites `data`."""
        form = span.form
        words = np.frombuffer(data, dtype=form.word)
        np.bitwise_and(words, form.magnitude, out=words)
        if words.max() < form.exponent:
            return
        bad = np.flatnonzero(words >= form.exponent)
        first = int(bad[0])
        index = (start - span.begin) // form.size + first
        is_nan = int(words[first] > form.exponent)
        with self._lock:
            found = self._found.get(span.tensor)
            if found is None:
                self._found[span.tensor] = [len(bad), index, is_nan]
            else:
                found[0] += len(bad)
                if index < found[1]:
                    found[1:] = [index, is_nan]

    # ---- the end ------------------------------------------------------------------------

    def finish(self, fd: int) -> ValueReport:
        """Check what could not be checked in flight, reading it from `fd` (the whole file,
        written), and report. Blocking: run it in a thread."""
        with self._lock:
            deferred, self._deferred = sorted(self._deferred), []
        if self._layout is None:
            self._set_layout(_read_header(fd, self.size_bytes))
        layout = self._layout
        assert layout is not None
        buffer = bytearray(min(CHUNK_BYTES, max(self.size_bytes, 1)))
        for start, end in _merged(deferred):
            feed = self.stream(start)
            offset = start
            while offset < end:
                length = min(len(buffer), end - offset)
                view = memoryview(buffer)[:length]
                _pread_exactly(fd, view, offset)
                feed(offset, view)
                offset += length
        with self._lock:
            edges, self._edges = sorted(self._edges), set()
        log.debug("value scan: %d bytes in %d ranges and %d cut elements read back",
                  sum(length for _, length in deferred), len(deferred), len(edges))
        for element in edges:
            found = layout.element_at(element)
            if found is not None:
                span, begin = found
                data = bytearray(span.form.size)
                _pread_exactly(fd, memoryview(data), begin)
                self._check_run(span, begin, memoryview(data))
        return self.report()

    def report(self) -> ValueReport:
        layout = self._layout
        if layout is None or layout is _UNUSABLE:
            return ValueReport(False, ())
        return ValueReport(True, tuple(
            NonFinite(layout.tensors[i].name, layout.tensors[i].shape, count, first,
                      bool(is_nan))
            for i, (count, first, is_nan) in sorted(self._found.items())
        ))


class _Stream:
    """One sequential read: carries an element cut by the boundary between its chunks."""

    def __init__(self, scan: ValueScan, offset: int) -> None:
        self._scan = scan
        self._next = offset
        self._carry = b""  # the first bytes of the element that begins at _carry_at
        self._carry_at = -1

    def feed(self, offset: int, chunk: memoryview) -> None:
        scan = self._scan
        carried_header = scan._gather_header(offset, chunk)
        layout = scan._layout_for(carried_header)
        carry, carry_at = self._carry, self._carry_at
        if offset != self._next:
            carry = b""
        self._next = offset + len(chunk)
        self._carry = b""
        if layout is None:
            scan._defer(offset, len(chunk))
            return
        end = offset + len(chunk)
        for span in layout.overlapping(offset, end):
            start, stop = max(offset, span.begin), min(end, span.end)
            size = span.form.size
            cut = (start - span.begin) % size
            if cut:  # the element at `start` began before this chunk
                element = start - cut
                if carry and carry_at == element:
                    rest = chunk[start - offset: min(stop, element + size) - offset]
                    if len(carry) + len(rest) < size:  # this chunk ends inside it too
                        self._carry, self._carry_at = carry + rest, element
                        return
                    scan._check_run(span, element, memoryview(bytearray(carry + rest)))
                else:
                    scan._edge(element)
                start = min(stop, element + size)
            whole_end = start + (stop - start) // size * size
            if whole_end > start:
                scan._check_run(span, start, chunk[start - offset: whole_end - offset])
            if whole_end < stop:  # an element cut by the end of this chunk
                self._carry = bytes(chunk[whole_end - offset: stop - offset])
                self._carry_at = whole_end


def scan_file(fd: int, size_bytes: int, layout: Layout | None = None,
              digest: hashlib._Hash | None = None) -> ValueReport:
    """One pass over a whole file on disk (blocking): its values, and a SHA-256 of every byte
    into `digest` when given, so a file that must be hashed is read only once."""
    scan = ValueScan(size_bytes, layout)
    feed = scan.stream(0)
    buffer = bytearray(min(CHUNK_BYTES, max(size_bytes, 1)))
    offset = 0
    while offset < size_bytes:
        chunk = memoryview(buffer)[:min(len(buffer), size_bytes - offset)]
        _pread_exactly(fd, chunk, offset)
        if digest is not None:
            digest.update(chunk)  # before the feed, which may overwrite the chunk
        feed(offset, chunk)
        offset += len(chunk)
    return scan.finish(fd)


def finish_scan(scan: ValueScan, path: Path) -> ValueReport:
    """`scan.finish` on the downloaded file at `path` (blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return scan.finish(fd)
    finally:
        os.close(fd)


def _read_layout(raw: bytes, size_bytes: int) -> Layout:
    tensors, faults = parse_header(raw, size_bytes)
    if tensors is None or faults:
        return _UNUSABLE
    return Layout(tensors, 8 + len(raw))


def _read_header(fd: int, size_bytes: int) -> Layout:
    """The layout from the header on disk (when no chunk in flight brought all of it)."""
    if size_bytes < 8:
        return _UNUSABLE
    first = bytearray(8)
    _pread_exactly(fd, memoryview(first), 0)
    (length,) = struct.unpack("<Q", first)
    if length > HEADER_MAX_BYTES or 8 + length > size_bytes:
        return _UNUSABLE
    raw = bytearray(length)
    _pread_exactly(fd, memoryview(raw), 8)
    return _read_layout(bytes(raw), size_bytes)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges, sorted, as (start, end) with touching ones joined: an element
    cut between two of them is carried across rather than left as an edge."""
    merged: list[tuple[int, int]] = []
    for offset, length in ranges:
        if merged and merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], offset + length)
        else:
            merged.append((offset, offset + length))
    return merged


def _pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(f"the file ended at byte {offset}, before its recorded size "
                          "(changed while read?)")
        view, offset = view[got:], offset + got
