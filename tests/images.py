"""Small PNG images for the multimodal tests, written without an imaging library.

An image's pixels come from a seed, so two seeds give two images; `level` changes only
the compression, so the same pixels can be had as other bytes (llama-server keys an
image by a hash of the bytes it was sent, tools/mtmd/mtmd-helper.cpp).
"""

from __future__ import annotations

import base64
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png(seed: int, width: int = 40, height: int = 30, level: int = 6) -> bytes:
    """An 8-bit RGB PNG of smooth stripes that depend on ``seed``."""
    rows = bytearray()
    for y in range(height):
        rows.append(0)  # filter: none
        for x in range(width):
            rows += bytes(((x * (seed + 3) + y) % 256, (y * (seed + 5)) % 256,
                           (seed * 37 + x * y) % 256))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(bytes(rows), level)) + _chunk(b"IEND", b""))


def data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()
