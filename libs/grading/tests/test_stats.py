"""The statistics against published values and by their properties.

Known values: the Wilson intervals of Newcombe (1998, "Two-sided confidence intervals for the
single proportion", Table I, method 3); the Wilcoxon signed-rank p-value of SciPy's `wilcoxon`
documentation example (Darwin's paired plants, as differences) and of R's `wilcox.test` example
(Hollander & Wolfe's depression scores); the Benjamini–Hochberg example of their 1995 paper (15
p-values, 4 rejected at 0.05); McNemar and pass@k values worked out by hand.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evalbus_grading.stats import (
    BOOTSTRAP_MAX_N,
    Z95,
    benjamini_hochberg,
    bootstrap_interval,
    mcnemar_exact,
    mean_interval,
    pass_at_k,
    wilcoxon_signed_rank,
    wilson,
)

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- Wilson


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_matches_newcombe_table_1(successes: int, n: int, low: float, high: float) -> None:
    got = wilson(successes, n)
    assert got[0] == pytest.approx(low, abs=5e-5)
    assert got[1] == pytest.approx(high, abs=5e-5)


def test_wilson_bounds_are_exact_at_the_edges_and_z_is_the_95_quantile() -> None:
    assert wilson(0, 7)[0] == 0.0
    assert wilson(7, 7)[1] == 1.0
    assert pytest.approx(1.959964, abs=1e-6) == Z95
    with pytest.raises(ValueError, match="n > 0"):
        wilson(0, 0)
    with pytest.raises(ValueError, match="between 0 and n"):
        wilson(4, 3)


@given(st.integers(1, 2000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_holds_the_proportion_inside_0_1(case: tuple[int, int]) -> None:
    successes, n = case
    low, high = wilson(successes, n)
    assert 0.0 <= low <= successes / n <= high <= 1.0
    assert high - low <= 2 * Z95 / math.sqrt(n)  # never wider than the Wald interval at p = 1/2


# ---------------------------------------------------------------- McNemar


def test_mcnemar_exact_known_values() -> None:
    assert mcnemar_exact(1, 6) == pytest.approx(2 * (1 + 7) / 2**7)  # 0.125
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 2**6)  # 0.03125
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(0, 1) == 1.0


@given(st.integers(0, 60), st.integers(0, 60))
def test_mcnemar_is_the_two_sided_binomial_test(b: int, c: int) -> None:
    n = b + c
    brute = min(Fraction(1), 2 * sum(Fraction(math.comb(n, i), 2**n) for i in range(min(b, c) + 1))) if n else 1
    assert mcnemar_exact(b, c) == pytest.approx(float(brute), rel=1e-12)
    assert mcnemar_exact(b, c) == mcnemar_exact(c, b)
    assert 0.0 < mcnemar_exact(b, c) <= 1.0


# ---------------------------------------------------------------- Wilcoxon signed-rank


def test_wilcoxon_matches_scipy_documentation_example() -> None:
    d = [6, 8, 14, 16, 23, 24, 28, 29, 41, -48, 49, 56, 60, -67, 75]
    assert wilcoxon_signed_rank(d) == (24.0, 0.041259765625)


def test_wilcoxon_matches_r_wilcox_test_example() -> None:
    x = [1.83, 0.50, 1.62, 2.48, 1.68, 1.88, 1.55, 3.06, 1.30]
    y = [0.878, 0.647, 0.598, 2.05, 1.06, 1.29, 1.06, 3.14, 1.29]
    statistic, p = wilcoxon_signed_rank([a - b for a, b in zip(x, y, strict=True)])
    assert statistic == 5.0  # V = 40 = 45 - 5
    assert p == pytest.approx(2 * 0.01953, abs=1e-4)  # R: one-sided p-value = 0.01953


def _brute_wilcoxon(d: list[float]) -> float:
    nonzero = [x for x in d if x != 0]
    n = len(nonzero)
    ranks = {abs(x): r for r, x in enumerate(sorted(nonzero, key=abs), start=1)}
    observed = min(sum(ranks[abs(x)] for x in nonzero if x > 0), sum(ranks[abs(x)] for x in nonzero if x < 0))
    extreme = 0
    for signs in itertools.product((1, -1), repeat=n):
        w_plus = sum(r for r, s in zip(range(1, n + 1), signs, strict=True) if s > 0)
        extreme += min(w_plus, n * (n + 1) // 2 - w_plus) <= observed
    return min(1.0, extreme / (1 << n))


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=11, unique_by=abs))
def test_wilcoxon_exact_p_is_the_enumerated_sign_flip_distribution(d: list[int]) -> None:
    assert wilcoxon_signed_rank([float(x) for x in d])[1] == pytest.approx(_brute_wilcoxon([float(x) for x in d]))


@given(st.lists(st.floats(-10, 10, allow_nan=False, allow_infinity=False), max_size=80))
def test_wilcoxon_is_symmetric_and_identical_pairs_are_never_significant(d: list[float]) -> None:
    _, p = wilcoxon_signed_rank(d)
    assert 0.0 < p <= 1.0
    assert wilcoxon_signed_rank([-x for x in d])[1] == pytest.approx(p)
    assert wilcoxon_signed_rank([0.0] * len(d)) == (0.0, 1.0)


def test_wilcoxon_normal_approximation_agrees_with_the_exact_one_past_50_pairs() -> None:
    d = [(-1) ** (i % 3) * (i + 1) for i in range(51)]
    statistic, approx = wilcoxon_signed_rank(d)  # 51 pairs: the approximation
    z = (statistic - 51 * 52 / 4) / math.sqrt(51 * 52 * 103 / 24)
    assert approx == pytest.approx(1 + math.erf(z / math.sqrt(2)))  # 2·Φ(z), z < 0
    exact = wilcoxon_signed_rank(d[:50])[1]  # 50 pairs: the exact distribution
    z50 = (wilcoxon_signed_rank(d[:50])[0] - 50 * 51 / 4) / math.sqrt(50 * 51 * 101 / 24)
    assert exact == pytest.approx(1 + math.erf(z50 / math.sqrt(2)), abs=0.005)
    tied = wilcoxon_signed_rank([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0])  # ties: approximation
    # W- = 4.5 (average rank), mean 18, variance 51 - 8·63/48 = 40.5
    assert tied[0] == 4.5
    assert tied[1] == pytest.approx(2 * (1 - 0.5 * (1 + math.erf((18 - 4.5) / math.sqrt(40.5) / math.sqrt(2)))))


# ---------------------------------------------------------------- Benjamini–Hochberg


def test_benjamini_hochberg_1995_example_rejects_four() -> None:
    p = [0.0001, 0.0004, 0.0019, 0.0095, 0.0201, 0.0278, 0.0298, 0.0344, 0.0459, 0.3240, 0.4262, 0.5719, 0.6528]
    p += [0.7590, 1.000]
    q = benjamini_hochberg(p)
    assert [x <= 0.05 for x in q] == [True] * 4 + [False] * 11
    assert q[0] == pytest.approx(0.0001 * 15)
    assert q[3] == pytest.approx(0.0095 * 15 / 4)
    assert q[5] == q[6] == pytest.approx(0.0298 * 15 / 7)  # step-up: the 6th takes the 7th's value
    assert q[-1] == 1.0


@given(st.lists(st.floats(0, 1), max_size=30))
def test_benjamini_hochberg_q_values_are_monotone_bounds(p: list[float]) -> None:
    q = benjamini_hochberg(p)
    assert len(q) == len(p)
    for pi, qi in zip(p, q, strict=True):
        assert pi <= qi + 1e-12
        assert qi <= 1.0
    by_p = [q[i] for i in sorted(range(len(p)), key=lambda i: p[i])]
    assert by_p == sorted(by_p)
    assert benjamini_hochberg(list(reversed(p))) == list(reversed(q))


# ---------------------------------------------------------------- pass@k


def test_pass_at_k_known_values() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # only 4 failures: any 5 trials hold a pass
    assert pass_at_k(3, 1, 3) == 1.0
    with pytest.raises(ValueError, match="at least 4 trials"):
        pass_at_k(3, 1, 4)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_is_c_over_n_at_1_and_grows_with_k(case: tuple[int, int]) -> None:
    n, c = case
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
    assert values == sorted(values)
    assert values[-1] == (1.0 if c else 0.0)


# ---------------------------------------------------------------- intervals of means


def test_mean_interval_is_wilson_for_0_1_values_and_a_seeded_bootstrap_otherwise() -> None:
    binary = [1.0, 0.0, 1.0, 1.0]
    assert mean_interval(binary, "m") == (*wilson(3, 4), "wilson")
    values = [0.1, 0.5, 0.3, 0.9, 0.2, 0.4]
    low, high, method = mean_interval(values, "m")
    assert method == "bootstrap"
    assert min(values) <= low < sum(values) / len(values) < high <= max(values)
    assert mean_interval(values, "m") == (low, high, method)  # deterministic
    assert bootstrap_interval(values, "other") != (low, high)  # the seed is the metric's
    assert mean_interval([2.5, 2.5, 2.5], "m") == (2.5, 2.5, "bootstrap")


def test_mean_interval_beyond_the_bootstrap_limit_is_the_normal_approximation() -> None:
    values = [float(i % 7) for i in range(BOOTSTRAP_MAX_N + 1)]
    low, high, method = mean_interval(values, "m")
    assert method == "normal"
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    assert (low, high) == pytest.approx(
        (mean - Z95 * sd / math.sqrt(len(values)), mean + Z95 * sd / math.sqrt(len(values)))
    )
    # the bootstrap of the same values says nearly the same
    boot = bootstrap_interval(values, "m")
    assert boot == pytest.approx((low, high), abs=0.05)
