"""The sampling controls' kernels (issue 20): min_p in probs_from_logits and the apply_penalties op.

- min_p: the CPU op against specrt.ops.reference and transformers' MinPLogitsWarper, bit-identical
  on every CPU instruction set, 0 = off bit for bit, and the definition itself (a token is kept
  iff its probability is at least min_p times the largest).
- apply_penalties (logit_bias, repetition / frequency / presence penalties at every verified
  position at once): bit-identical to specrt.ops.reference (the shared header's float math), to
  transformers' RepetitionPenaltyLogitsProcessor, and to the OpenAI formula; position i of a
  request sees exactly the history an autoregressive step would (its drafts before i), and the
  thread count changes nothing. CUDA against CPU bit for bit (skipped without a GPU).
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops
from specrt.ops import reference

from _cases import gen  # noqa: E402  (tests/ on sys.path)
from test_sampling_simd import VOCABS, _all_isas, _logits_rows, _params  # noqa: E402

CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()),
                          reason="needs a CUDA GPU and a CUDA build of specrt")


# --------------------------------------------------------------------------- #
# min_p
# --------------------------------------------------------------------------- #
def _min_ps(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.tensor([0.0, 1e-4, 0.05, 0.1, 0.3, 0.9, 1.0])[torch.randint(0, 7, (n,), generator=g)]


@pytest.mark.parametrize("v", [7, 50, 1000])
def test_min_p_matches_the_reference(v):
    g = gen("min_p-ref", v)
    n = 64
    logits = torch.randn(n, v, generator=g) * torch.tensor([0.5, 3.0])[torch.randint(0, 2, (n, 1), generator=g)]
    temps, top_k, top_p = _params(n, v, g)
    min_p = _min_ps(n, g)
    got = ops.probs_from_logits(logits, temps, top_k, top_p, min_p=min_p)
    want = reference.probs_from_logits(logits, temps, top_k, top_p, min_p)
    assert torch.equal(got > 0, want > 0)                 # the same kept set (no ties at the cut here)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.allclose(got.double().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-5)


def test_min_p_definition():
    """Sampled rows keep exactly the tokens with p >= min_p * max p (p of the temperature-scaled
    softmax), renormalised; min_p 1 keeps only the argmax; min_p 0 is off bit for bit."""
    g = gen("min_p-def")
    n, v = 200, 64
    logits = torch.randn(n, v, generator=g) * 2
    t = torch.full((n,), 0.8)
    k, p = torch.zeros(n, dtype=torch.int32), torch.ones(n)
    min_p = torch.rand(n, generator=g)
    got = ops.probs_from_logits(logits, t, k, p, min_p=min_p)
    full = torch.softmax(logits.double() / 0.8, -1)
    keep = full >= min_p.double()[:, None] * full.max(-1, keepdim=True).values
    margin = (full / full.max(-1, keepdim=True).values - min_p.double()[:, None]).abs() > 1e-6
    assert torch.equal((got > 0)[margin], keep[margin])
    want = torch.where(keep, full, torch.zeros_like(full))
    assert torch.allclose(got.double(), want / want.sum(-1, keepdim=True), atol=1e-6)
    one = ops.probs_from_logits(logits, t, k, p, min_p=torch.ones(n))
    assert torch.equal(one.argmax(-1), logits.argmax(-1)) and bool((one.max(-1).values == 1).all())
    zero = ops.probs_from_logits(logits, t, k, p, min_p=torch.zeros(n))
    assert torch.equal(zero.view(torch.int32), ops.probs_from_logits(logits, t, k, p).view(torch.int32))


def test_min_p_matches_transformers_min_p_warper():
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    g = gen("min_p-hf")
    n, v = 32, 160
    logits = torch.randn(n, v, generator=g) * 3
    for temperature, min_p in [(1.0, 0.05), (0.7, 0.2), (1.5, 0.01)]:
        scores = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
        want = torch.softmax(scores, -1)
        got = ops.probs_from_logits(logits, torch.full((n,), temperature), torch.zeros(n, dtype=torch.int32),
                                    torch.ones(n), min_p=torch.full((n,), min_p))
        assert torch.equal(got > 0, want > 0), (temperature, min_p)
        assert torch.allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("v", VOCABS[::3] + (32000,))
def test_min_p_every_isa_matches_scalar(v):
    g = gen("min_p-isa", v)
    n = 48
    logits = _logits_rows(n, v, g)
    params = _params(n, v, g)
    min_p = _min_ps(n, g)
    results = _all_isas(lambda: [ops.probs_from_logits(logits, *params, min_p=min_p)])
    for name, (got,) in results.items():
        assert torch.equal(got.view(torch.int32), results["scalar"][0].view(torch.int32)), name
    assert torch.allclose(results["scalar"][0].double().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([0.1, 1.5]), r"min_p\[1\] = 1.5 must be in \[0, 1\]"),
    (torch.tensor([-0.1, 0.0]), r"min_p\[0\] = -0.1 must be in \[0, 1\]"),
    (torch.tensor([float("nan"), 0.0]), r"min_p\[0\] = nan must be in \[0, 1\]"),
    (torch.tensor([0.1]), r"min_p must have size 2"),
    (torch.tensor([1, 0]), r"min_p must be a floating-point tensor"),
])
def test_min_p_bad_input_names_it(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ops.probs_from_logits(torch.randn(2, 5), [1.0, 1.0], [0, 0], [1.0, 1.0], min_p=bad)


# --------------------------------------------------------------------------- #
# apply_penalties
# --------------------------------------------------------------------------- #
def penalty_case(g: torch.Generator, b: int = 5, k: int = 4, v: int = 40):
    """(logits [R, V], args...) with every row 0..K of every request, entries mixing prompt-only,
    generated, biased and repeated tokens, drafts that repeat and that hit entries."""
    rows = [(r, i) for r in range(b) for i in range(k + 1)]
    logits = torch.randn(len(rows), v, generator=g) * 3
    logits[torch.rand(logits.shape, generator=g) < 0.05] = float("-inf")
    drafts = torch.randint(0, v // 2, (b, k), generator=g, dtype=torch.int32)   # often repeated
    start, tok, cnt, inp, bias = [0], [], [], [], []
    for r in range(b):
        n = int(torch.randint(0, v // 2, (1,), generator=g))
        toks = torch.randperm(v, generator=g)[:n].sort().values
        for t in toks.tolist():
            c = int(torch.randint(0, 4, (1,), generator=g))
            tok.append(t)
            cnt.append(c)
            inp.append(bool(torch.rand(1, generator=g) < 0.5) or c == 0)
            bias.append(float(torch.randn(1, generator=g)) * 5 if torch.rand(1, generator=g) < 0.3 else 0.0)
        start.append(len(tok))
    rp = torch.rand(b, generator=g) * 2 + 0.3
    fp = torch.rand(b, generator=g) * 4 - 2
    pp = torch.rand(b, generator=g) * 4 - 2
    args = (torch.tensor([r for r, _ in rows]), torch.tensor([i for _, i in rows]), drafts, torch.tensor(start),
            torch.tensor(tok, dtype=torch.int32), torch.tensor(cnt, dtype=torch.int32),
            torch.tensor(inp, dtype=torch.bool),
            torch.tensor(bias), rp, fp, pp)
    return logits, args


@pytest.mark.parametrize("seed", range(6))
def test_apply_penalties_matches_the_reference_bit_for_bit(seed):
    logits, args = penalty_case(gen("penalties", seed), b=2 + seed, k=seed % 5, v=17 + 13 * seed)
    got, want = logits.clone(), logits.clone()
    ops.apply_penalties(got, *args)
    reference.apply_penalties(want, *args)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(got, logits)


def test_each_position_sees_the_autoregressive_history():
    """Row (request b, offset i) equals the row an autoregressive step computes after appending
    drafts[:i] to b's generated tokens: offset 0 with those drafts folded into the entries."""
    g = gen("history")
    logits, args = penalty_case(g, b=4, k=5, v=30)
    req, off, drafts, start, tok, cnt, inp, bias, rp, fp, pp = args
    got = logits.clone()
    ops.apply_penalties(got, *args)
    for row in range(logits.shape[0]):
        b, i = int(req[row]), int(off[row])
        table = {int(t): [int(c), bool(p), float(x)] for t, c, p, x in zip(
            tok[start[b]:start[b + 1]], cnt[start[b]:start[b + 1]], inp[start[b]:start[b + 1]],
            bias[start[b]:start[b + 1]])}
        for d in drafts[b, :i].tolist():
            table.setdefault(d, [0, False, 0.0])[0] += 1
        ks = sorted(table)
        one = logits[row:row + 1].clone()
        ops.apply_penalties(one, [0], [0], torch.zeros(1, 0, dtype=torch.int32), [0, len(ks)], ks,
                            [table[t][0] for t in ks], [table[t][1] for t in ks], [table[t][2] for t in ks],
                            rp[b:b + 1], fp[b:b + 1], pp[b:b + 1])
        assert torch.equal(got[row], one[0]), (b, i)


def test_openai_and_hf_formulas():
    """OpenAI: mu - c * frequency - (c > 0) * presence for generated tokens; HF / vLLM: x / rp for
    x > 0 and x * rp for x < 0 for every token of the prompt or the output; bias added first."""
    x = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 4.0]])
    ops.apply_penalties(x, [0], [0], torch.zeros(1, 0, dtype=torch.int32), [0, 5], [0, 1, 2, 3, 4], [0, 0, 3, 2, 0],
                        [True, True, False, True, False], [0.0, 0.0, 0.0, 0.0, 1.5], [2.0], [0.5], [0.25])
    assert x.tolist() == [[1.0, -4.0, 3.0 / 2 - 1.5 - 0.25, -2.0 - 1.0 - 0.25, 2.0, 4.0]]


def test_apply_penalties_matches_transformers_repetition_penalty():
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = gen("rep-hf")
    v = 160
    scores = torch.randn(3, v, generator=g) * 4
    ids = torch.randint(0, v, (3, 40), generator=g)
    for penalty in (1.3, 0.8, 2.0):
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores.clone())
        got = scores.clone()
        start, tok = [0], []
        for r in range(3):
            tok += sorted(set(ids[r].tolist()))
            start.append(len(tok))
        e = len(tok)
        ops.apply_penalties(got, [0, 1, 2], [0, 0, 0], torch.zeros(3, 0, dtype=torch.int32), start, tok,
                            [0] * e, [True] * e, [0.0] * e, [penalty] * 3, [0.0] * 3, [0.0] * 3)
        assert torch.equal(got, want), penalty


def test_apply_penalties_thread_count_changes_nothing():
    logits, args = penalty_case(gen("threads"), b=40, k=4, v=50)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = logits.clone()
            ops.apply_penalties(x, *args)
            outs.append(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))


def _valid():
    """Two requests (K = 2), rows at offsets 0..2 of request 0 and 0..2 of request 1; V = 10."""
    logits = torch.randn(6, 10, generator=gen("bad"))
    return logits, dict(row_request=torch.tensor([0, 0, 0, 1, 1, 1]), row_offset=torch.tensor([0, 1, 2, 0, 1, 2]),
                        draft_token_ids=torch.tensor([[3, 5], [1, 1]], dtype=torch.int32),
                        entry_start=torch.tensor([0, 2, 3]), entry_token=torch.tensor([2, 5, 7], dtype=torch.int32),
                        entry_count=torch.tensor([1, 0, 2], dtype=torch.int32),
                        entry_in_prompt=torch.tensor([False, True, True]), entry_bias=torch.tensor([0.0, 1.0, -2.0]),
                        repetition_penalty=torch.tensor([1.2, 0.9]), frequency_penalty=torch.tensor([0.5, 0.0]),
                        presence_penalty=torch.tensor([0.0, 1.0]))


def _with(name, fn):
    logits, a = _valid()
    a[name] = fn(a[name].clone())
    return logits, a


def _set(i, value):
    def f(t):
        t.view(-1)[i] = value
        return t
    return f


@pytest.mark.parametrize("name, fn, match", [
    ("row_request", _set(0, 2), r"row_request\[0\] = 2 must be in \[0, B=2\)"),
    ("row_offset", _set(1, 3), r"row_offset\[1\] = 3 must be in \[0, K=2\]"),
    ("entry_start", _set(0, 1), r"entry_start\[0\] = 1 must be 0"),
    ("entry_start", _set(2, 10 ** 6), r"entry_start\[2\] = 1000000 must equal the"),
    ("entry_token", lambda t: t.fill_(3), r"must be strictly increasing"),
    ("entry_token", _set(0, -4), r"entry_token\[0\] = -4 is out of range for vocabulary size 10"),
    ("entry_count", _set(0, -1), r"entry_count\[0\] = -1 must be in"),
    ("entry_bias", _set(0, float("inf")), r"entry_bias\[0\] = inf must be finite"),
    ("repetition_penalty", _set(1, 0.0), r"repetition_penalty\[1\] = 0 must be finite and > 0"),
    ("frequency_penalty", _set(0, float("nan")), r"frequency_penalty\[0\] = nan must be finite"),
    ("presence_penalty", _set(0, float("-inf")), r"presence_penalty\[0\] = -inf must be finite"),
    ("draft_token_ids", _set(0, 10), r"draft_token_ids\[0, 0\] = 10 is out of range"),
    ("entry_in_prompt", lambda t: t.int(), r"entry_in_prompt must be a bool tensor"),
    ("entry_bias", lambda t: t[:-1], r"entry_bias must have size"),
    ("repetition_penalty", lambda t: t.double(), None),
    ("row_request", lambda t: t.float(), r"row_request must be an integer tensor"),
])
def test_apply_penalties_bad_input_names_the_argument(name, fn, match):
    logits, a = _with(name, fn)
    if match is None:      # float64 penalties are converted, not refused
        ops.apply_penalties(logits, **a)
        return
    with pytest.raises((ValueError, TypeError), match=match):
        ops.apply_penalties(logits, **a)


def test_apply_penalties_without_checks_stays_in_bounds():
    """Garbage with check_values=False never reads or writes outside the rows: a request out of
    range leaves its row alone, offsets clamp, tokens outside [0, V) are skipped."""
    logits, a = _valid()
    a["row_request"] = torch.tensor([0, 0, 0, 7, -1, 1])
    a["row_offset"] = torch.tensor([-3, 99, 1, 0, 0, 2])
    a["draft_token_ids"] = torch.tensor([[2**30, -5], [3, 3]], dtype=torch.int32)
    a["entry_token"] = torch.full_like(a["entry_token"], 2**31 - 1)
    x = logits.clone()
    ops.apply_penalties(x, **a, check_values=False)
    assert torch.equal(x[3:5], logits[3:5])


def test_apply_penalties_logits_must_be_float32():
    logits, a = _valid()
    with pytest.raises(TypeError, match="logits must be a float32 tensor"):
        ops.apply_penalties(logits.double(), **a)


@CUDA
@pytest.mark.parametrize("seed", range(4))
def test_apply_penalties_cuda_matches_cpu(seed):
    logits, args = penalty_case(gen("penalties-cuda", seed), b=3 + seed, k=seed + 1, v=100 + 37 * seed)
    want = logits.clone()
    ops.apply_penalties(want, *args)
    got = logits.cuda()
    ops.apply_penalties(got, *[a.cuda() for a in args])
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


@CUDA
@pytest.mark.parametrize("v", [50, 1000, 32000])
def test_min_p_cuda_matches_cpu(v):
    """The CUDA kernel's exp is not the CPU's exp_det (probabilities agree to float rounding, as for
    the rest of probs_from_logits): the kept sets agree except for tokens within rounding of the cut."""
    g = gen("min_p-cuda", v)
    n = 32
    logits = torch.randn(n, v, generator=g) * 2
    temps, top_k, top_p = _params(n, v, g)
    top_p = torch.ones(n)                     # top-p's own boundary is covered by tests/test_cuda_kernels.py
    min_p = _min_ps(n, g)
    want = ops.probs_from_logits(logits, temps, top_k, top_p, min_p=min_p)
    got = ops.probs_from_logits(logits.cuda(), temps.cuda(), top_k.cuda(), top_p.cuda(), min_p=min_p.cuda()).cpu()
    full = ops.probs_from_logits(logits, temps, top_k, top_p)
    ratio = full / full.max(-1, keepdim=True).values
    differ = (got > 0) != (want > 0)
    assert bool(((ratio - min_p[:, None]).abs() < 1e-5)[differ].all())
    same = ~differ.any(-1)                    # rows whose kept sets agree (all but a rare boundary case)
    assert int(same.sum()) >= n - 2
    assert torch.allclose(got[same], want[same], atol=1e-6, rtol=0)
