"""Bar charts of bench results as PNG, drawn with Pillow (a dependency already), so that
``gpuio bench`` makes its chart wherever gpuio installs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

WIDTH, LABEL_W, RIGHT_W, BAR_H, GAP = 1000, 330, 150, 22, 6
_BAR, _FAILED, _CEILING, _TEXT = (66, 133, 200), (200, 200, 200), (200, 40, 40), (20, 20, 20)


@dataclass
class Group:
    """One panel: a bar per method (``None``: no figure, with ``notes[label]`` said
    instead) and, when known, the ceiling drawn as a vertical line."""

    title: str
    bars: list[tuple[str, float | None]]
    ceiling: float | None = None
    notes: dict[str, str] = field(default_factory=dict)


def write_chart(path: str, title: str, unit: str, groups: Sequence[Group]) -> str:
    """Draw ``groups`` one under the other, bars scaled per panel, and save a PNG."""
    font = ImageFont.load_default(size=14)
    rows = sum(len(g.bars) + 1 for g in groups)
    height = 50 + rows * (BAR_H + GAP) + len(groups) * GAP * 2
    img = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 10), f"{title} ({unit})", fill=_TEXT, font=font)
    y = 44
    span = WIDTH - LABEL_W - RIGHT_W
    for g in groups:
        draw.text((10, y), g.title, fill=_TEXT, font=font)
        y += BAR_H + GAP
        top = y
        scale = max([v for _, v in g.bars if v] + [g.ceiling or 0.0]) or 1.0
        for label, value in g.bars:
            draw.text((20, y + 3), label, fill=_TEXT, font=font)
            if value:
                x1 = LABEL_W + int(span * value / scale)
                draw.rectangle((LABEL_W, y, x1, y + BAR_H - 1), fill=_BAR)
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
