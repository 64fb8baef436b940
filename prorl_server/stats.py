"""Summary statistics shared by the server's reports and the benchmarks (standard library only).

One percentile definition for the whole project, so that a p95 printed by ``prorl-run`` and one printed by a
benchmark mean the same thing.
"""
from __future__ import annotations

import math
from statistics import StatisticsError
from typing import Iterable


def percentile(data: Iterable[float], q: float) -> float:
    """The ``q``-th percentile of ``data`` by the nearest-rank method: the smallest observed value that at
    least ``q`` percent of the values are less than or equal to, i.e. the value of rank ``ceil(q / 100 * n)``
    (1-based) in sorted order; ``q == 0`` gives the minimum, ``q == 100`` the maximum. The answer is always one
    of the observations (no interpolation), in the unit of ``data``.

    ``data``: any iterable of numbers (need not be sorted; it is consumed once). ``q``: 0 to 100 inclusive.
    Raises ``ValueError`` for ``q`` outside [0, 100] or not finite, and :class:`statistics.StatisticsError`
    (a ``ValueError``) for empty ``data``.

    >>> percentile([15, 20, 35, 40, 50], 30), percentile([15, 20, 35, 40, 50], 50), percentile([3, 1, 2], 100)
    (20, 35, 3)
    """
    if not (0.0 <= q <= 100.0):  # also refuses NaN
        raise ValueError(f"percentile q must be within [0, 100], got {q!r}")
    xs = sorted(data)
    if not xs:
        raise StatisticsError("percentile of no data")
    rank = math.ceil(q * len(xs) / 100.0)  # q * n first: exact for whole q, so 95 % of 20 is rank 19
    return xs[max(rank, 1) - 1]
