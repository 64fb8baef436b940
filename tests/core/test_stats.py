"""prorl_server.stats.percentile: the one percentile definition of the server's reports and the benchmarks."""
from __future__ import annotations

import statistics

import pytest

from prorl_server.stats import percentile


def test_nearest_rank_is_an_observation_at_rank_ceil_q_n():
    xs = [35, 20, 15, 50, 40]  # unsorted on purpose
    assert [percentile(xs, q) for q in (0, 5, 30, 40, 50, 100)] == [15, 15, 20, 20, 35, 50]
    # 95 % of 20 values is rank 19 exactly (no floating-point step to rank 20); 99 % of 100 is rank 99.
    assert percentile(range(1, 21), 95) == 19 and percentile(range(1, 101), 99) == 99
    assert percentile([1, 2, 3, 4], 50) == 2  # an observation, not the interpolated median 2.5
    assert percentile(iter([7.5]), 99.9) == 7.5  # any iterable, any q in [0, 100]


@pytest.mark.parametrize("q", [-0.1, 100.1, float("nan"), float("inf")])
def test_q_outside_0_100_is_refused(q):
    with pytest.raises(ValueError, match="within \\[0, 100\\]"):
        percentile([1.0], q)


def test_no_data_is_an_error_not_a_number():
    with pytest.raises(statistics.StatisticsError):
        percentile([], 50)
