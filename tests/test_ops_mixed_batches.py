"""Batches the CPU path takes must go through the GPU path too:
grey and colour images in one batch (``decode_image(color="unchanged")`` on ImageNet)
and images that are not uint8.

Without a GPU, the kernel's host side (``check_images``, ``channel_groups``,
``launch_params``, ``split_output``) runs here with the kernel source compiled as C++
(the harness of ``test_ops_kernel``), one launch per channel count as on the GPU; the
gpu-marked twins compare the GPU ops with the CPU ops."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import parse_device
from gpuio.errors import ConfigError
from gpuio.ops._kernels import channel_groups, check_images, launch_params, split_output
from gpuio.ops.fused import FusedCropResizeNormalize
from gpuio.ops.geometry import image_sizes
from gpuio.sample import sample_image

from test_ops_kernel import kernels  # noqa: F401 - the fixture: the kernel source built as C++ per output kind

INTERP = {"nearest": 0, "linear": 1, "cubic": 2, "area": 3}


def mixed_images(seed=0):
    """Colour, grey and RGBA images of several sizes, some as strided views."""
    rng = np.random.default_rng(seed)
    colour = [sample_image(rng, h, w) for h, w in [(120, 90), (64, 100), (90, 90)]]
    grey = [c[..., :1].copy() for c in colour]
    rgba = np.concatenate([colour[2], colour[2][..., :1]], axis=2)
    return [colour[0], grey[1][:, ::-1], colour[1][5:60], grey[0], rgba, grey[2].transpose(1, 0, 2)]


def batch_of(images, device="cpu"):
    index = np.arange(len(images))
    return Batch({"image": list(images)}, index, sample_seeds(7, 0, index), parse_device(device))


def host_kernel(kernels, images, plan, params, interp, antialias, layout, dtype):  # noqa: F811 - the fixture imported above
    """``crop_resize_normalize``'s steps with host pointers and the C++ build of the kernel."""
    channels = check_images(images)
    table, sizes = launch_params([img.ctypes.data for img in images], [img.strides for img in images], channels,
                                 plan["clip"], plan["out_hw"], plan["flip"])
    boxes = np.asarray(plan["box"], np.float32)
    out = np.zeros(int(sizes.sum()), dtype)
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    threads = 64
    for c, rows in channel_groups(channels).items():
        mean, inv_std = (np.ascontiguousarray(a, np.float32) for a in params(c))
        part, part_boxes = np.ascontiguousarray(table[rows]), np.ascontiguousarray(boxes[rows])
        pixels = int((table[rows, 8] * table[rows, 9]).max())
        kernels[dtype](ctypes.c_int((pixels + threads - 1) // threads), ctypes.c_int(len(rows)), ctypes.c_int(threads),
                      ptr(part), ptr(part_boxes), ptr(mean), ptr(inv_std), ptr(out), ctypes.c_int(c),
                      ctypes.c_int(INTERP[interp]), ctypes.c_int(antialias), ctypes.c_int(layout == "CHW"))
    return split_output(out, table, sizes, channels, layout)


CHAINS = [
    lambda: [ops.random_resized_crop(32), ops.flip(), ops.normalize(110, 55)],
    lambda: [ops.resize(shorter=40), ops.center_crop((32, 24)), ops.normalize(0, 1, layout="HWC", dtype="uint8")],
    lambda: [ops.center_crop(48), ops.resize((30, 40), interp="area"), ops.normalize(10, 2)],
]


def levels(a, b, std):
    return np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) * std


@pytest.mark.parametrize("k", range(len(CHAINS)))
def test_mixed_channel_batch_through_the_kernel_host_side(kernels, k):  # noqa: F811 - the fixture imported above
    images = mixed_images()
    chain = CHAINS[k]()
    fused = FusedCropResizeNormalize(chain)
    plan = fused.plan(batch_of(images), image_sizes(images))
    norm = chain[-1]
    dtype = np.uint8 if norm.dtype == "uint8" else np.float32
    got = host_kernel(kernels, images, plan, norm.channel_params, fused.interp, fused.antialias, norm.layout, dtype)
    cpu = ops.Compose(CHAINS[k](), fuse=False)(batch_of(images)).data["image"]
    assert isinstance(got, list) and len(got) == len(cpu) == len(images)
    std = float(norm.std[0])
    for row, (g, c) in enumerate(zip(got, cpu)):
        assert g.shape == c.shape and g.dtype == c.dtype, row
        assert levels(g, c, std).max() <= 1.0 + 1e-3 and levels(g, c, std).mean() < 0.5, row


def test_fused_cpu_chain_normalizes_each_image_by_its_own_channels():
    """The fused op's CPU path on a grey + colour batch gives what the ops give one by
    one: a grey image stays one channel (it was broadcast to the first image's three)."""
    images = mixed_images()
    for make in CHAINS:
        fused = ops.Compose(make())(batch_of(images)).data["image"]
        single = ops.Compose(make(), fuse=False)(batch_of(images)).data["image"]
        assert [f.shape for f in fused] == [s.shape for s in single]
        std = float(make()[-1].std[0])
        assert max(levels(f, s, std).max() for f, s in zip(fused, single)) <= 1.0 + 1e-3


def test_kernel_planning_groups_rows_and_lays_outputs_back_to_back():
    channels = np.array([3, 1, 3, 4, 1])
    groups = channel_groups(channels)
    assert list(groups) == [1, 3, 4]
    assert [g.tolist() for g in groups.values()] == [[1, 4], [0, 2], [3]]
    out_hw = np.array([[2, 3], [4, 5], [2, 3], [1, 1], [2, 2]])
    table, sizes = launch_params([10, 20, 30, 40, 50], [(30, 3, 1)] * 5, channels, np.zeros((5, 4), np.int64),
                                 out_hw, np.array([0, 1, 2, 3, 0]))
    assert sizes.tolist() == [18, 20, 18, 4, 4]
    assert table[:, 10].tolist() == [0, 18, 38, 56, 60] and table[:, 0].tolist() == [10, 20, 30, 40, 50]
    views = split_output(np.arange(64), table, sizes, channels, "CHW")
    assert [v.shape for v in views] == [(3, 2, 3), (1, 4, 5), (3, 2, 3), (4, 1, 1), (1, 2, 2)]
    assert views[1].ravel()[0] == 18 and views[4].ravel()[-1] == 63
    same = split_output(np.arange(36), table[[0, 2]], sizes[[0, 2]], channels[[0, 2]], "HWC")
    assert same.shape == (2, 2, 3, 3)


def test_kernel_refuses_what_it_cannot_read_by_row():
    rng = np.random.default_rng(1)
    ok = rng.integers(0, 255, (4, 4, 3), dtype=np.uint8)
    assert check_images([ok, ok[..., :1], np.zeros((2, 2, 4), np.uint8)]).tolist() == [3, 1, 4]
    for bad in (ok.astype(np.float32), np.zeros((4, 4, 5), np.uint8), np.zeros((4, 4), np.uint8)):
        with pytest.raises(ConfigError, match=r"row 1 is"):
            check_images([ok, bad])


# ---- on a GPU: the GPU ops against the CPU ops ------------------------------------------------
def on_gpu(images):
    import cupy

    return [cupy.asarray(img) for img in images]


def to_host(values):
    import cupy

    return [cupy.asnumpy(v) for v in values]


@pytest.mark.gpu
@pytest.mark.parametrize("k", range(len(CHAINS)))
@pytest.mark.parametrize("fuse", [True, False])
def test_gpu_chain_on_a_mixed_channel_batch_matches_cpu(k, fuse):
    images = mixed_images()
    cpu = ops.Compose(CHAINS[k](), fuse=fuse)(batch_of(images)).data["image"]
    gpu = to_host(ops.Compose(CHAINS[k](), fuse=fuse)(batch_of(on_gpu(images), "cuda")).data["image"])
    std = float(CHAINS[k]()[-1].std[0])
    for g, c in zip(gpu, cpu):
        assert g.shape == c.shape and g.dtype == c.dtype
        assert levels(g, c, std).max() <= 1.0 + 1e-3


@pytest.mark.gpu
def test_gpu_decode_unchanged_mixed_jpegs_then_chain_matches_cpu(tmp_path):
    import simplejpeg

    images = mixed_images()[:4]
    blobs = [np.frombuffer(simplejpeg.encode_jpeg(np.ascontiguousarray(img), quality=95,
                                                  colorspace="GRAY" if img.shape[2] == 1 else "RGB"), np.uint8)
             for img in images]
    chain = lambda: [ops.decode_image(color="unchanged"), *CHAINS[0]()]  # noqa: E731
    index = np.arange(len(blobs))
    cpu = ops.Compose(chain())(Batch({"data": list(blobs)}, index, sample_seeds(7, 0, index))).data["image"]
    gpu = ops.Compose(chain())(Batch({"data": list(blobs)}, index, sample_seeds(7, 0, index),
                                                parse_device("cuda"))).data["image"]
    gpu = to_host(gpu)
    assert [g.shape for g in gpu] == [c.shape for c in cpu] and {c.shape[0] for c in cpu} == {1, 3}
    for g, c in zip(gpu, cpu):  # nvJPEG and libjpeg-turbo may differ by a level or two
        assert levels(g, c, 55.0).mean() < 2.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("make", [lambda: ops.resize((30, 41)), lambda: ops.random_resized_crop(24),
                                  lambda: ops.center_crop(20)])
def test_gpu_resize_of_non_uint8_images_matches_cpu(dtype, make):
    rng = np.random.default_rng(2)
    images = [(img.astype(np.float32) * 200).astype(dtype) for img in mixed_images()]
    images[0] = rng.integers(0, 255, (50, 60, 3), dtype=np.uint8)  # a kernel row among them
    cpu = make()(batch_of(images)).data["image"]
    gpu = to_host(make()(batch_of(on_gpu(images), "cuda")).data["image"])
    for g, c in zip(gpu, cpu):  # float sums in another order; a uint16 truncation may flip by one
        assert g.shape == c.shape and g.dtype == c.dtype
        np.testing.assert_allclose(g.astype(np.float64), c.astype(np.float64), rtol=1e-5, atol=1.0)
