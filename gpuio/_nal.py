"""H.264 / HEVC NAL units: a packet's units, and what a decoder learns from the units
that are not pictures.

A decoder started at a keyframe inside a stream must know what a decoder that read the
stream from its start knows there: the parameter sets in force, and the encoder's
notes. FFmpeg's H.264 decoder, for one, corrects for bugs of x264 builds before 151
(4:4:4 lossless intra prediction among them) only after it has read x264's version note,
a user-data-unregistered SEI message that x264 writes in the stream's first packet
only. ``StreamState`` keeps that knowledge as NAL units to give a new decoder in front
of its first packet: the latest parameter set of each kind and id, and the latest
user-data-unregistered message of each UUID (as a one-message SEI unit). Units equal to
those of the container header (which the decoder is given anyway) are left out.

``formats.video`` keeps the state at each clip's first packet in the index;
``ops.video`` updates it over the clip's own packets for each part it decodes apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["CODECS", "IDR", "StreamState", "length_size", "header_units", "nal_type", "units"]

CODECS = ("h264", "hevc")
IDR = {"h264": frozenset({5}), "hevc": frozenset({19, 20})}
# parameter sets in the order a decoder needs them (VPS before SPS before PPS)
_PARAMETER_SETS = {"h264": (7, 8), "hevc": (32, 33, 34)}
_SEI = {"h264": (6,), "hevc": (39, 40)}  # HEVC: prefix and suffix SEI
_SEI_HEADER = {"h264": b"\x06", "hevc": bytes([39 << 1, 1])}  # a prefix SEI unit, layer 0, temporal id 0
_USER_DATA_UNREGISTERED = 5
_START = b"\0\0\1"


def nal_type(codec: str, unit: Any, at: int = 0) -> int:
    """The NAL unit type of the unit whose header starts at ``unit[at]``."""
    return unit[at] & 31 if codec == "h264" else (unit[at] >> 1) & 63


def length_size(codec: str, extradata: bytes) -> int:
    """Bytes of each NAL unit's length field, from an avcC / hvcC header; 0 when the
    stream is Annex B (start codes; no such header)."""
    if codec == "h264" and len(extradata) >= 7 and extradata[0] == 1:
        return (extradata[4] & 3) + 1
    if codec == "hevc" and len(extradata) >= 23 and extradata[0] == 1:
        return (extradata[21] & 3) + 1
    return 0


def units(buf: Any, start: int, end: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, length) of each NAL unit of the packet ``buf[start:end]``: after a
    ``size``-byte big-endian length (avcC/hvcC; the last may run past ``end``), or,
    with ``size`` 0, after a start code (Annex B; ``buf`` is ``bytes``)."""
    if size:
        at = start
        while at + size <= end:
            n = int.from_bytes(buf[at:at + size], "big")
            yield at + size, n
            at += size + n
        return
    at = buf.find(_START, start, end)
    while at >= 0:
        first = at + 3
        nxt = buf.find(_START, first, end)
        stop = end if nxt < 0 else nxt
        while stop > first and buf[stop - 1] == 0:  # trailing zeros: the next start code's leading byte
            stop -= 1
        yield first, stop - first
        at = nxt


def header_units(codec: str, extradata: bytes) -> list[bytes]:
    """The NAL units of an avcC / hvcC header (parameter sets, and SEI in hvcC), or of an
    Annex B header; [] for none."""
    x = extradata
    if length_size(codec, x) == 0:
        return [x[a:a + n] for a, n in units(x, 0, len(x), 0)] if x.find(_START) >= 0 else []
    found, at = [], 0

    def take(count: int) -> None:
        nonlocal at
        for _ in range(count):
            n = int.from_bytes(x[at:at + 2], "big")
            if at + 2 + n > len(x):
                raise ValueError(f"a NAL unit of {n} bytes at byte {at} runs past the header's {len(x)} bytes")
            found.append(x[at + 2:at + 2 + n])
            at += 2 + n

    if codec == "h264":
        at = 6
        take(x[5] & 31)  # sequence parameter sets
        if at < len(x):
            at += 1
            take(x[at - 1])  # picture parameter sets
        return found
    at = 23
    for _ in range(x[22]):  # arrays of VPS, SPS, PPS, SEI
        if at + 3 > len(x):
            raise ValueError(f"an array header at byte {at} runs past the header's {len(x)} bytes")
        at += 3
        take(int.from_bytes(x[at - 2:at], "big"))
    return found


def _rbsp(unit: bytes) -> bytes:
    """The payload with emulation prevention bytes removed (each 00 00 03 -> 00 00)."""
    return unit.replace(b"\0\0\3", b"\0\0")


def _escaped(rbsp: bytes) -> bytes:
    """Emulation prevention: a 03 after two zero bytes that precede a byte of 0-3."""
    out, zeros = bytearray(), 0
    for b in rbsp:
        if zeros >= 2 and b <= 3:
            out.append(3)
            zeros = 0
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


class _Bits:
    """Big-endian bit reader: fixed-width fields and Exp-Golomb codes."""

    def __init__(self, data: bytes) -> None:
        self.value, self.bits, self.at = int.from_bytes(data, "big"), 8 * len(data), 0

    def u(self, width: int) -> int:
        if self.at + width > self.bits:
            raise ValueError("parameter set cut short")
        self.at += width
        return (self.value >> (self.bits - self.at)) & ((1 << width) - 1)

    def ue(self) -> int:
        zeros = 0
        while not self.u(1):
            zeros += 1
            if zeros > 31:
                raise ValueError("bad Exp-Golomb code")
        return (1 << zeros) - 1 + self.u(zeros)


def _parameter_set_id(codec: str, kind: int, rbsp: bytes) -> int:
    """The id of a parameter set (its first 64 payload bytes hold it)."""
    if codec == "h264":
        bits = _Bits(rbsp[1:65])
        if kind == 7:
            bits.u(24)  # profile, constraint flags, level
        return bits.ue()
    bits = _Bits(rbsp[2:66])
    if kind == 32:
        return bits.u(4)
    if kind == 34:
        return bits.ue()
    bits.u(4)  # the VPS id
    sub_layers = bits.u(3)
    bits.u(1 + 96)  # temporal id nesting; the general profile, tier and level
    present = [(bits.u(1), bits.u(1)) for _ in range(sub_layers)]
    if sub_layers:
        bits.u(2 * (8 - sub_layers))
    for profile, level in present:
        bits.u(88 * profile + 8 * level)
    return bits.ue()


def _unregistered_messages(codec: str, rbsp: bytes) -> Iterator[bytes]:
    """The payloads of the user-data-unregistered messages of an SEI unit's payload."""
    body = rbsp.rstrip(b"\0")
    at, end = (1 if codec == "h264" else 2), len(body) - 1  # the last byte holds the stop bit
    while at < end:
        kind = size = 0
        while at < end and body[at] == 0xFF:
            kind, at = kind + 255, at + 1
        kind, at = kind + (body[at] if at < end else 0), at + 1
        while at < end and body[at] == 0xFF:
            size, at = size + 255, at + 1
        size, at = size + (body[at] if at < end else 0), at + 1
        if at + size > end:
            return
        if kind == _USER_DATA_UNREGISTERED and size >= 16:
            yield body[at:at + size]
        at += size


def _sei_unit(codec: str, payload: bytes) -> bytes:
    """One SEI unit holding one user-data-unregistered message."""
    head = bytes([_USER_DATA_UNREGISTERED]) + b"\xff" * (len(payload) // 255) + bytes([len(payload) % 255])
    return _SEI_HEADER[codec] + _escaped(head + payload + b"\x80")


class StreamState:
    """What a decoder has learnt from a stream's non-picture units so far (see the module
    docstring). ``add`` each unit in stream order; ``units()`` gives them back to put in
    front of a new decoder's first packet, parameter sets first."""

    def __init__(self, codec: str, header: Iterable[bytes] = ()) -> None:
        self.codec = codec
        self._known: dict[tuple[int, Any], bytes] = {}  # (rank, id or UUID) -> unit
        self._header: dict[tuple[int, Any], bytes] = {}
        for unit in header:
            self._learn(self._header, unit)
        self._units: tuple[bytes, ...] | None = ()

    def add(self, unit: bytes) -> None:
        """Take one NAL unit of the stream (pictures and other units are passed over)."""
        if unit and nal_type(self.codec, unit) in _PARAMETER_SETS[self.codec] + _SEI[self.codec] \
                and self._learn(self._known, bytes(unit)):
            self._units = None

    def _learn(self, into: dict[tuple[int, Any], bytes], unit: bytes) -> bool:
        """Record ``unit`` in ``into``; whether that changed it. A unit whose id cannot be
        read is passed over, as a decoder rejects it."""
        kind = nal_type(self.codec, unit)
        rbsp = _rbsp(unit)
        if kind in _SEI[self.codec]:
            found = [((len(_PARAMETER_SETS[self.codec]), m[:16]), _sei_unit(self.codec, m))
                     for m in _unregistered_messages(self.codec, rbsp)]
        else:
            try:
                found = [((_PARAMETER_SETS[self.codec].index(kind), _parameter_set_id(self.codec, kind, rbsp)), unit)]
            except ValueError:
                return False
        changed = False
        for key, value in found:
            if into.get(key) != value:
                into.pop(key, None)  # the latest update comes last among its kind
                into[key] = value
                changed = True
        return changed

    def units(self) -> tuple[bytes, ...]:
        """The units a new decoder needs in front of its first packet (those that differ
        from the container header's), parameter sets first, each kind in stream order."""
        if self._units is None:
            order = sorted(self._known, key=lambda key: key[0])  # stable: stream order within a kind
            self._units = tuple(self._known[k] for k in order if self._header.get(k) != self._known[k])
        return self._units
