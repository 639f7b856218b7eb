"""Tests of benchmarks/timeline_png.py: the PNG encoder/decoder and the pixels a
rendered timeline puts where its layout says."""
from __future__ import annotations

import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import timeline_png as tp  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.timeout(60)

ROWS = ["device 0", "device 1"]
LEGEND = ["compute", "transfer", "all-reduce"]
# (row, start, end, colour): t0 = 0, t1 = 4 by default
SPANS = [(0, 0.0, 1.0, 0), (0, 2.0, 3.0, 1), (1, 1.0, 4.0, 2)]


def chunks(data: bytes) -> list[tuple[bytes, bytes, int]]:
    """(kind, body, stored CRC) of every chunk after the signature."""
    out, pos = [], len(tp.PNG_SIGNATURE)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        out.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n], crc))
        pos += 12 + n
    assert pos == len(data)
    return out


def pixel(image: np.ndarray, x: float, y: float) -> tuple[int, ...]:
    return tuple(int(v) for v in image[int(y), int(x)])


def lane_mid(lay: tp.Layout, row: int) -> int:
    return lay.lanes_y0 + row * tp.LANE_H + tp.LANE_H // 2


def render(tmp_path: Path, spans=SPANS, **kw) -> np.ndarray:
    path = str(tmp_path / "t.png")
    tp.render_timeline(path, ROWS, spans, LEGEND, **kw)
    return tp.read_png(path)


def test_round_trip(tmp_path):
    image = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    tp.write_png(str(tmp_path / "r.png"), image)
    back = tp.read_png(str(tmp_path / "r.png"))
    assert back.dtype == np.uint8 and np.array_equal(back, image)


def test_rejects_non_rgb_uint8(tmp_path):
    with pytest.raises(ValueError):
        tp.write_png(str(tmp_path / "x.png"), np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError):
        tp.write_png(str(tmp_path / "x.png"), np.zeros((4, 4), np.uint8))


def test_signature_header_and_crcs(tmp_path):
    image = np.zeros((5, 9, 3), np.uint8)
    image[2, 3] = (1, 2, 3)
    tp.write_png(str(tmp_path / "s.png"), image)
    data = (tmp_path / "s.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    found = chunks(data)
    assert [kind for kind, _, _ in found] == [b"IHDR", b"IDAT", b"IEND"]
    for kind, body, crc in found:
        assert zlib.crc32(kind + body) == crc, kind
    assert struct.unpack(">IIBBBBB", found[0][1]) == (9, 5, 8, 2, 0, 0, 0)
    raw = zlib.decompress(found[1][1])
    assert len(raw) == 5 * (1 + 3 * 9) and raw[::1 + 3 * 9] == bytes(5)  # filter 0 per row
    assert found[2][1] == b""


def test_read_png_detects_corruption(tmp_path):
    tp.write_png(str(tmp_path / "c.png"), np.zeros((3, 3, 3), np.uint8))
    data = bytearray((tmp_path / "c.png").read_bytes())
    data[-20] ^= 0xFF  # inside the IDAT body
    (tmp_path / "c.png").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        tp.read_png(str(tmp_path / "c.png"))


def test_spans_have_their_colours(tmp_path):
    image = render(tmp_path, title="two devices")
    lay = tp.layout(ROWS, LEGEND, "two devices")
    assert image.shape == (lay.height, 1200, 3)
    for row, start, end, colour in SPANS:
        x = (lay.x(start, 0, 4) + lay.x(end, 0, 4)) / 2
        assert pixel(image, x, lane_mid(lay, row)) == tp.PALETTE[colour]
    # lane 0 between its two spans, and lane 1 before its span, are empty
    assert pixel(image, lay.x(1.5, 0, 4), lane_mid(lay, 0)) == tp.BACKGROUND
    assert pixel(image, lay.x(0.5, 0, 4), lane_mid(lay, 1)) == tp.BACKGROUND
    # each legend entry's box has its colour
    for colour, (x, y) in enumerate(lay.legend_xy):
        assert pixel(image, x + tp.LEGEND_BOX // 2, y + tp.LEGEND_BOX // 2) == tp.PALETTE[colour]


def test_colour_index_wraps(tmp_path):
    image = render(tmp_path, spans=[(0, 0.0, 1.0, len(tp.PALETTE) + 3)])
    lay = tp.layout(ROWS, LEGEND)
    assert pixel(image, lay.x(0.5, 0, 1), lane_mid(lay, 0)) == tp.PALETTE[3]


def test_palette_colours_are_distinct():
    assert len(tp.PALETTE) >= 10
    colours = np.array(tp.PALETTE, float)
    distances = np.linalg.norm(colours[:, None] - colours[None], axis=-1)
    assert distances[~np.eye(len(colours), dtype=bool)].min() > 60


def test_text_draws_in_the_title_area(tmp_path):
    titled = render(tmp_path, title="Timeline: 2 devices (test_run #1)")
    band = titled[tp.MARGIN:tp.MARGIN + tp.CHAR_H]
    assert (band != tp.BACKGROUND).any(axis=-1).sum() > 100
    other = render(tmp_path, title="Another title, same length......")
    assert not np.array_equal(band, other[tp.MARGIN:tp.MARGIN + tp.CHAR_H])


def test_font_covers_the_required_characters():
    required = ("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                " .,:;=/()-_%+[]#")
    assert set(required) <= set(tp.FONT)
    assert all(glyph.shape == (7, 5) for glyph in tp.FONT.values())
    assert all(tp.FONT[ch].any() for ch in required if ch != " ")
    assert len({tp.FONT[ch].tobytes() for ch in "abcdefghijklmnopqrstuvwxyz"}) == 26


def test_unknown_character_draws_a_box():
    image = np.full((tp.CHAR_H, tp.CHAR_W, 3), 255, np.uint8)
    tp.draw_text(image, 0, 0, "\u00e9")
    assert (image != 255).any()


def test_text_is_clipped_at_the_edges():
    image = np.full((10, 20, 3), 255, np.uint8)
    tp.draw_text(image, -7, -5, "clipped text")  # no IndexError
    assert (image != 255).any()


def test_clipping_to_t0_t1(tmp_path):
    spans = [(0, -1.0, 0.5, 0),   # starts before t0
             (0, 0.8, 5.0, 1),    # ends after t1
             (1, 2.0, 3.0, 2),    # entirely after t1: not drawn
             (1, 0.5, 0.5, 3)]    # zero width: still 1 pixel
    image = render(tmp_path, spans=spans, t0=0.0, t1=1.0)
    lay = tp.layout(ROWS, LEGEND)
    y0, y1 = lane_mid(lay, 0), lane_mid(lay, 1)
    lanes = image[lay.lanes_y0:lay.axis_y]

    def columns(colour: int, y: int) -> np.ndarray:
        return np.flatnonzero((image[y] == tp.PALETTE[colour]).all(axis=-1))

    first, second = columns(0, y0), columns(1, y0)
    assert first.min() == lay.plot_x0 + 1  # inside the bar's 1-pixel outline
    assert second.max() == lay.plot_x1 - 2
    assert pixel(image, lay.plot_x1 + 2, y0) == tp.BACKGROUND
    assert not (lanes == tp.PALETTE[2]).all(axis=-1).any()
    zero = columns(3, y1)
    assert len(zero) >= 1 and abs(zero.mean() - lay.x(0.5, 0, 1)) <= 1


def test_defaults_and_bad_rows(tmp_path):
    image = render(tmp_path, spans=[(0, 10.0, 10.0, 0)])  # a single instant: still a picture
    assert image.shape[1] == 1200
    render(tmp_path, spans=[])
    with pytest.raises(ValueError, match="row 2"):
        render(tmp_path, spans=[(2, 0.0, 1.0, 0)])
