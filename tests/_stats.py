"""Shared statistics for the exactness tests (chi-square goodness of fit, binomial tests).

Conventions used by every statistical test in this suite:
  * fixed seeds, so every run draws the same numbers (a test either always passes or always fails);
  * "passes"  = p-value > P_PASS  (1e-4);
  * "rejects" = p-value < P_FAIL  (1e-6) -- asserted for the deliberately wrong samplers,
    which proves each test has the power to catch the bug it is meant to catch.
"""
from __future__ import annotations

import numpy as np
from scipy import stats

P_PASS = 1e-4
P_FAIL = 1e-6


def counts(tokens, vocab: int) -> np.ndarray:
    """Histogram of int token ids in [0, vocab)."""
    t = np.asarray(tokens, dtype=np.int64).ravel()
    assert t.size == 0 or (t.min() >= 0 and t.max() < vocab), f"token ids out of range: {t.min()}..{t.max()}"
    return np.bincount(t, minlength=vocab).astype(np.float64)


def chisquare_gof(observed, probs) -> tuple[float, float, int]:
    """Pearson chi-square goodness of fit of ``observed`` counts to ``probs``.

    Cells of zero probability must be empty: any count there is an impossible outcome and
    returns p = 0 (stat = inf). Cells are otherwise kept separately (tests use small V and
    >= 100k draws, so every expected count is large). Returns (stat, p_value, dof).
    """
    obs = np.asarray(observed, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    p = p / p.sum()
    n = obs.sum()
    zero = p <= 0
    if obs[zero].sum() > 0:
        return float("inf"), 0.0, int((~zero).sum()) - 1
    obs, exp = obs[~zero], n * p[~zero]
    dof = obs.size - 1
    if dof == 0:
        return 0.0, 1.0, 0
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, float(stats.chi2.sf(stat, dof)), dof


def chisquare_conditional(joint_observed, cond_probs) -> tuple[float, float, int]:
    """Chi-square test that, for every row a, the counts ``joint_observed[a, :]`` follow
    ``cond_probs[a, :]`` (the row sums are taken as given). The per-row statistics are
    independent given the row totals, so their sum is chi-square with the summed dof."""
    obs = np.asarray(joint_observed, dtype=np.float64)
    total_stat, total_dof = 0.0, 0
    for a in range(obs.shape[0]):
        if obs[a].sum() == 0:
            continue
        s, p, d = chisquare_gof(obs[a], cond_probs[a])
        if p == 0.0 and s == float("inf"):
            return float("inf"), 0.0, total_dof + d
        total_stat += s
        total_dof += d
    if total_dof == 0:
        return 0.0, 1.0, 0
    return total_stat, float(stats.chi2.sf(total_stat, total_dof)), total_dof


def binomial_p(successes: int, trials: int, prob: float) -> float:
    """Two-sided exact binomial test p-value."""
    prob = float(min(max(prob, 0.0), 1.0))
    return float(stats.binomtest(int(successes), int(trials), prob).pvalue)


def poisson_binomial_z_p(successes: int, probs) -> float:
    """Two-sided normal-approximation p-value for a sum of independent Bernoulli(probs)."""
    pr = np.asarray(probs, dtype=np.float64)
    mean, var = pr.sum(), (pr * (1 - pr)).sum()
    if var == 0:
        return 1.0 if abs(successes - mean) < 0.5 else 0.0
    z = (successes - mean) / np.sqrt(var)
    return float(2 * stats.norm.sf(abs(z)))
