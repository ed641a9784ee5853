"""CRC-32 of a whole file from the CRC-32s of its parts, so parallel ranged parts can be
checksummed as they stream, and compared with the full-object checksum S3 keeps.
"""

from __future__ import annotations

import base64
import functools

_POLY = 0xEDB88320  # CRC-32 (IEEE 802.3, reflected), as zlib.crc32 and S3's ChecksumCRC32


def _times(matrix: tuple[int, ...], vector: int) -> int:
    """A 32x32 matrix over GF(2) (one column per bit) times a 32-bit vector."""
    result = 0
    column = 0
    while vector:
        if vector & 1:
            result ^= matrix[column]
        vector >>= 1
        column += 1
    return result


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, matrix[n]) for n in range(32))


@functools.cache
def _zeros_operator(log2_bytes: int) -> tuple[int, ...]:
    """The matrix that advances a CRC over 2**log2_bytes zero bytes."""
    if log2_bytes == 0:
        one_bit = (_POLY, *(1 << n for n in range(31)))
        two_bits = _square(one_bit)
        four_bits = _square(two_bits)
        return _square(four_bits)
    return _square(_zeros_operator(log2_bytes - 1))


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC-32 of A followed by B, from CRC-32(A), CRC-32(B) and the length of B."""
    bit = 0
    while length_b:
        if length_b & 1:
            crc_a = _times(_zeros_operator(bit), crc_a)
        length_b >>= 1
        bit += 1
    return crc_a ^ crc_b


def crc32_hex(crc: int) -> str:
    return f"{crc:08x}"


def s3_checksum_hex(value: object, checksum_type: object) -> str | None:
    """An S3 `Checksum*` header (base64) as hex; None for a composite checksum of a multipart
    upload (a checksum of part checksums, not comparable with one of the bytes)."""
    if not isinstance(value, str) or not value or "-" in value or checksum_type == "COMPOSITE":
        return None
    try:
        return base64.b64decode(value, validate=True).hex()
    except ValueError:
        return None
