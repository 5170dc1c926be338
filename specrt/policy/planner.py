"""The budget policy's pure planner: prices, per-request tables, the throughput search.

No state: everything it needs is passed in, so it is tested against brute force
(tests/test_policy.py) and reused by the off verdict's re-checks.

Draft token k of request b is worth ``fill_b * r_b,1 * ... * r_b,k`` expected tokens (r_b,i: its
acceptance at position i given the ones before it were accepted; fill_b: the share of asked
tokens its drafter proposes) and costs one more verified token, one more token fed to the draft
and its attention over the context. A request that drafts at all also pays its draft's catch-up
(the context its draft KV lags behind) spread over the steps it has left. The step pays one
draft forward per depth, plus once whatever a drafted step costs over a plain one.
"""
from __future__ import annotations

from dataclasses import dataclass

from specrt.config import clamp_k


@dataclass(frozen=True)
class Prices:
    """What the cost model predicts for one batch (seconds)."""

    t_plain: float      # a plain (autoregressive) step of the whole batch
    per_verify: float   # one more verified token
    d_fwd: float        # one draft forward (paid per depth)
    d_jump: float       # a drafted step's jump over a plain one (paid once)
    d_tok: float        # one token fed to the draft
    d_ctx: float        # per context token one draft forward attends

    @staticmethod
    def of(costs, num_requests: int, context: float) -> "Prices":
        n = num_requests
        t_ar = costs.verify_time(n, context, drafted=False, requests=n)
        t_drafted = costs.verify_time(n, context, drafted=True, requests=n)
        per_verify = max(costs.verify_time(n + 1, context, drafted=True, requests=n) - t_drafted, 0.0)
        d_fwd, d_tok, d_ctx = costs.draft_coefs(n, context)
        return Prices(t_ar, per_verify, d_fwd, max(t_drafted - t_ar, 0.0), d_tok, d_ctx)

    def per_token(self, context_len: int) -> float:
        """What one drafted token of a request with this context costs (verify + feed + attend)."""
        return self.per_verify + self.d_tok + self.d_ctx * context_len


@dataclass
class Row:
    """One request's prices for k = 0..max_k draft tokens."""

    gains: list[float]   # [max_k+1] expected accepted tokens (gains[0] = 0)
    costs: list[float]   # [max_k+1] seconds they add to the step (costs[0] = 0)


@dataclass
class SurplusRow:
    """One request's verdict at a threshold throughput ``lam`` (see BudgetPolicy's off verdict)."""

    max_k: int
    lam: float              # the threshold it was priced at
    surplus: list[float]    # [D] max(0, best gain - lam * cost over k <= min(d, max_k)) at each depth d
    reach: list[float]      # [D] the largest cost over k <= min(d, max_k)


@dataclass
class Allocation:
    """The search's answer: draft tokens per request and what they are predicted to deliver."""

    ks: list[int]           # [B]
    rate: float             # predicted tokens per second of the step with these ks
    plain: float            # the same for the floor allocation (plain decoding when the floor is 0)


def price_row(rate: float, profile, max_k: int, fill: float, left: float, lag: int, per_token: float,
              d_tok: float, max_rate: float) -> Row:
    """Row of a request with acceptance ``rate`` shaped per position by ``profile`` [K+1]
    (capped at ``max_rate``), ``left`` tokens to go and a draft KV ``lag`` tokens behind."""
    gains, costs = [0.0], [0.0]
    total, power = 0.0, 1.0
    for k in range(1, max_k + 1):
        power *= min(rate * float(profile[k]), max_rate)
        total += power
        gain = total * fill
        gains.append(gain)
        costs.append(k * per_token * fill + d_tok * lag / max(left / (1.0 + gain), 1.0))
    return Row(gains, costs)


def step_prediction(rows: list[Row], ks: list[int], prices: Prices) -> tuple[float, float]:
    """(tokens, seconds) a step drafting ``ks`` is predicted to deliver."""
    depth = max(ks)
    tokens = len(ks) + sum(row.gains[k] for row, k in zip(rows, ks))
    seconds = (prices.t_plain + sum(row.costs[k] for row, k in zip(rows, ks)) + prices.d_fwd * depth
               + (prices.d_jump if depth else 0.0))
    return float(tokens), float(max(seconds, 1e-12))


def search(rows: list[Row], max_ks: list[int], floor: list[int], prices: Prices, rounds: int) -> Allocation:
    """The allocation of draft tokens with the best predicted throughput (tokens / step time),
    each request within [floor, max_k]. Depth by depth (the step pays per draft forward, so the
    deepest request sets a fixed cost): Dinkelbach rounds from the best throughput so far, each
    the best k per request at throughput lam (max gain - lam * cost), until it stops improving."""
    best_ks = list(floor)
    tokens, seconds = step_prediction(rows, best_ks, prices)
    best = plain = tokens / seconds
    for depth in range(max(max(floor), 1), max(max_ks) + 1):
        lam = best
        for _ in range(rounds):
            choice = []
            for row, lo, max_k in zip(rows, floor, max_ks):
                g, c = row.gains, row.costs
                kb, vb = lo, g[lo] - lam * c[lo]
                for k in range(lo + 1, clamp_k(depth, max_k) + 1):
                    v = g[k] - lam * c[k]
                    if v > vb:
                        kb, vb = k, v
                choice.append(kb)
            tokens, seconds = step_prediction(rows, choice, prices)
            val = tokens / seconds
            if val <= lam * (1 + 1e-9):
                break
            lam = val
            if val > best * (1 + 1e-9):
                best, best_ks = val, choice
    return Allocation(best_ks, best, plain)


def surplus_row(row: Row, max_k: int, lam: float, depths: int) -> SurplusRow:
    surplus, reach = [0.0], [0.0]
    best = worst = 0.0
    for k in range(1, depths):
        if k <= max_k:
            best = max(best, row.gains[k] - lam * row.costs[k])
            worst = max(worst, row.costs[k])
        surplus.append(best)
        reach.append(worst)
    return SurplusRow(max_k, lam, surplus, reach)


def zero_row(lam: float, depths: int) -> SurplusRow:
    """The verdict of a request that cannot draft (max_k 0)."""
    return SurplusRow(0, lam, [0.0] * depths, [0.0] * depths)
