"""``ops.python_function``: a per-sample Python callable (a torch function, a function
drawing from the row's generator) inside a Loader, exact on resume, failures named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpuio
from gpuio import formats, ops
from gpuio.errors import PipelineError
from gpuio.sample import make_image_tree


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return formats.filetree(make_image_tree(tmp_path_factory.mktemp("t") / "t", count=10))


def upside_down(img):
    return torch.tensor(img).flip(0)  # a torch tensor back


def noisy(img, rng):
    return np.clip(img.astype(np.int16) + rng.integers(-3, 4, img.shape), 0, 255).astype(np.uint8)


def test_a_torch_function_per_sample(tree):
    chain = [ops.decode_image(), ops.resize((24, 32)), ops.python_function(upside_down)]
    got = list(gpuio.Loader(tree, 4, ops=chain, output="numpy"))
    want = list(gpuio.Loader(tree, 4, ops=chain[:2], output="numpy"))
    assert got[0]["image"].shape == (4, 24, 32, 3) and got[0]["image"].dtype == np.uint8
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g["image"], w["image"][:, ::-1])


def test_draws_from_the_row_generator_repeat_on_resume(tree):
    def make():
        return gpuio.Loader(tree, 3, ops=[ops.decode_image(), ops.resize((16, 16)),
                                          ops.python_function(noisy, out="noisy")],
                            fields=["data"], shuffle=True, seed=7, output="numpy")

    whole = list(make())
    first = make()
    it = iter(first)
    next(it)
    state = first.state_dict()
    it.close()
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(whole) - 1
    for a, b in zip(rest, whole[1:]):
        np.testing.assert_array_equal(a["index"], b["index"])
        np.testing.assert_array_equal(a["noisy"], b["noisy"])
    assert not np.array_equal(whole[0]["noisy"], whole[0]["image"])


def test_a_failing_function_names_itself_and_the_sample(tree):
    def picky(img):
        if img.mean() > 0:
            raise ValueError("too bright")
        return img

    with pytest.raises(PipelineError, match=r"sample \d+.*python_function picky raised ValueError: too bright"):
        list(gpuio.Loader(tree, 4, ops=[ops.decode_image(), ops.python_function(picky)], output="numpy"))
    loader = gpuio.Loader(tree, 4, ops=[ops.decode_image(), ops.python_function(picky)], output="numpy",
                          on_error="skip")
    assert sum(len(b["index"]) for b in loader) == 0
    assert loader.stats()["skipped"] == 10
