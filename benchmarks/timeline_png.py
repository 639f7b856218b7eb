"""Draw an execution timeline (one lane per row, one coloured bar per span) as a
PNG, with nothing but the standard library and numpy: a built-in 5x7 bitmap font
for the text and a PNG encoder of its own (8-bit RGB, unfiltered rows, zlib).

    python benchmarks/timeline_png.py /tmp/timeline_demo.png   # writes a demo
"""
from __future__ import annotations

import math
import struct
import sys
import zlib
from typing import NamedTuple

import numpy as np

Colour = tuple[int, int, int]

# Tableau 10: well separated, readable on white; a colour index wraps around.
PALETTE: list[Colour] = [
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
]
BACKGROUND: Colour = (255, 255, 255)
TEXT: Colour = (30, 30, 30)
GRID: Colour = (200, 200, 200)

# ---- font --------------------------------------------------------------------
# Each block: a line naming up to 12 characters (one every 6 columns), then their
# 5x7 glyphs ('#' = ink) side by side. Row 6 is the baseline; characters in _DROP
# are drawn that many rows lower, into the 2 descender rows of a 9-row cell.
_FONT_ART = """
0     1     2     3     4     5     6     7     8     9     .     ,
.###. ..#.. .###. ##### ...#. ##### ..##. ##### .###. .###. ..... .....
#...# .##.. #...# ...#. ..##. #.... .#... ....# #...# #...# ..... .....
#..## ..#.. ....# ..#.. .#.#. ####. #.... ...#. #...# #...# ..... .....
#.#.# ..#.. ...#. ...#. #..#. ....# ####. ..#.. .###. .#### ..... .....
##..# ..#.. ..#.. ....# ##### ....# #...# .#... #...# ....# ..... .##..
#...# ..#.. .#... #...# ...#. #...# #...# .#... #...# ...#. .##.. ..#..
.###. .###. ##### .###. ...#. .###. .###. .#... .###. .##.. .##.. .#...
a     b     c     d     e     f     g     h     i     j     k     l
..... #.... ..... ....# ..... ..##. .#### #.... ..#.. ...#. #.... .##..
..... #.... ..... ....# ..... .#..# #...# #.... ..... ..... #.... ..#..
.###. #.##. .###. .##.# .###. .#... #...# #.##. .##.. ..##. #..#. ..#..
....# ##..# #.... #..## #...# ###.. #...# ##..# ..#.. ...#. #.#.. ..#..
.#### #...# #.... #...# ##### .#... .#### #...# ..#.. ...#. ##... ..#..
#...# #...# #...# #...# #.... .#... ....# #...# ..#.. #..#. #.#.. ..#..
.#### ####. .###. .#### .###. .#... .###. #...# .###. .##.. #..#. .###.
m     n     o     p     q     r     s     t     u     v     w     x
..... ..... ..... ####. .#### ..... ..... .#... ..... ..... ..... .....
..... ..... ..... #...# #...# ..... ..... .#... ..... ..... ..... .....
##.#. #.##. .###. #...# #...# #.##. .#### ###.. #...# #...# #...# #...#
#.#.# ##..# #...# #...# #...# ##..# #.... .#... #...# #...# #...# .#.#.
#.#.# #...# #...# ####. .#### #.... .###. .#... #...# #...# #.#.# ..#..
#.#.# #...# #...# #.... ....# #.... ....# .#..# #..## .#.#. #.#.# .#.#.
#.#.# #...# .###. #.... ....# #.... ####. ..##. .##.# ..#.. .#.#. #...#
y     z     A     B     C     D     E     F     G     H     I     J
#...# ..... .###. ####. .###. ###.. ##### ##### .###. #...# .###. ..###
#...# ..... #...# #...# #...# #..#. #.... #.... #...# #...# ..#.. ...#.
#...# ##### #...# #...# #.... #...# #.... #.... #.... #...# ..#.. ...#.
#...# ...#. #...# ####. #.... #...# ####. ####. #.### ##### ..#.. ...#.
.#### ..#.. ##### #...# #.... #...# #.... #.... #...# #...# ..#.. ...#.
....# .#... #...# #...# #...# #..#. #.... #.... #...# #...# ..#.. #..#.
.###. ##### #...# ####. .###. ###.. ##### #.... .#### #...# .###. .##..
K     L     M     N     O     P     Q     R     S     T     U     V
#...# #.... #...# #...# .###. ####. .###. ####. .#### ##### #...# #...#
#..#. #.... ##.## #...# #...# #...# #...# #...# #.... ..#.. #...# #...#
#.#.. #.... #.#.# ##..# #...# #...# #...# #...# #.... ..#.. #...# #...#
##... #.... #.#.# #.#.# #...# ####. #...# ####. .###. ..#.. #...# #...#
#.#.. #.... #...# #..## #...# #.... #.#.# #.#.. ....# ..#.. #...# #...#
#..#. #.... #...# #...# #...# #.... #..#. #..#. ....# ..#.. #...# .#.#.
#...# ##### #...# #...# .###. #.... .##.# #...# ####. ..#.. .###. ..#..
W     X     Y     Z     :     ;     =     /     (     )     -     _
#...# #...# #...# ##### ..... ..... ..... ..... ...#. .#... ..... .....
#...# #...# #...# ....# .##.. .##.. ..... ....# ..#.. ..#.. ..... .....
#...# .#.#. #...# ...#. .##.. .##.. ##### ...#. .#... ...#. ..... .....
#.#.# ..#.. .#.#. ..#.. ..... ..... ..... ..#.. .#... ...#. ##### .....
#.#.# .#.#. ..#.. .#... .##.. .##.. ##### .#... .#... ...#. ..... .....
#.#.# #...# ..#.. #.... .##.. ..#.. ..... #.... ..#.. ..#.. ..... .....
.#.#. #...# ..#.. ##### ..... .#... ..... ..... ...#. .#... ..... #####
%     +     [     ]     #     ?     !     '     *     <     >     |
##... ..... .###. .###. .#.#. .###. ..#.. ..#.. ..... ...#. .#... ..#..
##..# ..#.. .#... ...#. .#.#. #...# ..#.. ..#.. ..#.. ..#.. ..#.. ..#..
...#. ..#.. .#... ...#. ##### ....# ..#.. .#... #.#.# .#... ...#. ..#..
..#.. ##### .#... ...#. .#.#. ...#. ..#.. ..... .###. #.... ....# ..#..
.#... ..#.. .#... ...#. ##### ..#.. ..#.. ..... #.#.# .#... ...#. ..#..
#..## ..#.. .#... ...#. .#.#. ..... ..... ..... ..#.. ..#.. ..#.. ..#..
...## ..... .###. .###. .#.#. ..#.. ..#.. ..... ..... ...#. .#... ..#..
"""
_DROP = {",": 2, "g": 2, "p": 2, "q": 2, "y": 2, "j": 1, "_": 1}
_UNKNOWN = np.array([[c == "#" for c in row] for row in
                     (".....", "#####", "#...#", "#...#", "#...#", "#####", ".....")])


def _parse_font(art: str) -> dict[str, np.ndarray]:
    lines = art.strip("\n").split("\n")
    font = {" ": np.zeros((7, 5), bool)}
    for b in range(0, len(lines), 8):
        for i, ch in enumerate(lines[b][::6]):
            font[ch] = np.array([[c == "#" for c in row[6 * i:6 * i + 5]]
                                 for row in lines[b + 1:b + 8]])
    return font


FONT = _parse_font(_FONT_ART)
SCALE = 2                     # pixels per font dot
CHAR_W = 6 * SCALE            # advance: 5 dots + 1 of spacing
CHAR_H = 9 * SCALE            # line height: 7 rows + 2 descender rows
CAP_H = 7 * SCALE


def text_width(text: str) -> int:
    return max(0, len(text) * CHAR_W - SCALE)


def draw_text(image: np.ndarray, x: int, y: int, text: str, colour: Colour = TEXT) -> None:
    """Draw ``text`` with its cell's top-left corner at (x, y), clipped to the image."""
    h, w, _ = image.shape
    for i, ch in enumerate(text):
        dots = np.kron(FONT.get(ch, _UNKNOWN), np.ones((SCALE, SCALE), bool))
        gx, gy = x + i * CHAR_W, y + _DROP.get(ch, 0) * SCALE
        xa, xb = max(gx, 0), min(gx + dots.shape[1], w)
        ya, yb = max(gy, 0), min(gy + dots.shape[0], h)
        if xa < xb and ya < yb:
            image[ya:yb, xa:xb][dots[ya - gy:yb - gy, xa - gx:xb - gx]] = colour


# ---- PNG -------------------------------------------------------------------------
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(path: str, image: np.ndarray) -> None:
    """Write an (H, W, 3) uint8 array as an 8-bit RGB PNG."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"need an (H, W, 3) uint8 array, got {image.dtype} {image.shape}")
    h, w, _ = image.shape
    raw = np.zeros((h, 1 + 3 * w), np.uint8)  # each row: filter type 0, then RGB bytes
    raw[:, 1:] = image.reshape(h, 3 * w)
    with open(path, "wb") as f:
        f.write(PNG_SIGNATURE
                + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + _chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
                + _chunk(b"IEND", b""))


def read_png(path: str) -> np.ndarray:
    """Read a PNG as write_png writes it (8-bit RGB, filter 0) into an (H, W, 3) array."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError(f"{path}: not a PNG")
    pos, header, idat = len(PNG_SIGNATURE), b"", b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        if zlib.crc32(kind + body) != crc:
            raise ValueError(f"{path}: bad CRC in {kind!r} chunk")
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, colour_type, *methods = struct.unpack(">IIBBBBB", header)
    if (depth, colour_type, *methods) != (8, 2, 0, 0, 0):
        raise ValueError(f"{path}: only 8-bit RGB without interlace is supported")
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    if raw[:, 0].any():
        raise ValueError(f"{path}: only filter type 0 is supported")
    return raw[:, 1:].reshape(h, w, 3).copy()


# ---- timeline ------------------------------------------------------------------------
MARGIN = 12
LANE_H = 30                   # one lane per row; a span's bar leaves BAR_INSET above and below
BAR_INSET = 4
LEGEND_BOX = CAP_H


class Layout(NamedTuple):
    """Where render_timeline puts things: time runs over columns [plot_x0, plot_x1),
    row i's lane over image rows [lanes_y0 + i * LANE_H, lanes_y0 + (i + 1) * LANE_H)."""
    height: int
    plot_x0: int
    plot_x1: int
    lanes_y0: int
    axis_y: int
    legend_xy: list[tuple[int, int]]  # top-left of each legend entry's colour box

    def x(self, t: float, t0: float, t1: float) -> float:
        return self.plot_x0 + (t - t0) / (t1 - t0) * (self.plot_x1 - self.plot_x0)


def layout(rows: list[str], legend: list[str], title: str = "", width: int = 1200) -> Layout:
    plot_x0 = MARGIN + max(map(text_width, rows), default=0) + 2 * MARGIN
    plot_x1 = width - MARGIN
    if plot_x1 - plot_x0 < 50:
        raise ValueError(f"width {width} leaves no room for the time axis")
    lanes_y0 = MARGIN + (CHAR_H + 10 if title else 0)
    axis_y = lanes_y0 + len(rows) * LANE_H
    legend_y = axis_y + 8 + CHAR_H + 10
    legend_xy, x, y = [], MARGIN, legend_y
    for name in legend:
        entry_w = LEGEND_BOX + 6 + text_width(name)
        if x > MARGIN and x + entry_w > width - MARGIN:
            x, y = MARGIN, y + CHAR_H + 6
        legend_xy.append((x, y))
        x += entry_w + 3 * CHAR_W
    height = (y + CHAR_H if legend else legend_y - 10) + MARGIN
    return Layout(height, plot_x0, plot_x1, lanes_y0, axis_y, legend_xy)


def _ticks(span: float, max_ticks: int) -> tuple[list[float], int]:
    """Tick positions 0, step, 2 step, ... <= span with step 1, 2 or 5 times a power
    of ten giving at most max_ticks intervals, and the decimals their labels need."""
    raw = span / max_ticks
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))
    return ([k * step for k in range(int(span / step + 1e-9) + 1)],
            max(0, -math.floor(math.log10(step) + 1e-9)))


def _span_colour(colour: int) -> Colour:
    return PALETTE[colour % len(PALETTE)]


def render_timeline(path: str, rows: list[str], spans: list[tuple[int, float, float, int]],
                    legend: list[str], title: str = "", width: int = 1200,
                    t0: float | None = None, t1: float | None = None) -> None:
    """rows: one label per row (e.g. "device 0"); spans: (row index, start seconds,
    end seconds, colour index) -- colour index picks a distinct colour and names the
    legend entry legend[colour index]; t0/t1 the time range shown (default: min
    start / max end). Writes an RGB PNG: title at the top, a label column at the
    left, one horizontal lane per row with a filled rectangle per span, a time axis
    with a few tick labels in seconds (relative to t0), and a legend (colour box +
    text) at the bottom."""
    for row, _, _, _ in spans:
        if not 0 <= row < len(rows):
            raise ValueError(f"span row {row} is not one of the {len(rows)} rows")
    t0 = min((s for _, s, _, _ in spans), default=0.0) if t0 is None else t0
    t1 = max((e for _, _, e, _ in spans), default=t0 + 1.0) if t1 is None else t1
    if t1 <= t0:
        t1 = t0 + 1.0
    lay = layout(rows, legend, title, width)
    image = np.empty((lay.height, width, 3), np.uint8)
    image[:] = BACKGROUND
    if title:
        draw_text(image, MARGIN, MARGIN, title)

    # lanes: a frame, separators, labels, then the bars
    image[lay.lanes_y0 - 1, lay.plot_x0 - 1:lay.plot_x1 + 1] = GRID
    image[lay.lanes_y0 - 1:lay.axis_y, [lay.plot_x0 - 1, lay.plot_x1]] = GRID
    for i, label in enumerate(rows):
        top = lay.lanes_y0 + i * LANE_H
        if i:
            image[top, lay.plot_x0:lay.plot_x1] = GRID
        draw_text(image, MARGIN, top + (LANE_H - CAP_H) // 2, label)
    for row, start, end, colour in spans:
        if end < t0 or start > t1:
            continue
        xa = min(round(lay.x(max(start, t0), t0, t1)), lay.plot_x1 - 1)
        xb = max(xa + 1, round(lay.x(min(end, t1), t0, t1)))
        ya = lay.lanes_y0 + row * LANE_H + BAR_INSET
        yb = ya + LANE_H - 2 * BAR_INSET
        rgb = _span_colour(colour)
        if xb - xa >= 3:  # a darker outline keeps back-to-back bars of one colour apart
            image[ya:yb, xa:xb] = [c * 6 // 10 for c in rgb]
            image[ya + 1:yb - 1, xa + 1:xb - 1] = rgb
        else:
            image[ya:yb, xa:xb] = rgb

    # time axis, labelled in seconds since t0
    image[lay.axis_y, lay.plot_x0 - 1:lay.plot_x1 + 1] = TEXT
    ticks, decimals = _ticks(t1 - t0, max(1, (lay.plot_x1 - lay.plot_x0) // 150))
    for rel in ticks:
        x = min(round(lay.x(t0 + rel, t0, t1)), lay.plot_x1 - 1)
        image[lay.axis_y:lay.axis_y + 6, x] = TEXT
        label = f"{rel:.{decimals}f}s"
        lx = min(max(x - text_width(label) // 2, 0), width - text_width(label))
        draw_text(image, lx, lay.axis_y + 8, label)

    for (x, y), name, colour in zip(lay.legend_xy, legend, range(len(legend))):
        image[y:y + LEGEND_BOX, x:x + LEGEND_BOX] = _span_colour(colour)
        draw_text(image, x + LEGEND_BOX + 6, y, name)
    write_png(path, image)


def _demo(path: str) -> None:
    legend = ["compile", "host->device", "compute", "all-reduce", "device->host"]
    rows = [f"host {h} / device {d}" for h in range(2) for d in range(2)]
    spans = []
    for row in range(len(rows)):
        t = 0.002 * row
        spans.append((row, t, t + 0.030, 0))
        t += 0.031
        for step in range(6):
            spans.append((row, t, t + 0.004, 1))
            spans.append((row, t + 0.004, t + 0.016 + 0.002 * ((row + step) % 3), 2))
            spans.append((row, t + 0.022, t + 0.026, 3))
            t += 0.027
        spans.append((row, t, t + 0.006, 4))
    render_timeline(path, rows, spans, legend,
                    title="Demo: 6 steps on 2 hosts x 2 devices (t0 = first compile)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTPUT.png")
    _demo(sys.argv[1])
    print(f"wrote {sys.argv[1]}")
