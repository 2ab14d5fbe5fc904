"""YUV 4:2:0 -> RGB24 for ``gpuio.ops.video.decode_video`` on the CPU (``ops/_video.c``).

Optional: built at install where a C compiler exists; else swscale (through PyAV)
converts. The arithmetic is FFmpeg's unscaled x86 yuv420p -> rgb24 converter, so that it
can give the bytes swscale gives; ``gpuio.ops.video`` checks that it does for every
(Y, U, V) before using it.
"""
from _typeshed import ReadableBuffer, WriteableBuffer

def yuv420_rgb24(y: ReadableBuffer, y_stride: int, u: ReadableBuffer, v: ReadableBuffer, uv_stride: int,
                 out: WriteableBuffer, width: int, height: int,
                 coeffs: tuple[int, int, int, int, int, int, int, int], /) -> None:
    """Convert one picture, the GIL released: planes ``y`` (``height`` rows of
    ``y_stride`` bytes), ``u`` and ``v`` (``height / 2`` rows of ``uv_stride`` bytes) into
    ``out``, C-contiguous uint8 ``[height, width, 3]`` (exactly ``width * height * 3``
    bytes). Width and height in pixels, even and >= 2. ``coeffs`` are the converter's
    16-bit fixed-point (y_offset, y_coeff, u_offset, v_offset, u2b, u2g, v2g, v2r), as
    ``gpuio.ops.video`` derives them from the picture's color matrix and range.

    Raises ValueError when the planes or ``out`` do not fit the size (or a size is odd);
    OverflowError when a coefficient is not a 16-bit signed integer.
    """
