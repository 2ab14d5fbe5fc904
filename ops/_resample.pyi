"""The fused CPU resampler of ``gpuio.ops`` (``ops/_resample.c`` with ``ops/_resample.h``).

Optional: built at install where a C compiler exists; else the ops run one by one in
Pillow/NumPy. Caller: ``gpuio.ops.fused`` (``FusedCropResizeNormalize.c_args`` builds the
arguments after ``images``).
"""
from _typeshed import ReadableBuffer, WriteableBuffer

def resample(images: list[ReadableBuffer], boxes: ReadableBuffer, clips: ReadableBuffer, out_hw: ReadableBuffer,
             offsets: ReadableBuffer, flips: ReadableBuffer, mean: ReadableBuffer, inv_std: ReadableBuffer,
             out: WriteableBuffer, interp: int, antialias: int, chw: int, to_uint8: bool, /) -> None:
    """Crop -> resize -> flip -> normalize -> layout -> cast of a whole batch, in one call
    with the GIL released for the whole batch (the arithmetic of
    ``gpuio.ops.fused.fused_reference``, up to float rounding).

    - ``images``: N uint8 HWC images (any strides), all with the same 1-4 channels C.
    - ``boxes``: float64 ``[N, 4]`` (y, x, height, width) in source pixels, the region
      each output samples.
    - ``clips``: int64 ``[N, 4]`` (y0, x0, y1, x1), the source pixels a sample may read;
      inside its image and not empty.
    - ``out_hw``: int64 ``[N, 2]`` output height and width in pixels, each >= 1.
    - ``offsets``: int64 ``[N]``, where each sample starts in ``out``, in items (not bytes).
    - ``flips``: int64 ``[N]``, bit 0 mirrors horizontally, bit 1 vertically.
    - ``mean``, ``inv_std``: float32 ``[C]``; the output is ``(pixel - mean) * inv_std``.
    - ``out``: flat, writable; float32, or uint8 when ``to_uint8`` (rounded, saturated);
      sample i occupies ``out_hw[i, 0] * out_hw[i, 1] * C`` items from ``offsets[i]``.
    - ``interp``: 0 nearest, 1 linear, 3 area (2, cubic, is not taken: its weights go
      negative); ``antialias``: widen the filter when downscaling; ``chw``: planar
      (C, H, W) per sample, else interleaved (H, W, C).

    Raises TypeError when ``images`` is not a list (or an argument is not a buffer);
    ValueError when an image is not uint8 HWC with the batch's 1-4 channels, an
    argument buffer is shorter than N (or C) rows need, ``interp`` is not 0, 1 or 3, or a
    sample's clip falls outside its image or its output outside ``out`` (the message
    names the image's row); MemoryError when scratch memory runs out.
    """
