"""Bar charts of bench results as PNG, drawn with Pillow (a dependency already), so that
``gpuio bench`` makes its chart wherever gpuio installs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

WIDTH, LABEL_W, RIGHT_W, BAR_H, GAP = 1200, 470, 150, 22, 6
# gpuio's bars stand out; the other ways to load the same data are muted; the ceiling rows
# (reads of the same bytes that bound what any loader can do) are drawn as the ceiling line is
_OURS, _OTHER, _CEILING_BAR = (230, 110, 20), (150, 168, 190), (232, 150, 150)
_FAILED, _CEILING, _TEXT = (200, 200, 200), (200, 40, 40), (20, 20, 20)
_KINDS = (("gpuio", _OURS), ("other ways", _OTHER), ("ceiling rows: reads of the same bytes", _CEILING_BAR))


@dataclass
class Group:
    """One panel: a bar per method (``None``: no figure, with ``notes[label]`` said
    instead) and, when known, the ceiling drawn as a vertical line. Bars whose label is in
    ``ours`` are gpuio's; those in ``ceilings`` are the reads that make the ceiling."""

    title: str
    bars: list[tuple[str, float | None]]
    ceiling: float | None = None
    notes: dict[str, str] = field(default_factory=dict)
    ours: set[str] = field(default_factory=set)
    ceilings: set[str] = field(default_factory=set)


def write_chart(path: str, title: str, unit: str, groups: Sequence[Group]) -> str:
    """Draw ``groups`` one under the other, bars scaled per panel, and save a PNG."""
    font = ImageFont.load_default(size=14)
    rows = sum(len(g.bars) + 1 for g in groups)
    height = 74 + rows * (BAR_H + GAP) + len(groups) * GAP * 2
    img = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 10), f"{title} ({unit})", fill=_TEXT, font=font)
    x = 10
    kinds = [k for k in _KINDS if k[1] != _CEILING_BAR or any(g.ceilings for g in groups)]
    for words, colour in kinds:  # the legend
        draw.rectangle((x, 36, x + 14, 50), fill=colour)
        draw.text((x + 20, 36), words, fill=_TEXT, font=font)
        x += 40 + int(draw.textlength(words, font=font))
    y = 68
    span = WIDTH - LABEL_W - RIGHT_W
    for g in groups:
        draw.text((10, y), g.title, fill=_TEXT, font=font)
        y += BAR_H + GAP
        top = y
        scale = max([v for _, v in g.bars if v] + [g.ceiling or 0.0]) or 1.0
        for label, value in g.bars:
            colour = _OURS if label in g.ours else _CEILING_BAR if label in g.ceilings else _OTHER
            draw.text((20, y + 3), label, fill=_TEXT, font=font)
            if label in g.ours:  # bold: drawn twice, a pixel apart
                draw.text((21, y + 3), label, fill=_TEXT, font=font)
            if value:
                x1 = LABEL_W + int(span * value / scale)
                draw.rectangle((LABEL_W, y, x1, y + BAR_H - 1), fill=colour)
                draw.text((x1 + 6, y + 3), f"{value:,.2f}", fill=_TEXT, font=font)
            else:
                draw.rectangle((LABEL_W, y, LABEL_W + 40, y + BAR_H - 1), fill=_FAILED)
                draw.text((LABEL_W + 48, y + 3), g.notes.get(label, "no figure"), fill=_TEXT, font=font)
            y += BAR_H + GAP
        if g.ceiling:
            x = LABEL_W + int(span * g.ceiling / scale)
            draw.line((x, top - 4, x, y - GAP + 4), fill=_CEILING, width=3)
            draw.text((x + 6, top - BAR_H + 3), f"ceiling {g.ceiling:,.2f}", fill=_CEILING, font=font)
        y += GAP * 2
    img.save(path, "PNG")
    return path
