"""The statistics of scorecards and comparisons (pure, standard library only).

- `wilson`: the Wilson score interval of a proportion (Wilson 1927; Newcombe 1998, method 3).
- `difference_interval`: the paired bootstrap interval of a mean difference (normal beyond
  `BOOTSTRAP_MAX_N` pairs).
- `mean_interval`: the 95 % interval of a mean — Wilson when every value is 0 or 1 (a proportion),
  a seeded percentile bootstrap up to `BOOTSTRAP_MAX_N` values, the normal approximation beyond
  (where the bootstrap and it agree and the bootstrap would only cost time).
- `mcnemar_exact`: the exact (binomial) McNemar test on the discordant pairs of paired pass/fail
  outcomes.
- `wilcoxon_signed_rank`: the Wilcoxon signed-rank test on paired differences (zeros dropped;
  exact distribution up to 50 pairs without ties, the tie-corrected normal approximation
  otherwise — SciPy's `wilcoxon` defaults).
- `benjamini_hochberg`: false-discovery-rate q-values over a family of p-values.
- `pass_at_k`: the unbiased pass@k estimator of Chen et al. (2021) for n trials with c passes.

Every random draw comes from a `random.Random` seeded by a string the caller names (a metric),
so the same data always gives the same interval, in any process.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from statistics import NormalDist, fmean, stdev
from typing import Literal

CONFIDENCE = 0.95
"""Every interval is a 95 % interval."""
Z95 = NormalDist().inv_cdf(0.5 + CONFIDENCE / 2)
"""The standard normal quantile of a two-sided 95 % interval (1.95996…)."""
BOOTSTRAP_RESAMPLES = 2000
"""Resamples of a bootstrap interval."""
BOOTSTRAP_MAX_N = 500
"""Largest sample a bootstrap interval is drawn for; beyond it the normal approximation is used."""
WILCOXON_EXACT_MAX_N = 50
"""Largest number of non-zero differences the exact signed-rank distribution is used for."""

_NORMAL = NormalDist()

IntervalMethod = Literal["wilson", "bootstrap", "normal"]
"""How `mean_interval` computed an interval."""


def wilson(successes: int, n: int, *, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of `successes` out of `n` (n > 0)."""
    if n <= 0:
        raise ValueError("a proportion needs n > 0")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be between 0 and n ({successes} of {n})")
    p = successes / n
    z2 = z * z
    denominator = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values by linear interpolation (NumPy's default)."""
    position = q * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def bootstrap_interval(
    values: Sequence[float], seed: str, *, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (seeded by `seed`)."""
    n = len(values)
    if n == 0:
        raise ValueError("a mean needs at least one value")
    if min(values) == max(values):
        return float(values[0]), float(values[0])
    rng = random.Random(f"evalbus-bootstrap:{seed}:{n}")
    population = list(values)
    means = sorted(sum(rng.choices(population, k=n)) / n for _ in range(resamples))
    alpha = 1 - CONFIDENCE
    return _quantile(means, alpha / 2), _quantile(means, 1 - alpha / 2)


def normal_interval(values: Sequence[float]) -> tuple[float, float]:
    """mean ± z·s/√n (for large samples)."""
    n = len(values)
    if n == 0:
        raise ValueError("a mean needs at least one value")
    mean = fmean(values)
    if n == 1:
        return mean, mean
    half = Z95 * stdev(values) / math.sqrt(n)
    return mean - half, mean + half


def is_binary(values: Sequence[float]) -> bool:
    """Every value is 0 or 1."""
    return all(v in (0.0, 1.0) for v in values)


def mean_interval(values: Sequence[float], seed: str) -> tuple[float, float, IntervalMethod]:
    """The 95 % interval of the mean of `values` and its method: `wilson` (0/1 values),
    `bootstrap` (up to `BOOTSTRAP_MAX_N` values) or `normal`."""
    if not values:
        raise ValueError("a mean needs at least one value")
    if is_binary(values):
        low, high = wilson(sum(1 for v in values if v == 1.0), len(values))
        return low, high, "wilson"
    if len(values) <= BOOTSTRAP_MAX_N:
        low, high = bootstrap_interval(values, seed)
        return low, high, "bootstrap"
    low, high = normal_interval(values)
    return low, high, "normal"


def difference_interval(differences: Sequence[float], seed: str) -> tuple[float, float, IntervalMethod]:
    """The 95 % interval of the mean of paired differences: a seeded percentile bootstrap over the
    pairs up to `BOOTSTRAP_MAX_N` of them, the normal approximation beyond."""
    if len(differences) <= BOOTSTRAP_MAX_N:
        low, high = bootstrap_interval(differences, f"delta:{seed}")
        return low, high, "bootstrap"
    low, high = normal_interval(differences)
    return low, high, "normal"


def mcnemar_exact(base_only: int, candidate_only: int) -> float:
    """Two-sided exact McNemar p-value: the binomial test of `base_only` against `candidate_only`
    discordant pairs (pairs where only one side passed) with p = 1/2. 1.0 without discordance."""
    if base_only < 0 or candidate_only < 0:
        raise ValueError("counts must not be negative")
    n = base_only + candidate_only
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(base_only, candidate_only) + 1))
    return min(1.0, 2 * tail / (1 << n))


def _ranks(magnitudes: Sequence[float]) -> tuple[list[float], list[int]]:
    """Average ranks (1-based) of `magnitudes` and the sizes of their tie groups."""
    order = sorted(range(len(magnitudes)), key=lambda i: magnitudes[i])
    ranks = [0.0] * len(magnitudes)
    ties: list[int] = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and magnitudes[order[j + 1]] == magnitudes[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        ties.append(j - i + 1)
        i = j + 1
    return ranks, ties


def _signed_rank_counts(n: int) -> list[int]:
    """counts[t] = subsets of {1..n} whose sum is t (the exact null distribution of W+ × 2^n)."""
    counts = [1] + [0] * (n * (n + 1) // 2)
    top = 0
    for rank in range(1, n + 1):
        top += rank
        for total in range(top, rank - 1, -1):
            counts[total] += counts[total - rank]
    return counts


def wilcoxon_signed_rank(differences: Sequence[float]) -> tuple[float, float]:
    """The Wilcoxon signed-rank test of paired `differences` against a zero median: the statistic
    min(W+, W−) and the two-sided p-value. Zero differences are dropped (Wilcoxon's method); with
    none left the p-value is 1."""
    nonzero = [d for d in differences if d != 0]
    n = len(nonzero)
    if n == 0:
        return 0.0, 1.0
    ranks, ties = _ranks([abs(d) for d in nonzero])
    w_plus = sum(r for r, d in zip(ranks, nonzero, strict=True) if d > 0)
    w_minus = n * (n + 1) / 2 - w_plus
    statistic = min(w_plus, w_minus)
    if n <= WILCOXON_EXACT_MAX_N and all(t == 1 for t in ties):
        counts = _signed_rank_counts(n)
        tail = sum(counts[: int(statistic) + 1])
        return statistic, min(1.0, 2 * tail / (1 << n))
    mean = n * (n + 1) / 4
    variance = n * (n + 1) * (2 * n + 1) / 24 - sum(t**3 - t for t in ties) / 48
    if variance <= 0:
        return statistic, 1.0
    z = (statistic - mean) / math.sqrt(variance)
    return statistic, min(1.0, 2 * _NORMAL.cdf(-abs(z)))


def benjamini_hochberg(p_values: Sequence[float]) -> list[float]:
    """Benjamini–Hochberg q-values (adjusted p-values) in the order of `p_values`: the smallest
    false discovery rate at which each hypothesis would be rejected."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    q = [1.0] * m
    running = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, p_values[i] * m / rank)
        q[i] = min(1.0, running)
    return q


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` trials of which `c` passed (n ≥ k):
    1 − C(n−c, k) / C(n, k), the chance that k trials drawn without replacement hold a pass."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} needs at least {k} trials (has {n})")
    if not 0 <= c <= n:
        raise ValueError(f"passes must be between 0 and n ({c} of {n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
