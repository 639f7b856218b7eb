"""Tests of benchmarks/plots.py (matplotlib, the ``bench`` extra): each figure is a
readable image whose drawn elements sit where the data says, with the colours
the legend names."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

mpl_image = pytest.importorskip("matplotlib.image", reason="matplotlib (the bench extra) is not installed")
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plots  # noqa: E402  (benchmarks/ is not a package)

pytestmark = pytest.mark.timeout(60)

LANES = ["device 0", "device 1"]
LEGEND = ["client 1", "client 2", "client 3"]
SPANS = [(0, 0.0, 1.0, 0), (0, 2.0, 3.0, 1), (1, 1.0, 4.0, 2)]


def bars(fig) -> list[Rectangle]:
    ax = fig.axes[0]
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def pixel_at(fig, path: Path, x: float, y: float) -> tuple[float, float, float]:
    """The colour of the written image at data point (x, y) of the first axes."""
    image = mpl_image.imread(str(path))
    px, py = fig.axes[0].transData.transform((x, y))
    row = image.shape[0] - 1 - int(round(py))            # image rows go down
    return tuple(float(v) for v in image[row, int(round(px)), :3])


def close(a, b, tol=0.02) -> bool:
    return all(abs(p - q) <= tol for p, q in zip(a, b, strict=True))


def test_timeline_bars_sit_on_their_lanes_with_their_colours(tmp_path):
    path = tmp_path / "t.png"
    fig = plots.timeline(str(path), LANES, SPANS, LEGEND, title="two devices", t0=0.0, t1=4.0)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    drawn = sorted((round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_width(), to_rgb(b.get_facecolor()))
                   for b in bars(fig))
    want = sorted((lane, start * 1e3, (end - start) * 1e3, to_rgb(plots.colour(c)))
                  for lane, start, end, c in SPANS)
    assert len(drawn) == len(want)
    for d, w in zip(drawn, want, strict=True):
        assert d[0] == w[0] and d[1] == pytest.approx(w[1]) and d[2] == pytest.approx(w[2])
        assert close(d[3], w[3], 1e-6)
    # the pixels: a bar's middle has its colour, the gap between bars is background
    for lane, start, end, c in SPANS:
        assert close(pixel_at(fig, path, (start + end) / 2 * 1e3, lane), to_rgb(plots.colour(c)))
    assert close(pixel_at(fig, path, 1500.0, 0), (1.0, 1.0, 1.0))
    assert close(pixel_at(fig, path, 500.0, 1), (1.0, 1.0, 1.0))
    # lanes top to bottom, the legend names every colour
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == LANES
    assert fig.axes[0].get_ylim()[0] > fig.axes[0].get_ylim()[1]
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == LEGEND
    assert [to_rgb(h.get_facecolor()) for h in legend.legend_handles] == [to_rgb(plots.colour(k)) for k in range(3)]
    assert fig.axes[0].get_title() == "two devices"


def test_timeline_clips_to_its_window(tmp_path):
    spans = [(0, -1.0, 0.5, 0),   # starts before t0
             (0, 0.8, 5.0, 1),    # ends after t1
             (1, 2.0, 3.0, 2),    # entirely after t1: not drawn
             (1, 0.5, 0.5, 3)]    # zero width: still drawn, as an edge
    fig = plots.timeline(str(tmp_path / "c.png"), LANES, spans, LEGEND + ["client 4"], t0=0.0, t1=1.0)
    got = sorted(v for b in bars(fig) for v in [(b.get_x(), b.get_x() + b.get_width())])
    assert np.allclose(got, [(0.0, 500.0), (500.0, 500.0), (800.0, 1000.0)])
    assert fig.axes[0].get_xlim() == pytest.approx((0.0, 1000.0))


def test_timeline_colours_wrap_and_bad_lanes_are_refused(tmp_path):
    fig = plots.timeline(str(tmp_path / "w.png"), LANES, [(0, 0.0, 1.0, len(plots.PALETTE) + 3)], [])
    assert to_rgb(bars(fig)[0].get_facecolor()) == to_rgb(plots.PALETTE[3])
    assert not fig.legends
    plots.timeline(str(tmp_path / "e.png"), LANES, [], [])          # nothing to draw: still a picture
    assert (tmp_path / "e.png").stat().st_size > 0
    with pytest.raises(ValueError, match="lane 2"):
        plots.timeline(str(tmp_path / "x.png"), LANES, [(2, 0.0, 1.0, 0)], [])


def test_palette_colours_are_distinct():
    colours = np.array([to_rgb(c) for c in plots.PALETTE]) * 255
    distances = np.linalg.norm(colours[:, None] - colours[None], axis=-1)
    assert len(plots.PALETTE) >= 10 and distances[~np.eye(len(colours), dtype=bool)].min() > 60


def test_shares_draws_share_and_target_per_client_per_policy(tmp_path):
    rows = [{"client": 1, "weight": 1.0, "share": 0.07, "target": 1 / 15},
            {"client": 2, "weight": 8.0, "share": 0.5, "target": 8 / 15}]
    fifo = [{"client": 1, "weight": 1.0, "share": 0.5, "target": 1 / 15},
            {"client": 2, "weight": 8.0, "share": 0.5, "target": 8 / 15}]
    fig = plots.shares(str(tmp_path / "s.png"), {"share": rows, "fifo": fifo})
    assert [ax.get_title() for ax in fig.axes] == ["share", "fifo"]
    for ax, rs in zip(fig.axes, (rows, fifo), strict=True):
        heights = [b.get_height() for b in ax.patches]
        assert heights == pytest.approx([100 * r["share"] for r in rs])
        targets = ax.collections[0].get_offsets()[:, 1]
        assert list(targets) == pytest.approx([100 * r["target"] for r in rs])
        assert [t.get_text() for t in ax.get_xticklabels()] == ["client 1\nweight 1", "client 2\nweight 8"]


def test_throughput_lines_per_path_and_dcn_panel(tmp_path):
    sizes = [1 << 10, 1 << 20, 1 << 28]
    series = {"shm": [0.01, 3.0, 14.0], "tcp": [0.005, 0.6, 0.7]}
    fig = plots.throughput(str(tmp_path / "x.png"), sizes, series, [(1.0, 0.99), (4.0, 3.8)])
    ici, dcn = fig.axes[:2]
    assert ici.get_xscale() == "log" and ici.get_yscale() == "log"
    assert [line.get_label() for line in ici.get_lines()] == ["shm", "tcp"]
    for line, values in zip(ici.get_lines(), series.values(), strict=True):
        assert list(line.get_xdata()) == sizes and list(line.get_ydata()) == values
    achieved = [line for line in dcn.get_lines() if line.get_label() == "achieved"][0]
    assert list(achieved.get_ydata()) == [0.99, 3.8]
    only_dcn = plots.throughput(str(tmp_path / "d.png"), [], {}, [(1.0, 0.9)])
    assert only_dcn.axes[0].get_title().startswith("DCN")
    with pytest.raises(ValueError, match="2 values for 3 sizes"):
        plots.throughput(str(tmp_path / "y.png"), sizes, {"shm": [1.0, 2.0]})
    with pytest.raises(ValueError, match="nothing to draw"):
        plots.throughput(str(tmp_path / "z.png"), [], {})


def test_dispatch_bars_and_ratio_labels(tmp_path):
    fig = plots.dispatch(str(tmp_path / "d.png"), ["-O", "-F"], [2000.0, 30000.0], [4000.0, 32000.0],
                         [(0.45, 0.55), (0.9, 0.97)])
    ax = fig.axes[0]
    assert [b.get_height() for b in ax.patches] == [2000.0, 30000.0, 4000.0, 32000.0]
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["0.50x\n(0.45-0.55)", "0.94x\n(0.90-0.97)"]
    assert ax.get_yscale() == "log"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["zpath", "JAX multi-controller"]


def test_trace_draws_every_track_slice_and_flow(tmp_path):
    doc = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1001, "args": {"name": "host 1 b (island 1)"}},
        {"ph": "M", "name": "process_name", "pid": 1000, "args": {"name": "host 0 a (island 0)"}},
        {"ph": "M", "name": "process_sort_index", "pid": 1000, "args": {"sort_index": 0}},
        {"ph": "M", "name": "process_sort_index", "pid": 1001, "args": {"sort_index": 1}},
        {"ph": "M", "name": "thread_name", "pid": 1000, "tid": 0, "args": {"name": "device 0"}},
        {"ph": "M", "name": "thread_name", "pid": 1000, "tid": 9, "args": {"name": "transfers out"}},
        {"ph": "M", "name": "thread_name", "pid": 1001, "tid": 1, "args": {"name": "device 1"}},
        {"ph": "X", "name": "f", "pid": 1000, "tid": 0, "ts": 0.0, "dur": 2000.0},
        {"ph": "X", "name": "DCN 8 B -> host 1", "pid": 1000, "tid": 9, "ts": 2000.0, "dur": 500.0},
        {"ph": "X", "name": "g", "pid": 1001, "tid": 1, "ts": 2500.0, "dur": 1000.0},
        {"ph": "s", "id": 5, "name": "transfer", "pid": 1000, "tid": 9, "ts": 2000.0},
        {"ph": "f", "id": 5, "bp": "e", "name": "transfer", "pid": 1001, "tid": 1, "ts": 2500.0}]}
    fig = plots.trace(str(tmp_path / "trace.png"), doc)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "host 0 a (island 0): device 0", "host 0 a (island 0): transfers out", "host 1 b (island 1): device 1"]
    drawn = sorted((round(b.get_y() + b.get_height() / 2), b.get_x(), b.get_width()) for b in bars(fig))
    assert drawn == [(0, 0.0, 2.0), (1, 2.0, 0.5), (2, 2.5, 1.0)]
    arrows = [a for a in ax.texts if getattr(a, "arrow_patch", None) is not None]
    assert len(arrows) == 1 and arrows[0].xy == (2.5, 2) and arrows[0].xyann == (2.0, 1)
    assert (tmp_path / "trace.png").stat().st_size > 0


def test_scale_draws_throughput_busy_computation_and_pipelines_against_hosts(tmp_path):
    def result(hosts: int, busy: float | None) -> dict:
        return {"hosts": hosts, "spmd_nodes_per_s": 1000 / hosts, "traced_nodes_per_s": 800 / hosts,
                "fused_computations_per_s": 128000 / hosts, "min_busy_computation_ms": busy,
                "ctl_bound_min_computation_ms": hosts / 50, "pipeline_stages": min(hosts, 64),
                "pipeline_runs_per_s": {"parallel": 900 / min(hosts, 64), "sequential": 300 / min(hosts, 64)}}
    results = [result(8, 2.3), result(64, 20.0), result(512, None)]     # 512: never busy enough
    fig = plots.scale(str(tmp_path / "s.png"), results)
    assert (tmp_path / "s.png").stat().st_size > 0
    dispatch, busy, pipeline = fig.axes[:3]
    assert [line.get_label() for line in dispatch.get_lines()] == [
        "-O (op by op)", "-C (traced program)", "-F (128 per call)"]
    assert list(dispatch.get_lines()[0].get_ydata()) == [125.0, 1000 / 64, 1000 / 512]
    lines = {line.get_label(): line for line in busy.get_lines()}
    assert list(lines["measured (hosts share 2 cores)"].get_xdata()) == [8, 64]      # no rung met at 512
    assert list(lines["controller alone (CPU per node / 0.95)"].get_ydata()) == [8 / 50, 64 / 50, 512 / 50]
    assert list(lines["Pathways paper (TPU)"].get_ydata()) == [2.3, 35.0]
    par = [line for line in pipeline.get_lines() if line.get_label() == "parallel dispatch"][0]
    assert list(par.get_xdata()) == [8, 64, 64] and list(par.get_ydata()) == [900.0, 900.0, 900.0]
    with pytest.raises(ValueError, match="nothing to draw"):
        plots.scale(str(tmp_path / "e.png"), [])
