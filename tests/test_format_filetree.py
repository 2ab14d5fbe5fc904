"""formats.filetree against torchvision's ImageFolder rule, on real trees with real links.

torchvision is not a test dependency; ``image_folder`` below restates the rule that its
``DatasetFolder.find_classes`` and ``make_dataset`` document and implement: classes are
the sorted names of the root's sub-folders (links followed); per class, in sorted class
order, ``sorted(os.walk(class_dir, followlinks=True))`` (folders in the string order of
their paths), each folder's file names sorted, kept when the lower-cased path ends in
one of the extensions.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from checkers import index_on_a_process_pool
import gpuio
from gpuio.formats import filetree
from gpuio.formats.filetree import IMAGE_EXTENSIONS


def image_folder(root, extensions=IMAGE_EXTENSIONS) -> list[tuple[str, int]]:
    """ImageFolder's ``samples``: (path relative to ``root``, class index), in its order."""
    root = str(root)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for label, cls in enumerate(classes):
        for folder, _, names in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for name in sorted(names):
                path = os.path.join(folder, name)
                if path.lower().endswith(extensions):
                    samples.append((os.path.relpath(path, root), label))
    return samples


def _samples(index) -> list[tuple[str, int]]:
    root = index.meta["root"]
    return [(os.path.relpath(p, root), label) for p, label in zip(index.files, index.values["label"].tolist())]


def _touch(path, data: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_nested_folders_in_image_folder_order(tmp_path):
    # the example: folder names that sort around '/' (' ' < '-' < '/' < 'S' < 's')
    names = ["a0.jpg", "sub-x.jpg", "sub.jpg", "x1.jpg", "zz.jpg", "Sub/C.JPG", "sub/a.jpg", "sub/deeper/b.jpg",
             "sub 2/c.jpg", "sub-x/d.png", "sub/deeper/e/f.jpg", "sub.d/g.jpg", "notes.txt"]
    for k, name in enumerate(names):
        _touch(tmp_path / "cls" / name, f"{k}".encode())
    _touch(tmp_path / "other" / "z.jpg", b"other")
    index = filetree(tmp_path)
    expect = ["a0.jpg", "sub-x.jpg", "sub.jpg", "x1.jpg", "zz.jpg", "Sub/C.JPG", "sub/a.jpg", "sub 2/c.jpg",
              "sub-x/d.png", "sub.d/g.jpg", "sub/deeper/b.jpg", "sub/deeper/e/f.jpg"]
    want = [(f"cls/{n}", 0) for n in expect] + [("other/z.jpg", 1)]
    assert _samples(index) == image_folder(tmp_path) == want
    assert index.meta["broken_links"] == index.meta["directory_loops"] == 0
    for i, (rel, _) in enumerate(want):
        assert index[i]["data"] == (tmp_path / rel).read_bytes()


def test_random_trees_match_image_folder(tmp_path):
    rng = np.random.default_rng(7)
    alphabet = list("aAbB0-_. ~zZ") + ["é", "Ä"]
    for t in range(4):
        root = tmp_path / f"t{t}"
        for _ in range(60):
            depth = int(rng.integers(1, 5))
            parts = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 4)))).strip() or "x"
                     for _ in range(depth)]
            ext = rng.choice([".jpg", ".JPEG", ".png", ".txt", ""])
            path = root.joinpath(*parts[:-1], parts[-1] + ext)
            if any(p.is_file() for p in [path, *path.parents]) or path.is_dir():
                continue
            _touch(path, path.name.encode())
        index = filetree(root)
        assert _samples(index) == image_folder(root)
        assert index.meta["classes"] == sorted(e.name for e in os.scandir(root) if e.is_dir())


def test_links_to_folders_and_files_are_followed(tmp_path):
    _touch(tmp_path / "data" / "shared" / "s.jpg", b"shared")
    _touch(tmp_path / "data" / "cat" / "c.jpg", b"cat")
    _touch(tmp_path / "elsewhere" / "e.jpg", b"elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "data" / "linked_class")
    os.symlink(tmp_path / "data" / "shared", tmp_path / "data" / "cat" / "also")  # not a loop: followed
    os.symlink(tmp_path / "data" / "cat" / "c.jpg", tmp_path / "data" / "cat" / "b_link.jpg")
    index = filetree(tmp_path / "data")
    assert _samples(index) == image_folder(tmp_path / "data") == [
        ("cat/b_link.jpg", 0), ("cat/c.jpg", 0), ("cat/also/s.jpg", 0), ("linked_class/e.jpg", 1),
        ("shared/s.jpg", 2)]
    assert index[0]["data"] == b"cat" and index[3]["data"] == b"elsewhere"


def test_broken_links_and_loops_are_skipped_and_counted(tmp_path):
    root = tmp_path / "data"
    _touch(root / "cls" / "a.jpg", b"a")
    _touch(root / "cls" / "sub" / "b.jpg", b"b")
    _touch(root / "two" / "z.jpg", b"z")
    os.symlink(root / "cls" / "missing.jpg", root / "cls" / "dangling.jpg")
    os.symlink("self.jpg", root / "cls" / "self.jpg")  # a file link loop
    os.symlink(".", root / "cls" / "loop")  # a directory loop: cls/loop -> cls
    os.symlink("..", root / "cls" / "sub" / "up")  # cls/sub/up -> cls, an ancestor two levels up
    os.symlink(".", root / "rootloop")  # a class folder that is the root itself
    os.symlink("spin", root / "spin")  # a link loop where classes are listed: no folder
    with pytest.warns(UserWarning) as record:
        index = filetree(root)
    assert index.meta["classes"] == ["cls", "rootloop", "two"]
    assert _samples(index) == [("cls/a.jpg", 0), ("cls/sub/b.jpg", 0), ("two/z.jpg", 2)]
    assert index.meta["broken_links"] == 2
    assert index.meta["directory_loops"] == 3  # cls/loop, cls/sub/up, rootloop
    messages = [str(w.message) for w in record]
    assert any("2 broken links, the first 'cls/dangling.jpg'" in m for m in messages)
    assert any("3 directory loops" in m for m in messages)
    assert [gpuio.read(index, [i])[0].tobytes() for i in range(3)] == [b"a", b"b", b"z"]


def test_image_folder_lists_what_gpuio_skips(tmp_path):
    """The difference on purpose, shown on the reference: ImageFolder keeps broken links
    (which fail when read) and lists a looped folder's files once per level."""
    root = tmp_path / "data"
    _touch(root / "cls" / "a.jpg", b"a")
    os.symlink(root / "cls" / "missing.jpg", root / "cls" / "dangling.jpg")
    os.symlink(".", root / "cls" / "loop")
    reference = [path for path, _ in image_folder(root)]
    assert "cls/dangling.jpg" in reference
    assert "cls/loop/loop/a.jpg" in reference and len(reference) > 20
    with pytest.warns(UserWarning):
        index = filetree(root)
    assert _samples(index) == [("cls/a.jpg", 0)]
    assert (index.meta["broken_links"], index.meta["directory_loops"]) == (1, 1)


def test_progress_bar_only_for_long_indexing(tmp_path, capfd, monkeypatch):
    for c in range(3):
        os.makedirs(tmp_path / "root" / f"c{c}")
        for k in range(4):
            (tmp_path / "root" / f"c{c}" / f"{k}.jpg").write_bytes(b"x" * k)
    (tmp_path / "list.txt").write_text("c0/1.jpg 0\nc2/3.jpg 2\n")
    filetree(tmp_path / "root")
    filetree(tmp_path / "root", file_list=tmp_path / "list.txt")
    assert capfd.readouterr().err == ""  # quick: silent
    monkeypatch.setattr("gpuio.formats._files.PROGRESS_DELAY_S", 0.0)  # as if it had run for a second
    walked = filetree(tmp_path / "root")
    assert "indexing files under" in capfd.readouterr().err
    listed = filetree(tmp_path / "root", file_list=tmp_path / "list.txt")
    assert "indexing files under" in capfd.readouterr().err
    assert len(walked) == 12 and len(listed) == 2


def test_class_folders_walked_on_a_process_pool_match_one_process(tmp_path, monkeypatch):
    root = tmp_path / "root"
    for c in range(5):
        for sub in ("", "b/", "a b/"):
            os.makedirs(root / f"c{c}" / sub, exist_ok=True)
            for k in range(c + 2):
                (root / f"c{c}" / sub / f"{k}.JPG").write_bytes(b"x" * (k + c))
    os.symlink(root / "nowhere.jpg", root / "c3" / "dangling.jpg")
    with pytest.warns(UserWarning, match="broken links"):
        here = filetree(root)
    pooled, report = index_on_a_process_pool(tmp_path, f"formats.filetree({str(root)!r})")
    assert report["pool"]  # the folders after the first went to processes
    assert [pooled.files[i] for i in range(len(pooled))] == [here.files[i] for i in range(len(here))]
    assert pooled.extents["data"].length.tolist() == here.extents["data"].length.tolist()
    assert pooled.values["label"].tolist() == here.values["label"].tolist()
    assert pooled.meta == here.meta and here.meta["broken_links"] == 1
