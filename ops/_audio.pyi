"""CPU audio ops for ``gpuio.ops.audio``, ``gpuio.ops.spectral`` and ``gpuio.ops.ragged``
(``ops/_audio.c``), one call per batch.

Optional: built at install where a C compiler exists; else NumPy computes the same.
Packed rows: the rows of a batch lie end to end in one C-contiguous float32 array
(``gpuio.ops.ragged.pack``) and ``lengths`` (int64, one per row, none negative) says
where each ends. Every function releases the GIL while it computes. Buffers whose size
is given are checked for exactly that size (ValueError naming the argument, its bytes
and the bytes expected); an argument that is not a (writable where written) C-contiguous
buffer raises TypeError or BufferError.
"""
from _typeshed import ReadableBuffer, WriteableBuffer

def preemphasis(x: ReadableBuffer, y: WriteableBuffer, lengths: ReadableBuffer, coeff: float, border: int,
                /) -> None:
    """``y[t] = x[t] - coeff * x[t - 1]`` per row of packed float32 rows (``x`` and ``y``:
    ``sum(lengths)`` floats each); the sample before a row's first is 0 (``border`` 0:
    ``y[0] = x[0]``), ``x[0]`` (1, clamp) or ``x[1]`` (2, reflect). As
    ``gpuio.ops.audio.PreemphasisFilter``.

    Raises ValueError when ``border`` is not 0, 1 or 2, a length is negative, or a size
    differs.
    """

def nonsilent(x: ReadableBuffer, lengths: ReadableBuffer, window: int, reset: int, ratio: float,
              threshold: float, begin: WriteableBuffer, length: WriteableBuffer, /) -> None:
    """Per row of packed float32 rows, the nonsilent region (in samples) into int64
    ``begin[row]`` and ``length[row]`` (``[rows]`` each; length 0 when all is silent): from
    the start of the first window whose mean power reaches the threshold to the last such
    sample. The power is a float32 running mean of ``x * x`` over ``window`` samples,
    recomputed every ``reset`` samples (-1: only at the row's start). ``threshold`` NaN:
    the row's largest power times ``ratio``; else ``threshold`` itself. As
    ``gpuio.ops.audio.NonsilentRegion``.

    Raises ValueError when ``window`` < 1, ``reset`` is neither -1 nor a positive
    multiple of ``window``, a length is negative, or a size differs; MemoryError.
    """

def frames(rows: list[ReadableBuffer], counts: ReadableBuffer, window: ReadableBuffer, step: int, half: int,
           mode: int, nfft: int, out: WriteableBuffer, /) -> None:
    """The windowed frames of 1-D float32 rows (any stride) end to end into ``out``,
    float32 ``[frames, nfft]`` C-contiguous: row r gives ``counts[r]`` (int64 ``[rows]``)
    frames, frame k from sample ``k * step - half`` times ``window`` (float32 ``[W]``,
    W <= nfft) into the first W columns; the other columns are not written. Samples
    outside a row: ``mode`` 0 none may be needed (whole windows), 1 mirrored as
    ``np.pad``'s "reflect", 2 zero. As ``gpuio.ops.spectral.Spectrogram.frames``.

    Raises TypeError when ``rows`` is not a list; ValueError when ``mode`` is not 0-2,
    ``step`` < 1, ``half`` < 0, ``out`` is smaller than ``sum(counts) * nfft`` floats, the
    window is empty or longer than ``nfft``, or a row is not float32 ``[T]`` with T >= 1
    holding its windows (the message names the row).
    """

def sparse_matmul(spec: ReadableBuffer, weights: ReadableBuffer, bins: int, outputs: int, out: WriteableBuffer,
                  /) -> None:
    """``out [T, outputs] = spec [T, bins] @ weights [bins, outputs]``, float32, summing
    only the span of each column of ``weights`` between its first and last nonzero
    entries (a mel filter bank: a few bins per filter). Sums in another order than NumPy
    (float32 rounding apart).

    Raises ValueError when ``bins`` or ``outputs`` < 1, ``weights`` is not
    ``bins * outputs`` floats, ``spec`` is not a whole number of rows of ``bins`` floats,
    or ``out`` is not ``T * outputs`` floats; MemoryError.
    """

def normalize(x: ReadableBuffer, lengths: ReadableBuffer, features: int, ddof: int, epsilon: float, scale: float,
              shift: float, out: WriteableBuffer, /) -> None:
    """Per row of packed float32 ``[T, features]`` frames (``lengths`` counts frames; ``x``
    and ``out``: ``sum(lengths) * features`` floats), per feature over the row's frames:
    ``(x - mean) * scale / sqrt(var + epsilon) + shift``, the variance divided by
    ``max(T - ddof, 1)``, summed in float64; a zero deviation gives 0. As
    ``gpuio.ops.ragged.NormalizeAxes``.

    Raises ValueError when ``features`` < 1, a length is negative, or a size differs;
    MemoryError.
    """

def power(spec: ReadableBuffer, out: WriteableBuffer, /) -> None:
    """``out[i] = re[i]**2 + im[i]**2`` of interleaved complex64 ``spec`` into float32
    ``out`` (float32 squares added, as NumPy).

    Raises ValueError when ``spec`` is not twice the bytes of ``out``.
    """
