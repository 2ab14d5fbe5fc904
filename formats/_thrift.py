"""A reader of Thrift's compact protocol, as Parquet writes its footer and page headers.

A struct reads as ``{field id: value}``: integers as ``int`` (zigzag varints), booleans
as ``bool``, doubles as ``float``, binary and strings as ``bytes``, lists and sets as
``list``, maps as ``dict``, nested structs as dicts. Field names are the caller's
business (Parquet's ids are in ``formats/parquet.py``).

Malformed bytes raise ``ThriftError(reason, offset)``, the offset into the buffer read;
the caller turns it into a ``FormatError`` naming its file. No input makes it raise
anything else, take more memory than the buffer's size, or recurse without bound.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["ThriftError", "read_struct"]

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_MAX_DEPTH = 64  # nested structs and containers; Parquet's deepest is under 10


class ThriftError(Exception):
    """Malformed compact-protocol bytes: ``args == (reason, offset)``."""


class _Reader:
    def __init__(self, buf: bytes | bytearray | memoryview, pos: int) -> None:
        self.buf = memoryview(buf).cast("B") if not isinstance(buf, bytes) else buf
        self.pos = pos
        self.end = len(buf)

    def byte(self) -> int:
        if self.pos >= self.end:
            raise ThriftError("the struct runs past the end of the bytes", self.pos)
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        start, value, shift = self.pos, 0, 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ThriftError("a varint longer than 10 bytes", start)

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.end:
            raise ThriftError(f"a value of {n} bytes runs past the end of the bytes ({self.end - self.pos} left)",
                              self.pos)
        out = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        return out

    def value(self, kind: int, depth: int) -> Any:
        if kind in (_TRUE, _FALSE):  # a struct field's boolean is in its type
            return kind == _TRUE
        if kind == _BYTE:
            b = self.byte()
            return b - 256 if b > 127 else b
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if kind == _BINARY:
            return self.take(self.varint())
        if depth >= _MAX_DEPTH:
            raise ThriftError(f"structs nested deeper than {_MAX_DEPTH}", self.pos)
        if kind in (_LIST, _SET):
            return self.sequence(depth + 1)
        if kind == _MAP:
            return self.mapping(depth + 1)
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise ThriftError(f"unknown compact type {kind}", self.pos - 1)

    def sequence(self, depth: int) -> list[Any]:
        at = self.pos
        head = self.byte()
        size, kind = head >> 4, head & 0x0F
        if size == 15:
            size = self.varint()
        if size > self.end - self.pos:  # every element takes at least one byte
            raise ThriftError(f"a list of {size} elements in {self.end - self.pos} bytes", at)
        if kind in (_TRUE, _FALSE):  # a list's booleans take a byte each
            return [self.byte() == _TRUE for _ in range(size)]
        return [self.value(kind, depth) for _ in range(size)]

    def mapping(self, depth: int) -> dict[Any, Any]:
        at = self.pos
        size = self.varint()
        if not size:
            return {}
        if 2 * size > self.end - self.pos:
            raise ThriftError(f"a map of {size} entries in {self.end - self.pos} bytes", at)
        kinds = self.byte()
        out = {}
        for _ in range(size):
            key = self.value(kinds >> 4, depth)
            if isinstance(key, (list, dict)):
                raise ThriftError("a map key that is a container", at)
            out[key] = self.value(kinds & 0x0F, depth)
        return out

    def struct(self, depth: int) -> dict[int, Any]:
        out: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return out
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            out[last] = self.value(kind, depth)


def read_struct(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[dict[int, Any], int]:
    """The struct that starts at byte ``pos`` of ``buf``, and the byte after it."""
    r = _Reader(buf, pos)
    out = r.struct(0)
    return out, r.pos
