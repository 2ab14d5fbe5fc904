"""``gpuio bench``'s charts: gpuio's bars in their own colour, and each ceiling row named
by what it reads."""

from __future__ import annotations

from PIL import Image

from gpuio.bench import storage
from gpuio.bench._chart import LABEL_W, write_chart


def test_ceiling_rows_say_what_they_read_and_gpuio_stands_out(tmp_path):
    methods = ["gpuio", "naive loop", "np.fromfile", storage.SEQUENTIAL, storage.PARALLEL, storage.PARTS,
               storage.DIRECT, storage.DIRECT_DEEP]
    rows = [{"dataset": "d", "cache": "warm", "method": m, "GB/s": 1.0 + i, "ceiling GB/s": 8.0}
            for i, m in enumerate(methods)]
    (group,) = storage._groups(rows)
    labels = [label for label, _ in group.bars]
    assert labels[:3] == ["gpuio", "naive loop", "np.fromfile"] and group.ours == {"gpuio"}
    assert set(labels[3:]) == group.ceilings and len(group.ceilings) == 5
    assert all(label.startswith("ceiling: the same bytes in one file, ") for label in labels[3:]), labels
    assert labels[5].endswith("parallel sequential reads"), labels  # read_parts' parts of the file at once
    png = write_chart(str(tmp_path / "c.png"), "t", "GB/s", [group])
    with Image.open(png) as im:
        rgb = im.convert("RGB")
        # the first pixel column of every bar, top to bottom: one colour per kind of row
        column = [rgb.getpixel((LABEL_W + 2, y)) for y in range(rgb.height)]
    colours = [c for i, c in enumerate(column) if c != (255, 255, 255) and (i == 0 or column[i - 1] != c)]
    assert len(colours) == len(methods), colours
    ours, others, ceilings = colours[0], set(colours[1:3]), set(colours[3:])
    assert len(others) == 1 and len(ceilings) == 1 and len({ours, *others, *ceilings}) == 3, colours
