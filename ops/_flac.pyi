"""A FLAC decoder for ``gpuio.ops.audio.decode_audio`` (``ops/_flac.c``, after RFC 9639).

Optional: built at install where a C compiler exists; else libsndfile (through
soundfile) decodes FLAC. Python parses the metadata blocks (STREAMINFO) and hands over
where the first frame starts; this module decodes the frames, checking each header's
CRC-8 and footer's CRC-16, and converts samples as libsndfile does (bit for bit).
"""
from _typeshed import ReadableBuffer, WriteableBuffer

#: one file: (data, first frame's byte offset, first sample, samples, channels, bits per sample, out)
Job = tuple[ReadableBuffer, int, int, int, int, int, WriteableBuffer]

def decode(jobs: list[Job], dtype: int, downmix: bool, /) -> list[tuple[int, int, int, str]]:
    """Decode every FLAC file of a batch in one call, the GIL released for all of them.

    Per job: ``data`` is the whole file (C-contiguous bytes); decoding starts at byte
    offset ``start`` (the first frame) and writes samples ``[first, first + count)`` into
    ``out``, C-contiguous ``[count, width]`` of ``dtype`` 0 float32, 1 float64, 2 int16 or
    3 int32 (``width`` = ``channels``, or 1 with ``downmix``: the mean of the channels);
    ``channels`` 1-8, ``bits`` 4-32 as STREAMINFO gives them.

    Returns per job ``(status, samples, byte, error)``: status 0 decoded, 1 corrupt (the
    data is bad: ``byte`` is the offset of the frame where it stopped, ``error`` says why),
    2 unsupported (a frame whose channels or bits differ from STREAMINFO, a 32-bit
    stream's side channel: decode the file another way); ``samples`` is how many were
    written.

    Raises TypeError when ``jobs`` is not a list of such tuples; ValueError when
    ``dtype`` is not 0-3 or a job's channels, bits, range or output size is wrong (the
    message names the job); MemoryError.
    """
