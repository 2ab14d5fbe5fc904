"""The CPU augmentations of ``gpuio.ops`` (``ops/_augment.c``), one call per batch.

Required (no other CPU implementation): built at install. Callers: ``gpuio.ops.augment``
(``apply_color``, ``apply_levels``, ``histograms``, ``GaussianBlur``),
``gpuio.ops.warp.warp``, ``gpuio.ops.auto_aug`` (sharpness), ``gpuio.ops.color``
(``ColorJitter`` of uint8 images), ``gpuio.ops.mix`` (MixUp and CutMix: their draws, and the
mixing of uint8 images) and ``gpuio.ops._rng`` (the per-sample random streams: ``rng_*``).

Images are C-contiguous HWC arrays in a list (sizes may differ); ``outs`` are arrays the
caller allocated, one per image, written in place. Per-sample parameters are C-contiguous
arrays with one row per image. Every function but ``rng_*`` (microseconds) releases the
GIL for the whole batch. The
float32 arithmetic is the CUDA kernels' of the same op (the same products summed in the
same order, no fused multiply-add), so CPU and GPU give the same levels; levels are
rounded half up and saturated to 0-255. A list argument that is not a list raises
TypeError; an image or output that is not a C-contiguous (writable where written) array
of the right type and shape, or a parameter that is not a C-contiguous buffer of the
right type and at least the items N rows need, raises ValueError naming the argument and
its index.
"""
from _typeshed import ReadableBuffer, WriteableBuffer

def color(images: list[ReadableBuffer], table: ReadableBuffer, outs: list[WriteableBuffer], /) -> None:
    """``out = M @ rgb + offset`` per pixel of uint8 images of any channel count:
    ``table`` float32 ``[N, 12]`` holds M (3x3, row by row) then the 3 offsets. Images of
    3 or more channels: channels 0-2 as ``M[c, 0] r + M[c, 1] g + M[c, 2] b + offset[c]``,
    the others copied; 1-2 channels: ``M[0, 0] v + offset[0]`` on each. ``outs``: uint8,
    the images' shapes. As ``gpuio.ops.augment.COLOR_SOURCE``."""

def lut(images: list[ReadableBuffer], tables: ReadableBuffer, outs: list[WriteableBuffer], /) -> None:
    """Maps the levels of uint8 images of 1-4 channels: channel c of image k through
    ``tables[k, c]`` (uint8 ``[N, 4, 256]``). ``outs``: uint8, the images' shapes."""

def histogram(images: list[ReadableBuffer], counts: WriteableBuffer, /) -> None:
    """The count of each level per channel of uint8 images of 1-4 channels into
    ``counts`` (int64 ``[N, 4, 256]``; the rows of channels an image lacks are zeroed)."""

def filter3x3(images: list[ReadableBuffer], kernels: ReadableBuffer, outs: list[WriteableBuffer], /) -> None:
    """A 3x3 filter per uint8 image: ``kernels`` float32 ``[N, 3, 3]``; each output value
    is the sum of ``kernel[dy, dx] * pixel(y + dy - 1, x + dx - 1)`` in row-major order
    from 0 (float32), borders mirrored without repeating the edge pixel (``dcb|abcd|cba``).
    ``outs``: uint8, the images' shapes."""

def blur(images: list[ReadableBuffer], ky: list[ReadableBuffer], kx: list[ReadableBuffer],
         outs: list[WriteableBuffer], /) -> None:
    """Separable filter per uint8 or float32 image: rows with ``kx[k]``, then columns with
    ``ky[k]`` (float32, an odd number of taps each, centred), float32 sums in tap order
    from 0, borders mirrored without repeating the edge pixel. ``outs``: the images' types
    and shapes (uint8 rounded and saturated, float32 as summed). As
    ``gpuio.ops.augment.BLUR_SOURCE``, twice."""

def warp(images: list[ReadableBuffer], matrices: ReadableBuffer, fills: ReadableBuffer, interp: int, use_fill: bool,
         outs: list[WriteableBuffer], /) -> None:
    """Affine warp of uint8 images of 1-4 channels into ``outs`` (uint8 ``[oh, ow, C]``
    each, any size): output pixel (x, y) samples its image at ``M @ (x + 0.5, y + 0.5, 1)``
    (``matrices`` float32 ``[N, 2, 3]``, destination to source, x first; pixel centres at
    ``+ 0.5``), bilinear (``interp`` 0) or nearest (1). A tap outside the image reads
    ``fills[k, c]`` (float32 ``[N, 4]``) when ``use_fill``, else the nearest border pixel.
    As ``gpuio.ops.warp.WARP_SOURCE``. Raises ValueError when ``interp`` is not 0 or 1."""

def jitter(images: list[ReadableBuffer], params: ReadableBuffer, outs: list[WriteableBuffer], /) -> None:
    """torchvision's ColorJitter steps per uint8 image, in float32 as
    ``gpuio.ops.color.ColorJitter``'s array code: ``params`` float64 ``[N, 8]`` holds the
    four steps in the order applied (0 brightness ``v * f``, 1 contrast ``v * f + mean
    grey * (1 - f)``, 2 saturation ``v * f + grey * (1 - f)``, 3 hue: H of HSV plus ``f``
    turns; -1 skips; 2 and 3 need 3 or more channels) then the factors of steps 0-3. Each
    step but hue holds values to 0-255; levels are rounded once at the end. The mean grey
    is summed in double. ``outs``: uint8, the images' shapes. Raises ValueError for a
    step that is not -1 or 0-3, or 2-3 on a 1-2 channel image."""

def mix(images: list[ReadableBuffer], weights: ReadableBuffer, outs: list[WriteableBuffer], /) -> None:
    """MixUp: ``out[k] = w[k, 0] * images[k] + w[k, 1] * images[k - 1]`` (row 0 with the
    last), float32 ``weights [N, 2]``, rounded half up; uint8 images of one shape (else
    ValueError). ``outs``: uint8, the images' shapes."""

def paste(images: list[ReadableBuffer], boxes: ReadableBuffer, outs: list[WriteableBuffer], /) -> None:
    """CutMix: ``out[k]`` is ``images[k]`` with the box ``boxes[k]`` (int64 ``[N, 4]``:
    y0, x0, y1, x1, end exclusive) taken from ``images[k - 1]`` (row 0 from the last);
    uint8 images of one shape. ValueError for a box outside its image. ``outs``: uint8,
    the images' shapes."""

def rng_seed(seeds: ReadableBuffer, salt: int, state: WriteableBuffer, /) -> None:
    """Seeds one stream per seed (int64 or uint64 ``[N]``, the bits of the uint64 sample
    seeds) as ``Generator(PCG64(SeedSequence([seed, salt])))`` into ``state`` (uint64
    ``[N, 6]``: per stream the 128-bit state and increment, high words first, the 32-bit
    half kept from the last 32-bit draw and whether one is kept). ValueError for a salt
    over 32 bits."""

def rng_next64(state: WriteableBuffer, rows: ReadableBuffer | None, out: WriteableBuffer, /) -> None:
    """The next 64-bit output of each stream of ``state`` (``rng_seed``) where ``rows``
    (bool ``[N]``; None: all) into ``out`` (uint64 ``[N]``; 0 elsewhere, those streams
    stay)."""

def rng_uniform(state: WriteableBuffer, rows: ReadableBuffer | None, low: float, high: float,
                out: WriteableBuffer, /) -> None:
    """``Generator.uniform(low, high)`` (``low + (high - low) * random()``, ``random()``
    ``(next64 >> 11) * 2**-53``) of each stream where ``rows`` into ``out`` (float64
    ``[N]``; ``low`` elsewhere, those streams stay). ``random()`` is ``uniform(0, 1)``."""

def rng_integers(state: WriteableBuffer, rows: ReadableBuffer | None, high: ReadableBuffer,
                 out: WriteableBuffer, /) -> None:
    """``Generator.integers(0, high[k])`` of each stream ``k`` where ``rows`` into ``out``
    (int64 ``[N]``; 0 elsewhere, those streams stay): Lemire's method on 32-bit draws (a
    fresh output's low half, its high half kept for the stream's next 32-bit draw),
    redrawing where it rejects; ``high`` 1 draws nothing. ``high`` int64 ``[N]``;
    ValueError, before any stream moves, unless ``1 <= high <= 2**32`` on every row
    drawn."""

def rng_beta(state: WriteableBuffer, rows: ReadableBuffer | None, alpha: float, out: WriteableBuffer, /) -> None:
    """``Generator.beta(alpha, alpha)`` of each stream where ``rows`` into ``out`` (float64
    ``[N]``; 0 elsewhere, those streams stay): Johnk's method on ``random()`` draws (libm's
    ``pow``), which NumPy takes for ``alpha <= 1``. ValueError unless ``0 < alpha <= 1``."""

def rng_permutation(state: WriteableBuffer, rows: ReadableBuffer | None, k: int, out: WriteableBuffer, /) -> None:
    """``Generator.permutation(k)`` of each stream where ``rows`` into ``out`` (int64
    ``[N, k]``; ``arange(k)`` elsewhere, those streams stay): ``arange(k)`` shuffled from
    its last item down, item ``i`` swapped with NumPy's ``random_interval(i)`` (a 32-bit
    draw under the smallest all-ones mask covering ``i``, redrawn while above ``i``).
    ValueError unless ``1 <= k < 2**32``."""

def rng_boxes(state: WriteableBuffer, rows: ReadableBuffer | None, hw: ReadableBuffer, scale: tuple[float, float],
              ratio: tuple[float, float], erase: bool, out: WriteableBuffer, /) -> None:
    """torchvision's random boxes (``RandomResizedCrop`` and, with ``erase``,
    ``RandomErasing``) of images of sizes ``hw`` (int64 ``[N, 2]``) from each stream
    where ``rows`` into ``out`` (int64 ``[N, 4]``: top, left, height, width): up to 10
    tries of an area ``uniform(*scale)`` x the image's and an aspect
    ``exp(uniform(log(ratio[0]), log(ratio[1])))`` (libm's exp and log, as Python's
    ``math``), sides ``sqrt(area * aspect)`` and ``sqrt(area / aspect)`` rounded half to
    even (a crop's width and height, an erased box's height and width); the first box
    that fits (a crop within the image, an erased box smaller than it on both sides)
    draws ``integers(0, h - height + 1)`` then ``integers(0, w - width + 1)``. No fit: a
    crop takes the centered box of the ratio closest to the image's (sides rounded half
    to even, offsets floored), an erase zeros. Rows not drawn or without a size: zeros,
    their streams stay."""
