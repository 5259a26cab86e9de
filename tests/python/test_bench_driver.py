"""The benchmark driver's comparison within one placement of the CPUs (bench/run_bench.py)."""

import os
import sys
import types

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
run_bench = pytest.importorskip("run_bench")


def rounds(lib_times):
    """Merged results from [(median seconds, placement), ...] per round."""
    return run_bench.merge_rounds([{"status": "ok", "median_s": t, "placement": st}
                                   for t, st in lib_times])


def test_speedup_compares_rounds_in_one_placement():
    # Over all rounds fbn (1.0) is behind the anchor (0.55), but fbn ran mostly far and the
    # anchor mostly near: within either placement fbn is ahead (near 0.55 / 0.5, far 1.05 / 1.0).
    f = rounds([(1.0, "far"), (1.0, "far"), (0.5, "near")])
    a = rounds([(0.55, "near"), (0.55, "near"), (1.05, "far"), (0.3, "mixed")])
    assert a["median_s"] / f["median_s"] < 1.0
    speedup, state, ft, at = run_bench.matched(f, a)
    assert state == "near"  # three rounds either way: the first of near, far
    assert (ft, at) == (0.5, 0.55)
    assert speedup == pytest.approx(1.1)


def test_speedup_prefers_the_placement_with_more_rounds():
    f = rounds([(1.0, "far"), (0.5, "near"), (0.5, "near")])
    a = rounds([(1.2, "far"), (0.4, "near"), (0.4, "near")])
    speedup, state, _, _ = run_bench.matched(f, a)
    assert state == "near"
    assert speedup == pytest.approx(0.8)


def test_speedup_without_a_shared_placement_uses_all_rounds():
    f = rounds([(1.0, "near"), (1.0, "near"), (2.0, "busy")])
    a = rounds([(3.0, "far"), (3.0, "mixed"), (3.0, "far")])
    speedup, state, ft, at = run_bench.matched(f, a)
    assert state == "all"
    assert (ft, at) == (1.0, 3.0)
    assert speedup == pytest.approx(3.0)


def test_single_round_keeps_its_placement():
    f = rounds([(1.0, "near")])
    assert f["by_placement"] == {"near": (1.0, 1)}


def test_placement_state_of_a_batch():
    runner = types.SimpleNamespace(args=types.SimpleNamespace(placement_split_ns=250.0))
    state = lambda b, a: run_bench.Runner.placement_state(runner, b, a)  # noqa: E731
    assert state(100, 110) == "near"
    assert state(500, 480) == "far"
    assert state(100, 500) == "mixed"
    assert state(100, 37000) == "busy"
    assert state(None, 100) is None


def test_best_anchor_is_the_one_fbn_is_least_ahead_of():
    c = {"id": "x", "pass": "fwd_train", "dtype": "f32", "layout": "nhwc", "cache": "warm",
         "n": 1, "c": 8, "h": 2, "w": 2}
    results = {
        run_bench.bc.bench_name("fbn", c): rounds([(1.0, "near"), (2.0, "far")]),
        # Faster than fbn over all rounds, slower within each placement.
        run_bench.bc.bench_name("onednn", c): rounds([(1.1, "near"), (2.2, "far"), (0.5, "mixed")]),
        run_bench.bc.bench_name("torch", c): rounds([(1.5, "near"), (2.5, "far")]),
    }
    vs, best = run_bench.case_speedup(c, results, ["fbn", "onednn", "torch"])
    assert best == "onednn"
    assert vs["onednn"][0] == pytest.approx(1.1)
