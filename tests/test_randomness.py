"""docs/architecture.md section 3: one randomness rule, proven.

* Philox4x32-10 (compiled header and the pure-torch reference) matches the Random123
  known-answer vectors.
* ops.uniform_noise == reference.uniform bit for bit, strictly inside (0, 1), including the
  extreme bit patterns; ops.log_det == reference.log_det bit for bit and ~= math.log.
* A request's tokens depend only on its own inputs: not on batch neighbours, its row
  (slot), or K padding; the four purposes are independent streams.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specrt import ops
from specrt.ops import reference

# (counter, key) -> output, from Random123's kat_vectors (philox4x32_10)
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers(ctr, key, expected):
    assert [x & 0xFFFFFFFF for x in ops.philox4x32_10(ctr, key)] == expected
    words = reference.philox4x32_10([torch.tensor(c) for c in ctr], torch.tensor(key[0]), torch.tensor(key[1]))
    assert [int(w) for w in words] == expected


def test_philox_reference_matches_header_on_random_words():
    g = np.random.default_rng(1)
    ctrs = g.integers(0, 2**32, size=(200, 4), dtype=np.uint64)
    keys = g.integers(0, 2**32, size=(200, 2), dtype=np.uint64)
    ref = reference.philox4x32_10([torch.from_numpy(ctrs[:, j].astype(np.int64)) for j in range(4)],
                                  torch.from_numpy(keys[:, 0].astype(np.int64)),
                                  torch.from_numpy(keys[:, 1].astype(np.int64)))
    ref = torch.stack(ref, 1).tolist()
    for i in range(200):
        got = [x & 0xFFFFFFFF for x in ops.philox4x32_10([int(c) for c in ctrs[i]], [int(k) for k in keys[i]])]
        assert got == ref[i], i


def _random_inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    seeds[:4] = torch.tensor([0, -1, 2**32 + 7, -2**63])
    positions = torch.randint(0, 2**62, (n,), generator=g, dtype=torch.int64)
    positions[:4] = torch.tensor([0, 2**32 - 1, 2**32, 2**40 + 3])
    index = torch.randint(0, 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    index[: n // 2] = torch.randint(0, 130_000, (n // 2,), generator=g)
    return seeds, positions, index


@pytest.mark.parametrize("purpose", sorted(ops.PURPOSES))
def test_uniform_noise_matches_reference_bit_exact(purpose):
    seeds, positions, index = _random_inputs(100_000, seed=ops.PURPOSES[purpose])
    got = ops.uniform_noise(seeds, positions, purpose, index)
    want = reference.uniform(seeds, positions, reference.PURPOSES[purpose], index)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert bool((got > 0).all()) and bool((got < 1).all())
    # sanity: it is uniform (mean 1/2, var 1/12) -- a constant or truncated stream fails this
    assert abs(float(got.double().mean()) - 0.5) < 0.005
    assert abs(float(got.double().var()) - 1 / 12) < 0.002


def test_uniform_extremes_strictly_inside_unit_interval():
    bits = torch.tensor([0, 1, 511, 512, 0x7FFFFFFF, 0x80000000, 0xFFFFFE00, 0xFFFFFFFF], dtype=torch.int64)
    u = reference.uniform_from_bits(bits)
    assert float(u[0]) == 2.0**-24 and float(u[-1]) == 1.0 - 2.0**-24
    assert bool((u > 0).all()) and bool((u < 1).all())
    # E = -log(U) is finite and positive at both extremes (the race never divides by 0 or inf)
    e = -ops.log_det(u)
    assert bool(torch.isfinite(e).all()) and bool((e > 0).all())
    assert torch.equal(e, -reference.log_det(u))


def test_log_det_bit_exact_and_accurate():
    g = torch.Generator().manual_seed(3)
    # every positive normal float32 exponent, random mantissas, plus the race's uniforms
    mant = torch.randint(0, 2**23, (200_000,), generator=g, dtype=torch.int64)
    expo = torch.randint(1, 255, (200_000,), generator=g, dtype=torch.int64)
    x = ((expo << 23) | mant).to(torch.int32).view(torch.float32)
    u = reference.uniform_from_bits(torch.randint(0, 2**32, (100_000,), generator=g, dtype=torch.int64))
    special = torch.tensor([1.0, 2.0, 0.5, 1.41421354, 1.4142137, 1 + 2**-23, 1 - 2**-24, 2.0**-24, 2.0**-126,
                            3.4028235e38, math.e], dtype=torch.float32)
    x = torch.cat([x, u, special])
    got = ops.log_det(x)
    want = reference.log_det(x)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    exact = np.log(x.double().numpy())
    err = np.abs(got.double().numpy() - exact)
    rel_ok = err <= 1e-6 * np.abs(exact)
    # log(1) == 0 exactly; elsewhere relative error < 1e-6 (fdlibm logf is < 1 ulp)
    assert float(got[x == 1.0][0]) == 0.0
    bad = ~rel_ok & (exact != 0)
    assert not bad.any(), (x.numpy()[bad][:5], got.numpy()[bad][:5], exact[bad][:5])


# --------------------------------------------------------------------------- #
# batch / slot / K-padding invariance
# --------------------------------------------------------------------------- #
V = 50


def _request(g, k: int, n: int, with_q: bool):
    """One request's inputs with K = k slots, n real drafts (the rest padded)."""
    p = torch.rand(k + 1, V, generator=g) ** 3
    p /= p.sum(-1, keepdim=True)
    q = torch.rand(k, V, generator=g) ** 3
    q /= q.sum(-1, keepdim=True)
    ids = torch.full((k,), -1, dtype=torch.int32)
    if n:
        ids[:n] = torch.multinomial(q[:n], 1, generator=g).squeeze(1).to(torch.int32)
    return p, (q if with_q else None), ids


def _pad(p, q, ids, k_new: int, g):
    """The same request with K = k_new: extra rows are garbage padding, ids -1."""
    k = ids.numel()
    extra = k_new - k
    p2 = torch.cat([p, torch.rand(extra, V, generator=g)])
    ids2 = torch.cat([ids, torch.full((extra,), -1, dtype=torch.int32)])
    q2 = None if q is None else torch.cat([q, torch.rand(extra, V, generator=g)])
    return p2, q2, ids2


@pytest.mark.parametrize("method", ["rejection", "coupled"])
@pytest.mark.parametrize("with_q", [True, False])
def test_tokens_independent_of_batch_slot_and_k_padding(method, with_q):
    g = torch.Generator().manual_seed(11)
    for trial in range(30):
        k = int(torch.randint(0, 4, (1,), generator=g))
        n = int(torch.randint(0, k + 1, (1,), generator=g))
        seed = int(torch.randint(-2**63, 2**63 - 1, (1,), generator=g, dtype=torch.int64))
        pos = int(torch.randint(0, 2**40, (1,), generator=g, dtype=torch.int64))
        p, q, ids = _request(g, k, n, with_q)

        def run(tp, dp, di, nd, sd, ps, kk):
            if not with_q:
                dp = None
            return ops.rejection_sample(tp, dp, di, nd, sd, ps, method=method)

        alone_out, alone_acc = run(p[None], None if q is None else q[None], ids[None], [n], [seed], [pos], k)
        # in a batch of 9 at slot `slot`, next to other random requests (same K)
        for slot in (0, 4, 8):
            others = [_request(g, k, int(torch.randint(0, k + 1, (1,), generator=g)), True) for _ in range(8)]
            rows = others[:slot] + [(p, q if q is not None else torch.rand(k, V), ids)] + others[slot:]
            tp = torch.stack([r[0] for r in rows])
            dp = torch.stack([r[1] for r in rows])
            di = torch.stack([r[2] for r in rows])
            nd = [int((r[2] >= 0).sum()) for r in rows]
            nd[slot] = n
            sd = torch.randint(-2**63, 2**63 - 1, (9,), generator=g, dtype=torch.int64)
            sd[slot] = seed
            ps = torch.randint(0, 2**40, (9,), generator=g, dtype=torch.int64)
            ps[slot] = pos
            if not with_q:   # one-hot draft for everyone; ids must be real tokens
                pass
            out, acc = run(tp, dp, di, nd, sd, ps, k)
            assert torch.equal(out[slot], alone_out[0]), (trial, slot)
            assert int(acc[slot]) == int(alone_acc[0])
        # K padding: same n, larger K, garbage rows after the used ones
        for k_new in (k + 1, k + 3):
            p2, q2, ids2 = _pad(p, q, ids, k_new, g)
            out2, acc2 = run(p2[None], None if q2 is None else q2[None], ids2[None], [n], [seed], [pos], k_new)
            assert int(acc2[0]) == int(alone_acc[0])
            m = int(alone_acc[0]) + 1
            assert torch.equal(out2[0, :m], alone_out[0, :m])
            assert bool((out2[0, m:] == -1).all())


def test_sample_tokens_independent_of_batch_and_slot():
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(64, 1000, generator=g)
    seeds = torch.randint(-2**63, 2**63 - 1, (64,), generator=g, dtype=torch.int64)
    pos = torch.randint(0, 2**40, (64,), generator=g, dtype=torch.int64)
    full = ops.sample_tokens(probs, seeds, pos)
    perm = torch.randperm(64, generator=g)
    permuted = ops.sample_tokens(probs[perm].contiguous(), seeds[perm], pos[perm])
    assert torch.equal(permuted, full[perm])
    for r in (0, 17, 63):
        assert int(ops.sample_tokens(probs[r:r + 1].contiguous(), seeds[r:r + 1], pos[r:r + 1])[0]) == int(full[r])


def test_purposes_are_independent_streams():
    n = 20_000
    seeds, positions, index = _random_inputs(n, seed=9)
    streams = {p: ops.uniform_noise(seeds, positions, p, index).double() for p in ops.PURPOSES}
    names = sorted(streams)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.equal(streams[a], streams[b])
            corr = float(torch.corrcoef(torch.stack([streams[a], streams[b]]))[0, 1])
            assert abs(corr) < 0.04, (a, b, corr)  # 5.6 sigma for n = 20k
    # the sampler itself: same probs/seeds/positions, different purpose -> different tokens
    probs = torch.ones(n, 64)
    toks = {p: ops.sample_tokens(probs, seeds, positions, purpose=p) for p in ops.PURPOSES}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            same = float((toks[a] == toks[b]).double().mean())
            assert same < 2 / 64, (a, b, same)  # independent: ~1/64
    # and neighbouring positions / seeds are different streams too
    assert float((ops.sample_tokens(probs, seeds, positions + 1) == toks["target"]).double().mean()) < 2 / 64
    assert float((ops.sample_tokens(probs, seeds + 1, positions) == toks["target"]).double().mean()) < 2 / 64
