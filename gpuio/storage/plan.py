"""Read plans: one batch's extents sorted, merged into few reads, and laid out.

``build_plan`` is pure NumPy (no Python loop per sample): it sorts the extents by file
and offset, merges those that overlap, touch or lie within ``gap`` bytes of each other
into one read, widens reads to ``align`` bytes for O_DIRECT, splits the reads longer than
``task_size`` into about ``parts`` long tasks in all that run in parallel, and records
where every sample's bytes land in the batch buffer.

Few long tasks, not many short ones: each task is one sequential run, which the kernel's
readahead serves with ever larger reads; many short tasks of one file, taken by many
threads at once, reach the disk as scattered short reads, each restarting readahead. A
few parts still keep several reads in flight (bench/storage.py measures both).

Where bytes land is independent of the order reads are issued in. Without alignment,
when reading each run of samples that follow each other in the file *in the order
given* takes no more reads than merging in file order (one file per sample, say), the
samples land back to back in the order given: a batch of same-shape arrays is then one
``[B, ...]`` view of the buffer, with no stacking copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuio.errors import ConfigError

__all__ = ["ReadPlan", "build_plan"]

_FILE_SHIFT = 43  # offsets below 8 TiB; file ranks below 2**20 within one batch


@dataclass(frozen=True)
class ReadPlan:
    """Reads to issue, one row per task, and where each sample's bytes land.

    ``task_*`` arrays describe reads: file id, byte offset in the file, length, byte
    offset in the batch buffer, and ``task_need``, the bytes of that read that some
    sample actually needs (the rest is merge gap or alignment padding, which may lie
    past the end of the file). ``sample_dest``/``sample_length`` are in the order the
    extents were given.
    """

    task_file: np.ndarray
    task_offset: np.ndarray
    task_length: np.ndarray
    task_dest: np.ndarray
    task_need: np.ndarray
    sample_dest: np.ndarray
    sample_length: np.ndarray
    nbytes: int  # size of the batch buffer
    align: int

    def __len__(self) -> int:
        return len(self.task_file)


def build_plan(file: np.ndarray, offset: np.ndarray, length: np.ndarray, *, gap: int = 4096,
               align: int = 1, task_size: int = 4 << 20, parts: int = 4) -> ReadPlan:
    """Plan the reads for extents ``(file[i], offset[i], length[i])``.

    ``align`` must be a power of two; with ``align > 1`` every read starts and ends on
    a multiple of it, and so does its place in the buffer (O_DIRECT's rule). Reads
    longer than ``task_size`` bytes are split into tasks of a common size, a multiple
    of ``task_size`` chosen so that they make about ``parts`` tasks together.
    """
    file = np.asarray(file, dtype=np.int64)
    offset = np.asarray(offset, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    n = len(file)
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return ReadPlan(z, z, z, z, z, z, z, 0, align)
    if align < 1 or align & (align - 1):
        raise ConfigError(f"align must be a power of two, got {align}")
    if parts < 1:
        raise ConfigError(f"parts must be at least 1, got {parts}")
    task_size = max(task_size, align) // align * align
    if align == 1:
        sorted_file = np.sort(file)
        if (sorted_file[1:] != sorted_file[:-1]).all():  # a file per sample (a file tree): nothing merges
            return _given_order_plan(file, offset, length, np.zeros(n, dtype=bool), task_size, parts)

    order = np.lexsort((offset, file))
    f, start = file[order], offset[order]
    end = start + length[order]
    a_start = start & ~(align - 1)
    a_end = (end + align - 1) & ~(align - 1)

    # Running end of the current read, restarted at every file: cummax over keys that
    # put each file's values above all earlier files'.
    _, rank = np.unique(f, return_inverse=True)
    key = (rank.astype(np.int64) << _FILE_SHIFT) + a_end
    run_end = np.maximum.accumulate(key) - (rank.astype(np.int64) << _FILE_SHIFT)
    new = np.ones(n, dtype=bool)
    new[1:] = (f[1:] != f[:-1]) | (a_start[1:] > run_end[:-1] + gap)
    first = np.flatnonzero(new)
    group = np.cumsum(new) - 1

    # runs of samples in the order given, each starting where the one before ends
    follows = np.zeros(n, dtype=bool)
    follows[1:] = (file[1:] == file[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    if align == 1 and n - int(follows.sum()) <= len(first):
        return _given_order_plan(file, offset, length, follows, task_size, parts)

    g_file = f[first]
    g_start = a_start[first]
    g_len = np.maximum.reduceat(a_end, first) - g_start
    if align > 1:  # a merge across a gap must keep the read aligned
        g_len = (g_len + align - 1) & ~(align - 1)
    g_need = np.maximum.reduceat(end, first) - g_start
    g_dest = np.zeros(len(first), dtype=np.int64)
    np.cumsum(g_len[:-1], out=g_dest[1:])

    sample_dest = np.empty(n, dtype=np.int64)
    sample_dest[order] = g_dest[group] + (start - g_start[group])
    return _split(g_file, g_start, g_len, g_need, g_dest, sample_dest, length, align, task_size, parts)


def _given_order_plan(file: np.ndarray, offset: np.ndarray, length: np.ndarray, follows: np.ndarray,
                      task_size: int, parts: int) -> ReadPlan:
    """Samples back to back in the buffer in the order given; one read per run of
    samples that follow each other in the file, issued in file order."""
    sample_dest = np.zeros(len(file), dtype=np.int64)
    np.cumsum(length[:-1], out=sample_dest[1:])
    first = np.flatnonzero(~follows)
    run_len = np.add.reduceat(length, first)
    by_file = np.lexsort((offset[first], file[first]))
    first, run_len = first[by_file], run_len[by_file]
    return _split(file[first], offset[first], run_len, run_len, sample_dest[first], sample_dest, length, 1,
                  task_size, parts)


def _split(g_file: np.ndarray, g_start: np.ndarray, g_len: np.ndarray, g_need: np.ndarray, g_dest: np.ndarray,
           sample_dest: np.ndarray, length: np.ndarray, align: int, task_size: int, parts: int) -> ReadPlan:
    """The plan of reads ``g_*``: those longer than ``task_size`` split into tasks of one
    size, a multiple of ``task_size`` (so of ``align``), about ``parts`` of them in all."""
    long_bytes = int(g_len[g_len > task_size].sum())
    t_file, t_start, t_len, t_dest, t_need = g_file, g_start, g_len, g_dest, g_need  # a task per read
    if long_bytes:
        task_size *= max(1, -(-long_bytes // (parts * task_size)))
        pieces = np.maximum(1, -(-g_len // task_size))
        g_of = np.repeat(np.arange(len(g_len)), pieces)
        t_rel = (np.arange(len(g_of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * task_size
        t_file, t_start, t_dest = g_file[g_of], g_start[g_of] + t_rel, g_dest[g_of] + t_rel
        t_len = np.minimum(task_size, g_len[g_of] - t_rel)
        t_need = np.clip(g_need[g_of] - t_rel, 0, t_len)
    return ReadPlan(task_file=t_file, task_offset=t_start, task_length=t_len, task_dest=t_dest, task_need=t_need,
                    sample_dest=sample_dest, sample_length=length.copy(), nbytes=int((t_dest + t_len).max()),
                    align=align)
