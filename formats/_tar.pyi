"""The header walk of WebDataset tar shards (``formats/_tar.c``).

Caller: ``gpuio.formats.webdataset`` only. It indexes a tar only where it can index it
exactly as the module's full parser does; for anything else it returns ``None`` and
the caller runs that parser, which indexes the rare cases and raises ``FormatError``
(naming the tar and the header's byte offset) for the bad ones.
"""

def shard(fd: int, size: int, fields: tuple[bytes, ...], skip: bool, /) -> tuple[bytes, bytes, bytes, int] | None:
    """Walk the tar open as ``fd`` (``size`` bytes) from byte 0 and group its regular
    members into samples, the GIL released.

    The headers (512 bytes each, ustar, GNU long names, pax ``path``/``size`` records)
    are read with ``pread`` and member data is skipped. A member named ``k.ext`` (``ext``
    in ASCII lower case) belongs to the sample of key ``k`` (the name up to the first dot
    of the base name); consecutive members with one key form a sample. ``fields``: the
    wanted extensions, lower case UTF-8 (1 to 64). A sample without one of them is left
    out when ``skip``, else the walk gives up.

    Returns ``(rows, keys, key_lengths, samples)``: ``rows`` int64, per sample the
    member data offsets of the fields in the order given, then their lengths (bytes);
    ``keys`` the samples' keys in UTF-8, back to back, ``key_lengths`` int64 per sample.
    ``None`` where the full parser must take over: a bad checksum or number field, a
    truncated file, a sparse member, a malformed pax record, a name that is not UTF-8
    or whose extension is not ASCII, a field twice in a sample, a read error.
    ValueError for no fields or more than 64; TypeError when a field is not bytes.
    """
