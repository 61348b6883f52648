"""The benchmarks' one percentile, median, interleaved loop and markdown table (kvx.testing.bench_timing): the
numbers mean what the copies they replaced meant."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from kvx.testing.bench_timing import md_table, median, percentile, time_interleaved


def test_linear_percentile_is_statistics_inclusive_quantiles_to_the_bit():
    rng = random.Random(0)
    for n in range(2, 40):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        ref = statistics.quantiles(xs, n=100, method="inclusive")
        assert [percentile(xs, p) for p in range(1, 100)] == ref
        s = sorted(xs)
        assert (percentile(xs, 0), percentile(xs, 100)) == (s[0], s[-1])
        for q in (50, 90, 99.5):  # bench_serving's former floor/ceil interpolation
            k = (n - 1) * q / 100
            lo, hi = math.floor(k), math.ceil(k)
            assert percentile(xs, q) == pytest.approx(s[lo] + (s[hi] - s[lo]) * (k - lo), rel=1e-12)


def test_rank_percentile_is_the_sample_at_floor_n_p():
    rng = random.Random(1)
    for n in range(1, 40):
        xs = [rng.random() for _ in range(n)]
        s = sorted(xs)
        for q in (0.5, 0.9, 0.99):  # bench_node's and bench_cluster_scale's former xs[min(n - 1, int(q * n))]
            assert percentile(xs, round(q * 100), "rank") == s[min(n - 1, int(q * n))]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50, "rank") == 3.0  # the upper of the middle two


def test_edges():
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([], 50, "rank"))
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        percentile([1.0], 50, "nearest")
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert math.isnan(median([])) and median([None], None) is None


def test_rotated_order_and_indices():
    seen, after = [], []
    fns = {m: (lambda i, m=m: seen.append((m, i))) for m in "abc"}
    times = time_interleaved(fns, repeats=3, warmup=1, after=lambda m, i: after.append((m, i)), order="rotate")
    # repeat r (from -1) runs the methods rotated left by r
    assert "".join(m for m, _ in seen) == "cab" + "abc" + "bca" + "cab"
    assert [i for _, i in seen] == list(range(12)) and after == seen
    assert all(len(t) == 3 for t in times.values())
    with pytest.raises(ValueError):
        time_interleaved(fns, 1, order="random")


def test_md_table():
    assert md_table(["a", "b", "c"], [(1, "x", 2.5)], "lr") == ["| a | b | c |", "|---|---:|---|", "| 1 | x | 2.5 |"]
