"""The vectorized CPU sampling paths (AVX2, AVX-512) against the scalar path (docs/architecture.md 1, 3).

Every vector path must return exactly what the scalar code returns: the same tokens from
the exponential race (sample_tokens, rejection_sample with a draft distribution, a
one-hot draft and coupled acceptance) and the same probabilities bit for bit from
probs_from_logits, for every instruction set this CPU runs (forced with the debug op
``specrt::set_cpu_isa``; ``SPECRT_CPU_ISA`` does the same from the environment), on
awkward inputs: vocabularies that are not a multiple of the vector width, V = 1, top-k /
top-p masked rows, greedy one-hot rows, ties, rows that defeat the vector paths' pruning,
weights so small that pruning must switch off, and unchecked garbage. Thread count must
not change any result. The pruning bound the vector race relies on is checked for every
one of the 2^23 uniforms the sampler can draw.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import zlib

import pytest
import torch

from specrt import ops
from specrt.ops import reference
from _env import CHILD_CWD, child_env  # noqa: E402  (tests/ on sys.path)

ISAS = ("scalar", "avx2", "avx512")
VOCABS = (1, 2, 3, 4, 5, 15, 16, 17, 33, 63, 64, 65, 129, 1000, 8191, 8193, 16411)


def _supported() -> list[str]:
    found = []
    for name in ISAS:
        try:
            torch.ops.specrt.set_cpu_isa(name)
            found.append(name)
        except ValueError:
            pass
    torch.ops.specrt.set_cpu_isa("auto")
    return found


SUPPORTED = _supported()
VECTOR_ISAS = [pytest.param(name, marks=pytest.mark.skipif(name not in SUPPORTED, reason=f"CPU lacks {name}"))
               for name in ISAS[1:]]


@contextlib.contextmanager
def _isa(name: str):
    torch.ops.specrt.set_cpu_isa(name)
    try:
        assert torch.ops.specrt.cpu_isa() == name
        yield
    finally:
        torch.ops.specrt.set_cpu_isa("auto")


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _seeds_positions(g, n):
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    seeds[: min(n, 4)] = torch.tensor([0, -1, 2**32 + 5, 2**63 - 1])[: min(n, 4)]
    positions = torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64)
    positions[0] = 2**32 - 2
    return seeds, positions


ROW_KINDS = ("dense", "peaky", "topk", "onehot", "ties", "growing", "tiny")


def _rows(kind: str, n: int, v: int, g: torch.Generator) -> torch.Tensor:
    """[n, v] float32 weights of one kind (see the module docstring)."""
    if kind == "dense":
        return torch.softmax(torch.randn(n, v, generator=g) * 2.0, -1)
    if kind == "peaky":      # most weights far below the pruning floor
        return torch.softmax(torch.randn(n, v, generator=g) * 12.0, -1)
    if kind == "topk":       # zeros everywhere but a few entries
        x = torch.softmax(torch.randn(n, v, generator=g), -1)
        keep = torch.rand(n, v, generator=g) < 0.01
        keep[:, int(torch.randint(0, v, (1,), generator=g))] = True
        x = torch.where(keep, x, torch.zeros_like(x))
        return x / x.sum(-1, keepdim=True)
    if kind == "onehot":
        return torch.nn.functional.one_hot(torch.randint(0, v, (n,), generator=g), v).float()
    if kind == "ties":       # equal weights, and exact duplicates of a maximum
        x = torch.full((n, v), 1.0 / v)
        x[:, ::3] = 2.0 / v
        return x
    if kind == "growing":    # each vector outweighs everything before it: nothing can be pruned
        idx = torch.arange(v, dtype=torch.float32)
        return torch.exp2((idx - v) / 2.0).clamp(min=2.0**-126).expand(n, v).contiguous()
    if kind == "tiny":       # scores < 1e-30: pruning switches off; denormal weights included
        x = torch.rand(n, v, generator=g) * 1e-36
        x[:, ::5] = 1e-44
        return x
    raise AssertionError(kind)


def _all_isas(fn):
    """{isa: fn()} for every supported instruction set."""
    out = {}
    for name in SUPPORTED:
        with _isa(name):
            out[name] = fn()
    return out


def _assert_same(results: dict, what: str):
    base = results["scalar"]
    for name, got in results.items():
        for a, b in zip(base, got):
            assert torch.equal(a, b), f"{what}: {name} differs from scalar"


# --------------------------------------------------------------------------- #
# The debug hooks
# --------------------------------------------------------------------------- #
def test_isa_hook_switches_and_rejects_bad_names():
    assert "scalar" in SUPPORTED
    assert torch.ops.specrt.cpu_isa() in ISAS
    for name in SUPPORTED:
        assert torch.ops.specrt.set_cpu_isa(name) == name
        assert torch.ops.specrt.cpu_isa() == name
    torch.ops.specrt.set_cpu_isa("auto")
    with pytest.raises(ValueError, match="isa must be one of"):
        torch.ops.specrt.set_cpu_isa("sse9")
    assert torch.ops.specrt.cpu_isa() in SUPPORTED


@pytest.mark.parametrize("env,expect", [("scalar", "scalar"), ("avx2", "avx2"), ("bogus", "SPECRT_CPU_ISA")])
def test_isa_environment_variable(env, expect):
    if expect in ISAS and expect not in SUPPORTED:
        pytest.skip(f"CPU lacks {expect}")
    code = ("import torch\nfrom specrt import ops\n"
            "try:\n    print(torch.ops.specrt.cpu_isa())\n"
            "except ValueError as e:\n    print(e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=child_env(SPECRT_CPU_ISA=env), cwd=CHILD_CWD)
    assert res.returncode == 0, res.stderr
    assert expect in res.stdout.strip().splitlines()[-1]


def test_exponential_noise_every_uniform_every_isa_and_the_pruning_bound():
    """All 2^23 uniforms: each path's -log_det is the reference's, bit for bit, and
    E >= (1 - U)(1 - 2^-13), the bound behind the vector race's pruning (race.h)."""
    u = reference.uniform_from_bits(torch.arange(2**23, dtype=torch.int64) << 9)
    want = -reference.log_det(u)
    for name in SUPPORTED:
        with _isa(name):
            got = torch.ops.specrt.cpu_exponential_noise(u)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name
    one_minus_u = 1.0 - u.double()          # exact
    assert bool((want.double() >= one_minus_u * (1.0 - 2.0**-13)).all())


# --------------------------------------------------------------------------- #
# The race: sample_tokens and rejection_sample
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("v", VOCABS)
def test_sample_tokens_every_isa_matches_scalar(v):
    g = _gen("st", v)
    probs = torch.cat([_rows(kind, 3, v, g) for kind in ROW_KINDS])
    seeds, positions = _seeds_positions(g, probs.shape[0])
    results = _all_isas(lambda: [ops.sample_tokens(probs, seeds + s, positions, purpose)
                                 for s in range(4) for purpose in ("target", "draft")])
    _assert_same(results, f"sample_tokens V={v}")


@pytest.mark.parametrize("v", [v for v in VOCABS if v <= 1000])
def test_vector_sample_tokens_match_reference(v):
    g = _gen("st-ref", v)
    probs = torch.cat([_rows(kind, 2, v, g) for kind in ("dense", "peaky", "topk", "growing")])
    seeds, positions = _seeds_positions(g, probs.shape[0])
    want = reference.sample_tokens(probs, seeds, positions)
    for name in SUPPORTED:
        with _isa(name):
            assert torch.equal(ops.sample_tokens(probs, seeds, positions), want), name


def _spec_case(kind: str, b: int, k: int, v: int, g: torch.Generator):
    target = _rows(kind, b * (k + 1), v, g).view(b, k + 1, v)
    draft = _rows("dense" if kind == "onehot" else kind, b * k, v, g).view(b, k, v)
    if b > 2 and k > 0:
        draft[2] = torch.clamp(2 * target[2, :k], max=1.0)   # residual all zero: falls back to p
    if k:
        ids = torch.multinomial(draft.reshape(-1, v) + 1e-30, 1, generator=g).view(b, k).int()
        hit = torch.rand(b, k, generator=g) < 0.5            # often the target's likeliest token
        ids = torch.where(hit, target[:, :k].argmax(-1).int(), ids)
    else:
        ids = torch.zeros(b, 0, dtype=torch.int32)
    nd = torch.randint(0, k + 1, (b,), generator=g, dtype=torch.int32)
    nd[0] = k
    seeds, positions = _seeds_positions(g, b)
    return target, draft, ids.contiguous(), nd, seeds, positions


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_rejection_sample_every_isa_matches_scalar(kind, v):
    g = _gen("rs", kind, v)
    target, draft, ids, nd, seeds, positions = _spec_case(kind, 5, 3, v, g)

    def run():
        out = []
        for s in range(3):
            out += ops.rejection_sample(target, draft, ids, nd, seeds + s, positions)
            out += ops.rejection_sample(target, None, ids, nd, seeds + s, positions)
            out += ops.rejection_sample(target, None, ids, nd, seeds + s, positions, method="coupled")
        return out

    _assert_same(_all_isas(run), f"rejection_sample {kind} V={v}")


@pytest.mark.parametrize("v", (17, 1000))
def test_vector_rejection_sample_matches_reference(v):
    g = _gen("rs-ref", v)
    target, draft, ids, nd, seeds, positions = _spec_case("dense", 4, 3, v, g)
    for q in (draft, None):
        want = reference.rejection_sample(target, q, ids, nd, seeds, positions)
        for name in SUPPORTED:
            with _isa(name):
                got = ops.rejection_sample(target, q, ids, nd, seeds, positions)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name


def test_unchecked_garbage_gives_the_same_tokens_on_every_isa():
    """check_values=False with NaN, negative and infinite weights and out-of-range drafts:
    nothing is defined about the tokens except that every path agrees."""
    g = _gen("garbage")
    b, k, v = 4, 3, 203
    target = torch.randn(b, k + 1, v, generator=g)
    target[torch.rand(b, k + 1, v, generator=g) < 0.05] = float("nan")
    target[0, 1, 7] = float("inf")
    draft = torch.randn(b, k, v, generator=g)
    ids = torch.randint(-3, v + 3, (b, k), generator=g, dtype=torch.int32)
    nd = torch.tensor([3, 2, 9, -1], dtype=torch.int32)
    seeds, positions = _seeds_positions(g, b)

    def run():
        out = [ops.sample_tokens(target[:, 0].contiguous(), seeds, positions, check_values=False)]
        for q in (draft, None):
            out += ops.rejection_sample(target, q, ids, nd, seeds, positions, check_values=False)
        out += ops.rejection_sample(target, None, ids, nd, seeds, positions, method="coupled", check_values=False)
        return out

    _assert_same(_all_isas(run), "garbage")


def test_thread_count_does_not_change_tokens():
    g = _gen("threads")
    b, k, v = 3, 2, 40_000                     # several vocabulary chunks per row
    target, draft, ids, nd, seeds, positions = _spec_case("dense", b, k, v, g)
    probs = target[:, 0].contiguous()
    before = torch.get_num_threads()

    def run():
        return [ops.sample_tokens(probs, seeds, positions),
                *ops.rejection_sample(target, draft, ids, nd, seeds, positions),
                *ops.rejection_sample(target, None, ids, nd, seeds, positions, method="coupled")]

    try:
        results = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results[threads] = _all_isas(run)
    finally:
        torch.set_num_threads(before)
    for threads, per_isa in results.items():
        _assert_same(per_isa, f"{threads} threads")
        _assert_same({"scalar": results[1]["scalar"], "x": per_isa["scalar"]}, f"{threads} vs 1 thread")


# --------------------------------------------------------------------------- #
# probs_from_logits
# --------------------------------------------------------------------------- #
TEMPS = (0.0, 0.3, 0.8, 1.0, 2.5)
TOP_PS = (1.0, 0.999999, 0.999, 0.9, 0.5, 0.05, 1e-9)


def _logits_rows(n: int, v: int, g: torch.Generator) -> torch.Tensor:
    """Gaussian logits of several scales, exact ties, NaN, -inf, an all-NaN row, a +inf row."""
    scale = torch.tensor([0.5, 2.0, 8.0, 30.0])[torch.randint(0, 4, (n, 1), generator=g)]
    x = torch.randn(n, v, generator=g) * scale
    tied = torch.randint(-4, 5, (n, v), generator=g).float() * 0.75
    x = torch.where(torch.rand(n, v, generator=g) < 0.3, tied, x)
    x[torch.rand(n, v, generator=g) < 0.05] = float("nan")
    x[torch.rand(n, v, generator=g) < 0.03] = float("-inf")
    x[0] = float("nan")
    if n > 2:
        x[1] = 1.5
        x[2, v // 2] = float("inf")
    return x


def _params(n: int, v: int, g: torch.Generator):
    temps = torch.tensor(TEMPS)[torch.randint(0, len(TEMPS), (n,), generator=g)]
    ks = torch.tensor([0, 1, 2, 50, v - 1, v, v + 3, max(v // 3, 1)])
    top_k = ks[torch.randint(0, len(ks), (n,), generator=g)].clamp(min=0).int()
    top_p = torch.tensor(TOP_PS)[torch.randint(0, len(TOP_PS), (n,), generator=g)]
    return temps, top_k, top_p


@pytest.mark.parametrize("v", VOCABS + (32000,))
def test_probs_from_logits_every_isa_matches_scalar(v):
    g = _gen("probs", v)
    n = 48
    logits = _logits_rows(n, v, g)
    params = _params(n, v, g)
    results = _all_isas(lambda: [ops.probs_from_logits(logits, *params)])
    for name, (got,) in results.items():
        assert torch.equal(got.view(torch.int32), results["scalar"][0].view(torch.int32)), name
    got = results["scalar"][0]
    assert bool(torch.isfinite(got).all())
    assert torch.allclose(got.double().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-5)


def _cut_by_sort(probs: torch.Tensor, top_p: float) -> float:
    """The top-p cut's definition: sort descending, cumulative sum in double."""
    p = probs[probs > 0].double().sort(descending=True).values
    csum = torch.cumsum(p, 0).float()
    reach = torch.nonzero(csum >= top_p)
    return float(p[int(reach[0])] if reach.numel() else p[-1])


@pytest.mark.parametrize("v", (7, 1000, 32000))
def test_top_p_cut_is_the_sorted_cumsum_cut(v):
    """The binned top-p search keeps exactly what sorting the row would keep (incl. the
    fallback when the cut falls among probs < 2^-29, and top_p reached by the last prob)."""
    g = _gen("top-p", v)
    n = 32
    logits = torch.randn(n, v, generator=g) * torch.tensor([1.0, 4.0, 12.0, 40.0]).repeat(n // 4)[:, None]
    temps = torch.ones(n)
    top_k = torch.zeros(n, dtype=torch.int32)
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.999999, 0.9999999, 1e-6, 0.7, 0.95])[torch.arange(n) % 8]
    # one likely token and a long tail of probs near 1e-9 < 2^-29: the cut lies in the tail
    logits[-3:] = -20.7 + 0.3 * torch.randn(3, v, generator=g)
    logits[-3:, 0] = 0.0
    top_p[-3:] = torch.tensor([1.0 - 2e-5 * v / 32000, 1.0 - 1e-5 * v / 32000, 0.99999994])
    for name in SUPPORTED:
        with _isa(name):
            full = ops.probs_from_logits(logits, temps, top_k, torch.ones(n))
            got = ops.probs_from_logits(logits, temps, top_k, top_p)
        for r in range(n):
            if float(top_p[r]) >= 1.0:   # off (1 - 4e-9 rounds to 1 in float32)
                want = full[r] > 0
            else:
                want = full[r] >= _cut_by_sort(full[r], float(top_p[r]))
            assert torch.equal(got[r] > 0, want), (name, r)


@pytest.mark.parametrize("k", (1, 3, 50, 300, 999, 5000))
def test_top_k_keeps_the_k_largest_and_ties(k):
    g = _gen("top-k", k)
    n, v = 6, 7001
    logits = torch.randint(-40, 40, (n, v), generator=g).float() * 0.5   # many exact ties
    logits[1] = torch.randn(v, generator=g)
    logits[2, ::7] = float("nan")
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 2.0])
    for name in SUPPORTED:
        with _isa(name):
            got = ops.probs_from_logits(logits, temps, torch.full((n,), k, dtype=torch.int32), torch.ones(n))
        x = torch.nan_to_num(logits, nan=float("-inf")) / temps[:, None]
        kth = x.sort(-1, descending=True).values[:, k - 1 : k]
        assert torch.equal(got > 0, x >= kth), name


def test_probs_thread_count_does_not_change_floats():
    g = _gen("probs-threads")
    n, v = 13, 20011
    logits = _logits_rows(n, v, g)
    params = _params(n, v, g)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(ops.probs_from_logits(logits, *params))
    finally:
        torch.set_num_threads(before)
    for out in outs[1:]:
        assert torch.equal(out.view(torch.int32), outs[0].view(torch.int32))


@pytest.mark.parametrize("v", (1, 5, 16, 17, 1000))
def test_verify_greedy_every_isa_matches_scalar(v):
    from _cases import greedy_case   # noqa: E402  (tests/ is on sys.path under pytest)
    g = _gen("greedy", v)
    logits, ids, nd = greedy_case(6, v, 3, g, jitter=True)
    logits[1, 1] = -0.0
    logits[1, 1, v // 2] = 0.0                      # -0.0 ties +0.0: the lowest index wins
    results = _all_isas(lambda: list(ops.verify_greedy(logits, ids, nd)))
    _assert_same(results, f"verify_greedy V={v}")
    want = reference.verify_greedy(logits, ids, nd)
    assert torch.equal(results["scalar"][0], want[0]) and torch.equal(results["scalar"][1], want[1])
