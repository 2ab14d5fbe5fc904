"""Batched file reads for the posix backend (``gpuio/storage/_readloop.c``).

Optional: built at install where a C compiler exists; else ``gpuio.storage._posix``
reads with ``os.preadv`` on Python threads and ``gpuio.storage.reader`` stats with
``os.stat``. Callers: ``gpuio.storage._posix`` (``run``; the arrays come from a read plan
and a ``PathTable`` and their sizes are not checked here) and ``gpuio.storage.reader``
(``sizes``: the lengths of extents indexed without them).
"""
from _typeshed import ReadableBuffer, WriteableBuffer

def run(root: bytes, blob: ReadableBuffer, starts: ReadableBuffer, ends: ReadableBuffer, file: ReadableBuffer,
        offsets: ReadableBuffer, lengths: ReadableBuffer, dests: ReadableBuffer, needs: ReadableBuffer,
        shared: ReadableBuffer, fds: WriteableBuffer, counter: WriteableBuffer, stop: WriteableBuffer,
        todo: ReadableBuffer, pending: WriteableBuffer, npending: WriteableBuffer, done: WriteableBuffer,
        base: int, flags: int, nowait: int, workers: int, /) -> list[tuple[int, int, int, int]]:
    """Run the read tasks ``todo`` (int64 task ids) on this thread and up to
    ``workers - 1`` helper threads of a pool kept for the process, the GIL released for
    the whole phase (opens, reads and closes).

    - File f's path is ``root + blob[starts[f]:ends[f]]`` (bytes; ``starts``, ``ends``
      int64 per file).
    - Task k reads ``lengths[k]`` bytes of file ``file[k]`` (int32) from byte offset
      ``offsets[k]`` into address ``base + dests[k]`` and needs at least ``needs[k]`` of
      them (all int64 per task); ``done[k]`` (int64) holds the bytes it already has.
    - ``shared`` (int8 per file): 1 where several tasks read the file; it is then opened
      once, its descriptor kept in ``fds`` (int32 per file, -1 before; the caller closes
      them), else each task opens and closes it.
    - ``counter`` (int64 ``[1]``, 0 on entry) hands out tasks; ``stop`` (int32 ``[1]``) is
      set by the first failure and stops every thread.
    - ``flags``: extra ``open(2)`` flags (``O_DIRECT`` included).
    - ``nowait`` 1: read with ``RWF_NOWAIT`` (what the page cache holds) and append a task
      that would wait for the disk to ``pending`` (int64 per task), counting them in
      ``npending`` (int64 ``[1]``); 0: blocking reads.

    Returns one ``(status, task, errno, bytes read)`` per thread that took part: status 0
    ok, 1 the open failed, 2 a read failed, 3 a short read (fewer than ``needs`` bytes);
    ``task`` is the failed task. Raises nothing for I/O errors (the caller turns them into
    ``gpuio.errors`` errors); TypeError when an argument is not a buffer (or not writable
    where written).
    """

def helpers() -> int:
    """The helper threads ``run`` has started in this process (0 in a fresh forked child)."""

def sizes(root: bytes, blob: ReadableBuffer, starts: ReadableBuffer, ends: ReadableBuffer, out: WriteableBuffer,
          /) -> None:
    """Stat files with the GIL released: file f's path is ``root + blob[starts[f]:ends[f]]``
    (``starts``, ``ends`` int64 per file); ``out[f]`` (int64) becomes its size in bytes, or
    ``-errno`` where it cannot be stat'ed. ValueError when ``starts``, ``ends`` and ``out``
    differ in length; TypeError when an argument is not a buffer (or ``out`` not writable).
    """
