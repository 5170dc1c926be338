"""Pure-torch reference of every specrt op: the test oracle and the CPU fallback.

Each function here is the *specification* of the op of the same name in
:mod:`specrt.ops` (docs/architecture.md section 2). The random numbers are computed with
the same Philox4x32-10 counter layout and the same float32 operation sequence
as ``csrc/include/specrt/{philox,sampling}.h``, so the compiled kernels return
*identical tokens* for identical inputs; probabilities from
:func:`probs_from_logits` agree to float rounding (``exp`` and reduction order
differ between libraries).

Nothing here is fast; the point is to be obviously right.
"""
from __future__ import annotations

import torch

# the linear ops' references (float and quantized) live in their own module; re-exported here
from specrt.ops.reference_linear import (QUANT_GROUP, dequantize_weight, interleave_quant_weight,  # noqa: F401
                                         linear, linear_amx_order, quant_linear, quant_linear_dynamic,
                                         quantize_activations,
                                         unpack_q4)
# the cache and decoder-layer ops' references (KV copies and writes, paged attention, fused ops)
from specrt.ops.reference_layers import (copy_blocks, copy_slots, paged_attention, rms_norm,  # noqa: F401
                                         rotary_write_kv, silu_mul, write_kv)

PURPOSE_DRAFT = 1
PURPOSE_ACCEPT = 2
PURPOSE_RESIDUAL = 3
PURPOSE_TARGET = 4
PURPOSES = {"draft": PURPOSE_DRAFT, "accept": PURPOSE_ACCEPT, "residual": PURPOSE_RESIDUAL,
            "target": PURPOSE_TARGET}

_M32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85


# --------------------------------------------------------------------------- #
# Philox4x32-10 on int64 tensors holding uint32 values
# --------------------------------------------------------------------------- #
def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b, a a uint32 constant, b uint32 in int64."""
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    t1 = a * b_lo                      # < 2^48
    t2 = a * b_hi                      # < 2^48
    s = t1 + ((t2 & 0xFFFF) << 16)     # < 2^49
    lo = s & _M32
    hi = ((t2 >> 16) + (s >> 32)) & _M32
    return hi, lo


def philox4x32_10(ctr: list[torch.Tensor], key0: torch.Tensor, key1: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 of broadcastable int64 tensors holding uint32 words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _M32 for c in ctr)
    key0 = torch.as_tensor(key0, dtype=torch.int64) & _M32
    key1 = torch.as_tensor(key1, dtype=torch.int64) & _M32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0
        key0 = (key0 + _PHILOX_W0) & _M32
        key1 = (key1 + _PHILOX_W1) & _M32
    return [c0, c1, c2, c3]


def random_bits(seeds: torch.Tensor, positions: torch.Tensor, purpose: int,
                index: torch.Tensor) -> torch.Tensor:
    """uint32 (in int64) for (seed, position, purpose, index), broadcast together."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    positions = torch.as_tensor(positions, dtype=torch.int64)
    index = torch.as_tensor(index, dtype=torch.int64)
    key0 = seeds & _M32
    key1 = (seeds >> 32) & _M32                    # arithmetic shift, masked: same bits as uint64
    pos_lo = positions & _M32
    pos_hi = (positions >> 32) & _M32
    words = philox4x32_10([index >> 2, pos_lo, pos_hi, torch.full_like(index, purpose)], key0, key1)
    lane = index & 3
    out = torch.where(lane == 0, words[0], words[1])
    out = torch.where(lane == 2, words[2], out)
    return torch.where(lane == 3, words[3], out)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """(k + 1/2) * 2^-23 for the top 23 bits k: strictly inside (0, 1), exact in float32."""
    k = (bits >> 9).to(torch.float32)
    return (k + 0.5) * 1.1920928955078125e-07


def uniform(seeds, positions, purpose: int, index) -> torch.Tensor:
    return uniform_from_bits(random_bits(seeds, positions, purpose, index))


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


_LN2_HI, _LN2_LO = _f32(6.9313812256e-01), _f32(9.0580006145e-06)
_LG1, _LG2, _LG3, _LG4 = (_f32(6.6666668653e-01), _f32(4.0000000596e-01), _f32(2.8571429849e-01),
                          _f32(2.2222198546e-01))
_SQRT2 = _f32(1.41421354)


def log_det(x: torch.Tensor) -> torch.Tensor:
    """Bit-exact mirror of specrt::log_det (positive normal float32 inputs)."""
    x = x.to(torch.float32)
    bits = x.view(torch.int32).to(torch.int64) & _M32
    exponent = ((bits >> 23) & 0xFF) - 127
    m = ((bits & 0x007FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32)
    big = m > _SQRT2
    m = torch.where(big, m * _f32(0.5), m)
    exponent = exponent + big.to(torch.int64)
    f = m - _f32(1.0)
    s = f / (_f32(2.0) + f)
    z = s * s
    w = z * z
    t1 = w * (_LG2 + w * _LG4)
    t2 = z * (_LG1 + w * _LG3)
    r = t2 + t1
    hfsq = (_f32(0.5) * f) * f
    dk = exponent.to(torch.float32)
    return dk * _LN2_HI - ((hfsq - (s * (hfsq + r) + dk * _LN2_LO)) - f)


def exponential_noise(seed: int, position: int, purpose: int, vocab_size: int) -> torch.Tensor:
    """E_v = -log(U_v) for v in [0, V): the race noise of one (seed, position, purpose)."""
    index = torch.arange(vocab_size, dtype=torch.int64)
    return -log_det(uniform(torch.tensor(seed), torch.tensor(position), purpose, index))


def race(weights: torch.Tensor, seed: int, position: int, purpose: int) -> tuple[int, float]:
    """argmax_v weights_v / E_v (ties to the lowest index) and the winning score."""
    weights = weights.to(torch.float32)
    scores = weights / exponential_noise(seed, position, purpose, weights.numel())
    winner = int(torch.argmax(scores))   # first maximal index
    return winner, float(scores[winner])


def argmax_nan_low(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim with NaN treated as -inf, ties to the lowest index."""
    x = x.to(torch.float32)
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    return torch.argmax(x, dim=-1)


# --------------------------------------------------------------------------- #
# The ops
# --------------------------------------------------------------------------- #
def _greedy_temperature() -> float:
    """The kernels' greedy threshold (sampling.h, kGreedyTemperature), read from the loaded extension:
    this module sits below specrt.ops (which loads it and holds ``ops.is_greedy``) and keeps no copy."""
    return float(torch.ops.specrt.greedy_temperature())


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """temperature -> top-k -> softmax -> min-p -> top-p -> renormalise, per row.

    temperature greedy by the kernels' rule (``ops.is_greedy``: its float32 value not >= the
    threshold 1e-5, so 0 included): one-hot at the argmax (NaN as -inf, ties to the lowest index);
    dividing by a tinier temperature would overflow float32. Needs the extension loaded (specrt.ops).
    top_k 0 or >= V: off; otherwise keep every logit >= the k-th largest (ties kept).
    min_p 0 (or None): off; otherwise keep every token with exp(x / t - max) >= min_p, i.e.
    probability >= min_p * the largest probability.
    top_p 1: off; otherwise keep every prob >= the prob at which the descending
    cumulative sum first reaches top_p (ties kept), then renormalise.
    NaN logits count as -inf; a row with no finite logit becomes one-hot at its argmax.
    """
    n, v = logits.shape
    out = torch.zeros(n, v, dtype=torch.float32)
    greedy_temperature = _greedy_temperature()
    for row in range(n):
        t = float(torch.as_tensor(temperature[row]).to(torch.float32))   # the kernels read float32
        k = int(top_k[row])
        p_top = float(top_p[row])
        m_p = 0.0 if min_p is None else float(torch.as_tensor(min_p[row]).to(torch.float32))
        x = logits[row].to(torch.float32)
        x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
        if not t >= greedy_temperature or not bool(torch.isfinite(x.max())):
            out[row, int(argmax_nan_low(x))] = 1.0
            continue
        x = x / _f32(t)
        if 0 < k < v:
            kth = torch.sort(x, descending=True).values[k - 1]
            x = torch.where(x >= kth, x, torch.full_like(x, float("-inf")))
        e = torch.exp(x - x.max())
        if m_p > 0.0:
            e = torch.where(e >= m_p, e, torch.zeros_like(e))
        p = e / e.sum()
        if p_top < 1.0:
            sorted_p = torch.sort(p, descending=True).values
            csum = torch.cumsum(sorted_p, 0)
            reach = torch.nonzero(csum >= p_top)
            cut = int(reach[0]) if reach.numel() else int(torch.count_nonzero(sorted_p)) - 1
            p = torch.where(p >= sorted_p[cut], p, torch.zeros_like(p))
            p = p / p.sum()
        out[row] = p
    return out


def penalized_logit(x: torch.Tensor, bias, repetition_penalty, in_prompt: bool, count: int, frequency_penalty,
                    presence_penalty) -> torch.Tensor:
    """specrt::penalized_logit (csrc/include/specrt/penalties.h), float32 op for op."""
    f = lambda v: torch.as_tensor(v, dtype=torch.float32)   # noqa: E731
    x = f(x) + f(bias)
    if in_prompt or count > 0:
        x = torch.where(x < 0, x * f(repetition_penalty), x / f(repetition_penalty))
    if count > 0:
        x = (x - f(frequency_penalty) * f(float(count))) - f(presence_penalty)
    return x


def apply_penalties(logits: torch.Tensor, row_request, row_offset, draft_token_ids, entry_start, entry_token,
                    entry_count, entry_in_prompt, entry_bias, repetition_penalty, frequency_penalty,
                    presence_penalty) -> None:
    """In place: row r (request b = row_request[r], after i = row_offset[r] drafts) gets, for every
    token its history touches, penalized_logit with count = generated count + occurrences in
    draft_token_ids[b, :i], in_prompt from the entries and the entry's bias (0 for a draft token
    that has no entry)."""
    for r in range(logits.shape[0]):
        b, i = int(row_request[r]), int(row_offset[r])
        s, e = int(entry_start[b]), int(entry_start[b + 1])
        table = {int(entry_token[x]): (int(entry_count[x]), bool(entry_in_prompt[x]), float(entry_bias[x]))
                 for x in range(s, e)}
        for d in [int(t) for t in draft_token_ids[b, :i]]:
            c, p, bias = table.get(d, (0, False, 0.0))
            table[d] = (c + 1, p, bias)
        for t, (c, p, bias) in table.items():
            logits[r, t] = penalized_logit(logits[r, t], bias, repetition_penalty[b], p, c, frequency_penalty[b],
                                           presence_penalty[b])


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> None:
    """In place: -inf at logits[rows[i], t] wherever bit t % 32 of bitmask[i, t // 32] is 0 (t < V)."""
    V = logits.shape[1]
    bits = torch.arange(V) % 32
    for i, r in enumerate(int(x) for x in rows):
        words = bitmask[i, torch.arange(V) // 32].to(torch.int64) & 0xFFFFFFFF
        logits[r] = logits[r].masked_fill(((words >> bits) & 1) == 0, float("-inf"))


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept draft i while it equals the target's argmax at i; emit argmax at the first miss."""
    b, width, _ = target_logits.shape
    out = torch.full((b, width), -1, dtype=torch.int32)
    num_accepted = torch.zeros(b, dtype=torch.int32)
    best = argmax_nan_low(target_logits)  # [B, K+1]
    for r in range(b):
        n = int(num_draft_tokens[r])
        i = 0
        while i < n and int(draft_token_ids[r, i]) == int(best[r, i]):
            i += 1
        out[r, : i + 1] = best[r, : i + 1].to(torch.int32)
        num_accepted[r] = i
    return out, num_accepted


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, seeds: torch.Tensor,
                     positions: torch.Tensor, method: str = "rejection"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (docs/architecture.md section 2). positions[b] is the absolute
    position of draft token 0 of request b (draft token i sits at positions[b] + i)."""
    b, width, _ = target_probs.shape
    out = torch.full((b, width), -1, dtype=torch.int32)
    num_accepted = torch.zeros(b, dtype=torch.int32)
    for r in range(b):
        n = int(num_draft_tokens[r])
        seed = int(seeds[r])
        pos = int(positions[r])
        if method == "coupled":
            i = 0
            while True:
                winner, _ = race(target_probs[r, i], seed, pos + i, PURPOSE_TARGET)
                out[r, i] = winner
                if i < n and int(draft_token_ids[r, i]) == winner:
                    i += 1
                    continue
                break
            num_accepted[r] = i
            continue
        if method != "rejection":
            raise ValueError(f"method must be 'rejection' or 'coupled', got {method!r}")
        i = 0
        while i < n:
            x = int(draft_token_ids[r, i])
            p_x = target_probs[r, i, x].to(torch.float32)
            q_x = draft_probs[r, i, x].to(torch.float32) if draft_probs is not None else _f32(1.0)
            u = uniform(torch.tensor(seed), torch.tensor(pos + i), PURPOSE_ACCEPT, torch.tensor(0))
            if bool(u.to(torch.float32) * q_x < p_x):
                out[r, i] = x
                i += 1
                continue
            break
        num_accepted[r] = i
        p = target_probs[r, i].to(torch.float32)
        if i < n:   # rejected at i: residual max(p - q, 0); fall back to p if it is all zero
            if draft_probs is not None:
                q = draft_probs[r, i].to(torch.float32)
            else:
                q = torch.zeros_like(p)
                q[int(draft_token_ids[r, i])] = 1.0
            d = p - q
            residual = torch.where(d > 0, d, torch.zeros_like(d))
            winner, score = race(residual, seed, pos + i, PURPOSE_RESIDUAL)
            if score == 0.0:
                winner, _ = race(p, seed, pos + i, PURPOSE_RESIDUAL)
        else:       # all accepted: bonus token from p_n
            winner, _ = race(p, seed, pos + i, PURPOSE_RESIDUAL)
        out[r, i] = winner
    return out, num_accepted


# --------------------------------------------------------------------------- #
# Token trees (csrc/include/specrt/tree.h)
# --------------------------------------------------------------------------- #
TREE_MASS_LANES = 256


def tree_children(node_parents: torch.Tensor, num_nodes: int, node: int) -> list[int]:
    """The children of ``node`` (-1 = the root) in sibling order: nodes j in (node, num_nodes) with
    parent ``node``, by increasing index."""
    return [j for j in range(node + 1, num_nodes) if int(node_parents[j]) == node]


def tree_mass(weights: torch.Tensor) -> torch.Tensor:
    """The fixed-order float32 sum of specrt::tree_mass: element v goes to lane v % 256, each lane
    adds its elements in increasing v from +0, then lanes[i] += lanes[i + s] for s = 128, ..., 1."""
    w = weights.to(torch.float32)
    pad = (-w.numel()) % TREE_MASS_LANES
    blocks = torch.cat([w, torch.zeros(pad, dtype=torch.float32)]).view(-1, TREE_MASS_LANES)
    lanes = torch.zeros(TREE_MASS_LANES, dtype=torch.float32)
    for block in blocks:
        lanes = lanes + block
    s = TREE_MASS_LANES // 2
    while s:
        lanes[:s] = lanes[:s] + lanes[s:2 * s]
        s //= 2
    return lanes[0].clone()


def tree_residual_weight(r: torch.Tensor, mass: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """specrt::tree_residual_weight: max(r / mass - q, 0) where r / mass > 0, else 0 (float32)."""
    a = r.to(torch.float32) / mass
    d = a - q.to(torch.float32)
    zero = torch.zeros_like(a)
    return torch.where(a > 0, torch.where(d > 0, d, zero), zero)


def verify_tree_greedy(target_logits: torch.Tensor, node_token_ids: torch.Tensor, node_parents: torch.Tensor,
                       num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk from the root: t = argmax of the current row (NaN as -inf, ties to the lowest id); the
    first child whose token is t becomes current; else emit t. Row 0 is the root's, row j+1 node j's."""
    b, n1, _ = target_logits.shape
    out = torch.full((b, n1), -1, dtype=torch.int32)
    num_accepted = torch.zeros(b, dtype=torch.int32)
    accepted_nodes = torch.full((b, n1 - 1), -1, dtype=torch.int32)
    best = argmax_nan_low(target_logits)  # [B, N+1]
    for r in range(b):
        n, node, length = int(num_nodes[r]), -1, 0
        while True:
            t = int(best[r, node + 1])
            out[r, length] = t
            child = next((j for j in tree_children(node_parents[r], n, node) if int(node_token_ids[r, j]) == t), -1)
            if child < 0:
                break
            accepted_nodes[r, length] = child
            node, length = child, length + 1
        num_accepted[r] = length
    return out, num_accepted, accepted_nodes


def rejection_sample_tree(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                          node_token_ids: torch.Tensor, node_parents: torch.Tensor, num_nodes: torch.Tensor,
                          seeds: torch.Tensor, positions: torch.Tensor, method: str = "rejection"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact tree verification (docs/architecture.md section 2, csrc/include/specrt/tree.h). At a node of depth a
    (root 0) with target row p every random number is keyed at pos = positions[b] + a.

    "coupled": accept the first child whose token is p's TARGET race winner, else emit the winner.
    "rejection": residual r = p, mass m = 1; the child of rank k with token x (q_k its draft_probs
    row, or one-hot at x) is accepted iff u_k * q_k(x) < r_x / m, u_k = uniform(seed, pos, ACCEPT,
    k); on rejection r = tree_residual_weight(r, m, q_k), m = tree_mass(r). With no child accepted:
    the RESIDUAL race over r (over p if r has no mass, or if the node is a leaf). A sibling is not
    tried once m = 0 (nothing left to accept)."""
    if method not in ("rejection", "coupled"):
        raise ValueError(f"method must be 'rejection' or 'coupled', got {method!r}")
    b, n1, vocab = target_probs.shape
    out = torch.full((b, n1), -1, dtype=torch.int32)
    num_accepted = torch.zeros(b, dtype=torch.int32)
    accepted_nodes = torch.full((b, n1 - 1), -1, dtype=torch.int32)
    for req in range(b):
        n, seed, node, length = int(num_nodes[req]), int(seeds[req]), -1, 0
        while True:
            p = target_probs[req, node + 1].to(torch.float32)
            pos = int(positions[req]) + length
            children = tree_children(node_parents[req], n, node)
            child, emitted = -1, -1
            if method == "coupled":
                emitted, _ = race(p, seed, pos, PURPOSE_TARGET)
                child = next((j for j in children if int(node_token_ids[req, j]) == emitted), -1)
            else:
                r, mass, rank = p, _f32(1.0), 0
                for j in children:
                    if rank > 0 and not bool(mass > 0):
                        break
                    x = int(node_token_ids[req, j])
                    if draft_probs is not None:
                        q = draft_probs[req, j].to(torch.float32)
                    else:
                        q = torch.zeros(vocab, dtype=torch.float32)
                        q[x] = 1.0
                    u = uniform(torch.tensor(seed), torch.tensor(pos), PURPOSE_ACCEPT, torch.tensor(rank))
                    if bool(u.to(torch.float32) * q[x] < r[x] / mass):
                        child, emitted = j, x
                        break
                    r = tree_residual_weight(r, mass, q)
                    mass = tree_mass(r)
                    rank += 1
                if child < 0:
                    score = 0.0
                    if rank > 0:
                        emitted, score = race(r, seed, pos, PURPOSE_RESIDUAL)
                    if score == 0.0:
                        emitted, _ = race(p, seed, pos, PURPOSE_RESIDUAL)
            out[req, length] = emitted
            if child < 0:
                break
            accepted_nodes[req, length] = child
            node, length = child, length + 1
        num_accepted[req] = length
    return out, num_accepted, accepted_nodes


def sample_tokens(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  purpose: str = "target") -> torch.Tensor:
    """Exponential race per row under the given purpose (TARGET for plain decoding)."""
    code = PURPOSES[purpose]
    return torch.tensor([race(probs[r], int(seeds[r]), int(positions[r]), code)[0]
                         for r in range(probs.shape[0])], dtype=torch.int32)
