"""The canary's old reward rule, kept only to show why it was replaced (issue 13): Welch's
two-sample t-test, a fixed-sample test, applied at every 30 s look and promoting on the first
p < 0.05 (tests/test_canary.py measures how often that promotes a candidate that is no
better). The exact Student t tail via the regularized incomplete beta function, no scipy."""

from __future__ import annotations

import math

from evolution.canary import _mean_std


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, eps = 1e-300, 3e-14
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                + a * math.log(x) + b * math.log1p(-x))
    front = math.exp(ln_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def student_t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with `df` degrees of freedom (exact, via the incomplete
    beta function; no scipy)."""
    if math.isinf(t):
        return 0.0
    return _betai(df / 2.0, 0.5, df / (df + t * t))


def welch_t_test(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(t, Welch–Satterthwaite df, two-sided p) for mean(b) - mean(a). Both need >= 2 values.
    Zero variance in both arms: p = 0 when the means differ, 1 when they are equal."""
    ma, sa = _mean_std(a)
    mb, sb = _mean_std(b)
    assert ma is not None and mb is not None and sa is not None and sb is not None
    va, vb = sa * sa / len(a), sb * sb / len(b)
    se2 = va + vb
    if se2 == 0:
        return (math.copysign(math.inf, mb - ma) if mb != ma else 0.0,
                float(len(a) + len(b) - 2), 0.0 if mb != ma else 1.0)
    t = (mb - ma) / math.sqrt(se2)
    df = se2 * se2 / ((va * va / (len(a) - 1) if va else 0.0)
                      + (vb * vb / (len(b) - 1) if vb else 0.0))
    return t, df, student_t_two_sided_p(t, df)


def welch_p(n_a: int, mean_a: float, var_a: float, n_b: int, mean_b: float,
            var_b: float) -> float:
    """Two-sided Welch p-value for mean_b - mean_a from summary statistics (sample
    variances); as welch_t_test, without the lists."""
    va, vb = var_a / n_a, var_b / n_b
    se2 = va + vb
    if se2 == 0:
        return 0.0 if mean_b != mean_a else 1.0
    t = (mean_b - mean_a) / math.sqrt(se2)
    df = se2 * se2 / ((va * va / (n_a - 1) if va else 0.0)
                      + (vb * vb / (n_b - 1) if vb else 0.0))
    return student_t_two_sided_p(t, df)
