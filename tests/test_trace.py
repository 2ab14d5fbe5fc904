"""Loader.trace(): Chrome Trace Event JSON that loads, spans that nest on every track, a
track per stage thread, part-pool thread and CUDA stream, counters, flow arrows from each
batch's read to the consumer; torch.profiler sees the wait in next()."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections import defaultdict

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.sample import make_image_tree

from test_stats import AddOne, Sleep, npy, tree

EPS_US = 0.01  # rounding of ts and dur to nanoseconds


def load(path):
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    assert all(e["ph"] in "XCMstf" for e in events)
    return events


def check_nesting(events):
    """On every track (pid, tid) the spans nest: each one lies inside the span open when
    it starts, or starts after that span ends."""
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for track, spans in tracks.items():
        open_spans: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_spans and start >= open_spans[-1][1] - EPS_US:
                open_spans.pop()
            if open_spans:
                assert end <= open_spans[-1][1] + EPS_US, f"{name} {start}-{end} crosses {open_spans[-1]} on {track}"
            open_spans.append((start, end, name))
    return tracks


def names_of_threads(events):
    return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}


def inside_a_span(point, tracks):
    return any(s <= point["ts"] <= e for s, e, _ in tracks[(point["pid"], point["tid"])])


def test_trace_of_n_batches_tracks_counters_flows(tmp_path):
    index = tree(tmp_path / "t", n=48)
    ld = gpuio.Loader(index, 4, ops=[Sleep(0.003)], threads=2, output="numpy")
    path = tmp_path / "trace.json"
    ld.trace(path, batches=5)
    for k, _ in enumerate(ld):
        if k == 7:  # written once the fifth batch was taken, before the pass ends
            assert path.exists()
    events = load(path)
    tracks = check_nesting(events)
    threads = names_of_threads(events)
    spans = [e for e in events if e["ph"] == "X"]
    waits = [e for e in spans if e["name"] == "next"]
    assert len(waits) == 5
    assert {threads[e["tid"]] for e in waits} == {threading.current_thread().name}
    workers = {threads[e["tid"]] for e in spans if e["name"] == "Sleep"}
    assert workers and all(n.startswith("gpuio-loader0-Sleep-") for n in workers)
    assert {threads[e["tid"]] for e in spans if e["name"] == "read"} == {"gpuio-loader0-read-0"}
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"queue before Sleep", "queue before read", "bytes in flight"} <= counters
    # every batch the consumer took: a flow from its read span, through Sleep, to the wait
    flows = defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            flows[e["id"]].append(e)
            assert inside_a_span(e, tracks)
    taken = [e["args"]["batch"] for e in waits]
    for seq in taken:  # read -> Sleep -> hand-off (the consumer's thread) -> next
        points = sorted(flows[seq], key=lambda e: e["ts"])
        assert [p["ph"] for p in points] == ["s", "t", "t", "f"] and points[-1]["bp"] == "e"
        assert [threads[p["tid"]] for p in points] == [
            "gpuio-loader0-read-0", threads[points[1]["tid"]], threading.current_thread().name,
            threading.current_thread().name]
        assert threads[points[1]["tid"]].startswith("gpuio-loader0-Sleep")
    hand_offs = [e for e in spans if e["name"] == "hand-off"]
    assert len(hand_offs) == 5 and all(threads[e["tid"]] == threading.current_thread().name for e in hand_offs)


def test_trace_at_construction_and_an_inline_pass_nest(tmp_path):
    """trace= captures the first pass (written at its end, fewer than 100 batches); a
    read-only pass on the consumer's thread has its read spans inside the waits."""
    index = tree(tmp_path / "t")
    path = tmp_path / "first.json"
    ld = gpuio.Loader(index, 4, output="numpy", trace=path)
    list(ld)
    events = load(path)
    check_nesting(events)
    assert sum(e["name"] == "next" for e in events if e["ph"] == "X") == len(ld)
    again = tmp_path / "inline.json"
    ld.trace(again, batches=3)
    list(ld)
    assert ld.stats()["inline"]  # the consumer did nothing in the first pass: this one ran inline
    events = load(again)
    tracks = check_nesting(events)
    me = threading.get_native_id()
    mine = [s for s in tracks[(events[0]["pid"], me)]]
    assert {"read", "next"} <= {name for _, _, name in mine}
    waits = [(s, e) for s, e, name in mine if name == "next"]
    reads = [(s, e) for s, e, name in mine if name == "read"]
    assert all(any(ws <= rs and re <= we + EPS_US for ws, we in waits) for rs, re in reads[1:4])


def test_parts_of_the_op_pool_are_tracks(tmp_path):
    root = make_image_tree(tmp_path / "jpg", count=16, classes=2, progress=False)
    chain = ops.Compose([ops.decode_image(), ops.random_resized_crop(64), ops.flip()])
    path = tmp_path / "jpeg.json"
    with gpuio.config.override(decode_parts=2):  # a loader takes the value in force when it is made
        ld = gpuio.Loader(gpuio.formats.filetree(root), 8, fields=("data",), ops=[chain], output="numpy")
    ld.trace(path, batches=2)
    got = [b["image"].shape for b in ld]
    assert got == [(8, 64, 64, 3)] * 2
    events = load(path)
    check_nesting(events)
    threads = names_of_threads(events)
    parts = [e for e in events if e["ph"] == "X" and e["cat"] == "part"]
    assert parts and all(threads[e["tid"]].startswith("gpuio-ops") for e in parts)


def test_torch_profiler_sees_the_wait_in_next(tmp_path):
    torch = pytest.importorskip("torch")
    ld = gpuio.Loader(tree(tmp_path / "t"), 4, ops=[Sleep(0.001)], output="torch")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        n = sum(1 for _ in ld)
    waits = [e for e in prof.events() if e.name == "gpuio.Loader.next"]
    assert len(waits) == n == len(ld)


def test_bad_batches_is_a_config_error(tmp_path):
    ld = gpuio.Loader(tree(tmp_path / "t"), 4, output="numpy")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(gpuio.errors.ConfigError, match="batches must be a positive integer"):
            ld.trace(tmp_path / "x.json", batches=bad)


def test_cuda_streams_are_tracks(tmp_path, device):
    """The same body on the CPU and a GPU: the batches agree, and on a GPU each GPU stage's
    device time is a track of its own, whose spans do not overlap."""
    index = npy(tmp_path / "n")
    ld = gpuio.Loader(index, 4, ops=[AddOne()], device=device, output="numpy")
    path = tmp_path / "gpu.json"
    ld.trace(path, batches=len(ld))
    for k, b in enumerate(ld):
        data = b["data"]
        data = data.get() if hasattr(data, "get") else data
        np.testing.assert_array_equal(data[:, 0, 0], np.arange(4 * k, 4 * k + 4) + 1)
    time.sleep(0.1)
    events = load(path)
    check_nesting(events)
    streams = {tid: name for tid, name in names_of_threads(events).items() if name.startswith("CUDA stream")}
    if device == "cpu":
        assert not streams
    else:
        assert "CUDA stream of AddOne" in streams.values()
        assert any(e["ph"] == "X" and e["cat"] == "gpu" for e in events)


def test_the_nesting_check_refuses_crossing_spans():
    span = {"ph": "X", "pid": 1, "tid": 2, "name": "a", "cat": "stage"}
    check_nesting([{**span, "ts": 0, "dur": 10}, {**span, "ts": 2, "dur": 3}, {**span, "ts": 10, "dur": 1}])
    with pytest.raises(AssertionError, match="crosses"):
        check_nesting([{**span, "ts": 0, "dur": 10}, {**span, "ts": 5, "dur": 10}])


def test_a_capture_never_run_leaves_no_watcher(tmp_path):
    from gpuio.ops import _cpu_pool

    before = _cpu_pool.part_watchers()
    ld = gpuio.Loader(tree(tmp_path / "t"), 4, output="numpy", trace=tmp_path / "never.json")
    assert _cpu_pool.part_watchers() == before + 1
    del ld
    gc.collect()
    assert _cpu_pool.part_watchers() == before and not (tmp_path / "never.json").exists()
