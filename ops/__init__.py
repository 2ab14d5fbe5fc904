"""Decode and augmentation ops, CPU and GPU.

An op is a callable ``op(batch) -> batch`` (see ``gpuio.batch``). Images are HWC
uint8 per sample until ``normalize``, which stacks a fixed-size batch into one array
``[N, C, H, W]`` (or ``[N, H, W, C]``)::

    pipeline = ops.Compose([ops.decode_image(), ops.random_resized_crop(224),
                            ops.flip(), ops.normalize(mean, std)])

On a GPU batch, ``Compose`` runs crop -> resize -> flip -> normalize as one fused
kernel launch per batch; on the CPU each op runs on its own (the reference path).

Audio ops (``ops.audio``, ``ops.spectral``, ``ops.ragged``) keep DALI's operator names,
parameters and defaults and read and write ``audio``: ``decode_audio`` ->
``preemphasis_filter`` -> ``nonsilent_region`` + ``slice`` -> ``spectrogram`` ->
``mel_filter_bank`` -> ``to_decibels`` (or ``mfcc``) -> ``normalize_axes`` -> ``pad``.
"""

from gpuio.ops.auto_aug import (AutoAugment, RandAugment, TrivialAugmentWide, auto_augment, rand_augment,
                                trivial_augment_wide)
from gpuio.ops.augment import (BrightnessContrast, ColorTwist, Erase, GaussianBlur, Hsv, JpegCompressionDistortion,
                               RandomErasing, RandomGrayscale, brightness_contrast, color_twist, erase, gaussian_blur,
                               hsv, jpeg_compression_distortion, random_erasing, random_grayscale)
from gpuio.ops.audio import (DecodeAudio, NonsilentRegion, PreemphasisFilter, Slice, decode_audio,
                             nonsilent_region, preemphasis_filter, slice)
from gpuio.ops.custom import PythonFunction, python_function
from gpuio.ops.color import ColorJitter, Normalize, color_jitter, normalize
from gpuio.ops.decode import DecodeImage, decode_image
from gpuio.ops.decode_slice import DecodeImageSlice, decode_image_slice
from gpuio.ops.detection import (BBFlip, BBoxPaste, BoxEncoder, Paste, RandomBBoxCrop, bb_flip, bbox_paste,
                                 box_encoder, paste, random_bbox_crop, ssd300_anchors)
from gpuio.ops.fused import (Compose, FusedCropResizeNormalize, crop_mirror_normalize, fused_crop_resize_normalize,
                             fused_reference)
from gpuio.ops.geometry import (CenterCrop, Flip, RandomResizedCrop, Resize, center_crop, flip,
                                random_resized_crop, resize)
from gpuio.ops.mix import CutMix, MixUp, cutmix, mixup
from gpuio.ops.ragged import NormalizeAxes, Pad, normalize_axes, pad
from gpuio.ops.spectral import (MFCC, MelFilterBank, Spectrogram, ToDecibels, mel_filter_bank, mfcc,
                                spectrogram, to_decibels)
from gpuio.ops.video import DecodeVideo, decode_video
from gpuio.ops.warp import Rotate, WarpAffine, rotate, warp_affine

__all__ = [
    "BrightnessContrast",
    "ColorTwist",
    "CutMix",
    "Erase",
    "erase",
    "JpegCompressionDistortion",
    "jpeg_compression_distortion",
    "GaussianBlur",
    "Hsv",
    "MixUp",
    "RandomErasing",
    "RandomGrayscale",
    "brightness_contrast",
    "color_twist",
    "cutmix",
    "gaussian_blur",
    "hsv",
    "mixup",
    "random_erasing",
    "random_grayscale",
    "Rotate",
    "WarpAffine",
    "AutoAugment",
    "RandAugment",
    "TrivialAugmentWide",
    "auto_augment",
    "rand_augment",
    "trivial_augment_wide",
    "rotate",
    "warp_affine",
    "BBFlip",
    "DecodeImageSlice",
    "PythonFunction",
    "python_function",
    "decode_image_slice",
    "BBoxPaste",
    "BoxEncoder",
    "Paste",
    "RandomBBoxCrop",
    "bb_flip",
    "bbox_paste",
    "box_encoder",
    "paste",
    "random_bbox_crop",
    "ssd300_anchors",
    "CenterCrop",
    "ColorJitter",
    "Compose",
    "DecodeImage",
    "DecodeVideo",
    "Flip",
    "FusedCropResizeNormalize",
    "Normalize",
    "RandomResizedCrop",
    "Resize",
    "center_crop",
    "color_jitter",
    "crop_mirror_normalize",
    "decode_image",
    "decode_video",
    "flip",
    "fused_crop_resize_normalize",
    "fused_reference",
    "normalize",
    "random_resized_crop",
    "resize",
    "DecodeAudio",
    "NonsilentRegion",
    "PreemphasisFilter",
    "Slice",
    "decode_audio",
    "nonsilent_region",
    "preemphasis_filter",
    "slice",
    "NormalizeAxes",
    "Pad",
    "normalize_axes",
    "pad",
    "MFCC",
    "MelFilterBank",
    "Spectrogram",
    "ToDecibels",
    "mel_filter_bank",
    "mfcc",
    "spectrogram",
    "to_decibels",
]


def _document_factories() -> None:
    """Give each op factory whose docstring only points at its class (``See ``Resize``.``)
    that class's docstring, so that ``help(ops.resize)`` shows the arguments' meaning."""
    import inspect
    import re

    namespace = globals()
    for name in __all__:
        factory = namespace[name]
        found = re.fullmatch(r"See ``(\w+)``\.", (factory.__doc__ or "").strip())
        if inspect.isfunction(factory) and found and found.group(1) in namespace:
            op = namespace[found.group(1)]
            factory.__doc__ = (f"Make a ``{op.__name__}`` op (``{name}(...)`` takes the arguments "
                               f"``{op.__name__}(...)`` takes).\n\n{inspect.cleandoc(op.__doc__ or '')}")


_document_factories()
