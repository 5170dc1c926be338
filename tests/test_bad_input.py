"""Bad input for every op: a Python exception (ValueError / TypeError) whose message names the
argument -- never a crash, never a silent wrong answer -- and the op still works afterwards.

Devices: a second device is simulated with torch's "meta" device (no data), so the device
checks run on every machine. copy_blocks / write_kv have their own table in test_kv_ops.py.
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops

B, K, V = 3, 2, 7
NAN, INF = float("nan"), float("inf")


def _probs(*shape):
    x = torch.rand(*shape, generator=torch.Generator().manual_seed(0)) + 0.01
    return x / x.sum(-1, keepdim=True)


def rs_args(**override):
    args = dict(target_probs=_probs(B, K + 1, V), draft_probs=_probs(B, K, V),
                draft_token_ids=torch.tensor([[1, 2], [3, -1], [-1, -1]], dtype=torch.int32),
                num_draft_tokens=torch.tensor([2, 1, 0], dtype=torch.int32),
                seeds=torch.tensor([1, -5, 2**40]), positions=torch.tensor([0, 7, 2**33]))
    args.update(override)
    return args


def _rs(method="rejection", **override):
    a = rs_args(**override)
    return ops.rejection_sample(a["target_probs"], a["draft_probs"], a["draft_token_ids"], a["num_draft_tokens"],
                                a["seeds"], a["positions"], method=method)


def _check_rejection_still_works():
    out, acc = _rs()
    assert out.shape == (B, K + 1) and acc.shape == (B,)
    out2, acc2 = _rs()
    assert torch.equal(out, out2) and torch.equal(acc, acc2)


def _nan_at(t, idx, value=NAN):
    t = t.clone()
    t[idx] = value
    return t


META = "meta"
RS_CASES = [
    # wrong shape
    (dict(target_probs=_probs(B, V)), ValueError, r"target_probs must be 3-D"),
    (dict(target_probs=_probs(B, K + 1, 0)), ValueError, r"target_probs must be \[B, K\+1, V\]"),
    (dict(draft_probs=_probs(B, K, V + 1)), ValueError, r"draft_probs must have size 7 \(V of target_probs\)"),
    (dict(draft_probs=_probs(B, K + 1, V)), ValueError, r"draft_probs must have size 2 \(K ="),
    (dict(draft_token_ids=torch.zeros(B, K + 1, dtype=torch.int32)), ValueError,
     r"draft_token_ids must have size 2 \(K ="),
    (dict(draft_token_ids=torch.zeros(B * K, dtype=torch.int32)), ValueError, r"draft_token_ids must be 2-D"),
    # mismatched batch sizes
    (dict(draft_probs=_probs(B + 1, K, V)), ValueError, r"draft_probs must have size 3 \(B of target_probs\)"),
    (dict(draft_token_ids=torch.zeros(B - 1, K, dtype=torch.int32)), ValueError,
     r"draft_token_ids must have size 3 \(B of target_probs\)"),
    (dict(num_draft_tokens=torch.tensor([1, 1])), ValueError, r"num_draft_tokens must have size 3"),
    (dict(seeds=torch.tensor([1, 2, 3, 4])), ValueError, r"seeds must have size 3"),
    (dict(positions=torch.tensor([1])), ValueError, r"positions must have size 3"),
    # dtype
    (dict(target_probs=torch.ones(B, K + 1, V, dtype=torch.int32)), TypeError,
     r"target_probs must be a floating-point tensor"),
    (dict(draft_probs=torch.ones(B, K, V, dtype=torch.int64)), TypeError, r"draft_probs must be a floating-point"),
    (dict(draft_token_ids=torch.zeros(B, K)), TypeError, r"draft_token_ids must be a[n]? integer tensor"),
    (dict(num_draft_tokens=torch.tensor([1.0, 1.0, 0.0])), TypeError, r"num_draft_tokens must be a[n]? integer"),
    (dict(seeds=torch.tensor([1.0, 2.0, 3.0])), TypeError, r"seeds must be a[n]? integer tensor"),
    (dict(positions=torch.tensor([0.5, 1.0, 2.0])), TypeError, r"positions must be a[n]? integer tensor"),
    (dict(target_probs=[[0.5, 0.5]]), TypeError, r"target_probs must be a torch.Tensor"),
    # device (meta stands in for a second device)
    (dict(seeds=torch.tensor([1, 2, 3], device=META)), ValueError, r"seeds must be on cpu"),
    (dict(draft_probs=_probs(B, K, V).to(META)), ValueError, r"draft_probs must be on cpu"),
    (dict(positions=torch.tensor([1, 2, 3], device=META)), ValueError, r"positions must be on cpu"),
    # non-contiguous
    (dict(target_probs=_probs(B, V, K + 1).transpose(1, 2)), ValueError, r"target_probs must be contiguous"),
    (dict(draft_probs=_probs(B, V, K).transpose(1, 2)), ValueError, r"draft_probs must be contiguous"),
    # NaN / negative / infinite probabilities
    (dict(target_probs=_nan_at(_probs(B, K + 1, V), (1, 2, 3))), ValueError,
     r"target_probs must hold finite non-negative probabilities"),
    (dict(target_probs=_nan_at(_probs(B, K + 1, V), (0, 0, 0), -0.1)), ValueError,
     r"target_probs must hold finite non-negative probabilities; element 0"),
    (dict(target_probs=_nan_at(_probs(B, K + 1, V), (2, 2, 6), INF)), ValueError, r"target_probs must hold finite"),
    (dict(draft_probs=_nan_at(_probs(B, K, V), (2, 1, 1))), ValueError, r"draft_probs must hold finite"),
    (dict(draft_probs=_nan_at(_probs(B, K, V), (0, 0, 5), -1e-3)), ValueError, r"draft_probs must hold finite"),
    # out-of-range token ids (inside num_draft_tokens; padding beyond it is free)
    (dict(draft_token_ids=torch.tensor([[1, V], [3, -1], [-1, -1]])), ValueError,
     r"draft_token_ids\[0, 1\] = 7 is out of range for vocabulary size 7"),
    (dict(draft_token_ids=torch.tensor([[1, 2], [-1, -1], [-1, -1]])), ValueError,
     r"draft_token_ids\[1, 0\] = -1 is out of range"),
    # num_draft_tokens out of [0, K]
    (dict(num_draft_tokens=torch.tensor([3, 1, 0])), ValueError, r"num_draft_tokens\[0\] = 3 must be in \[0, K=2\]"),
    (dict(num_draft_tokens=torch.tensor([2, 1, -1])), ValueError, r"num_draft_tokens\[2\] = -1 must be in \[0, K=2\]"),
    # positions must be >= 0
    (dict(positions=torch.tensor([0, -3, 1])), ValueError, r"positions\[1\] = -3 must be >= 0"),
    (dict(seeds=None), ValueError, r"seeds must be a tensor, got None"),
]


@pytest.mark.parametrize("method", ["rejection", "coupled"])
@pytest.mark.parametrize("override,exc,match", RS_CASES)
def test_rejection_sample_bad_input(method, override, exc, match):
    if method == "coupled" and "draft_probs must hold" in match:
        pytest.skip("coupled mode never reads draft_probs values")
    with pytest.raises(exc, match=match):
        _rs(method=method, **override)
    _check_rejection_still_works()


def test_rejection_sample_unknown_method_and_meta_inputs():
    with pytest.raises(ValueError, match=r"method must be one of"):
        _rs(method="greedy")
    # everything on a device this build has no kernels for: a clear error, not a crash
    meta = {k: (v.to(META) if isinstance(v, torch.Tensor) else v) for k, v in rs_args().items()}
    with pytest.raises(ValueError, match=r"target_probs is on meta"):
        _rs(**meta)
    _check_rejection_still_works()


def test_padding_beyond_num_draft_tokens_is_not_validated_and_not_read():
    """Draft ids past num_draft_tokens are padding: any value is accepted and ignored."""
    out, acc = _rs()
    junk = torch.tensor([[1, 2], [3, 2**31 - 1], [-7, 123456]], dtype=torch.int32)
    out2, acc2 = _rs(draft_token_ids=junk)
    assert torch.equal(out, out2) and torch.equal(acc, acc2)


# --------------------------------------------------------------------------- #
def _vg(**override):
    a = dict(target_logits=torch.randn(B, K + 1, V), draft_token_ids=torch.tensor([[1, 2], [3, -1], [-1, -1]]),
             num_draft_tokens=torch.tensor([2, 1, 0]))
    a.update(override)
    return ops.verify_greedy(a["target_logits"], a["draft_token_ids"], a["num_draft_tokens"])


VG_CASES = [
    (dict(target_logits=torch.randn(B, V)), ValueError, r"target_logits must be 3-D"),
    (dict(target_logits=torch.randn(B, K + 1, V).transpose(0, 1)), ValueError, r"target_logits must be contiguous"),
    (dict(target_logits=torch.ones(B, K + 1, V, dtype=torch.int64)), TypeError, r"target_logits must be a floating"),
    (dict(target_logits=torch.randn(B, K + 1, 0)), ValueError, r"target_logits must be \[B, K\+1, V\]"),
    (dict(draft_token_ids=torch.zeros(B, K + 2, dtype=torch.int32)), ValueError, r"draft_token_ids must have size 2"),
    (dict(draft_token_ids=torch.zeros(B + 1, K, dtype=torch.int32)), ValueError,
     r"draft_token_ids must have size 3 \(B of target_logits\)"),
    (dict(draft_token_ids=torch.zeros(B, K)), TypeError, r"draft_token_ids must be a[n]? integer"),
    (dict(draft_token_ids=torch.tensor([[1, 2], [V + 3, -1], [-1, -1]])), ValueError,
     r"draft_token_ids\[1, 0\] = 10 is out of range"),
    (dict(num_draft_tokens=torch.tensor([2, 1])), ValueError, r"num_draft_tokens must have size 3"),
    (dict(num_draft_tokens=torch.tensor([2, 1, 5])), ValueError, r"num_draft_tokens\[2\] = 5 must be in \[0, K=2\]"),
    (dict(num_draft_tokens=torch.tensor([2, 1, 0], device=META)), ValueError, r"num_draft_tokens must be on cpu"),
]


@pytest.mark.parametrize("override,exc,match", VG_CASES)
def test_verify_greedy_bad_input(override, exc, match):
    with pytest.raises(exc, match=match):
        _vg(**override)
    out, acc = _vg()
    assert out.shape == (B, K + 1)


# --------------------------------------------------------------------------- #
def _pfl(**override):
    a = dict(logits=torch.randn(B, V), temperature=torch.tensor([0.0, 0.7, 1.0]), top_k=torch.tensor([0, 3, 7]),
             top_p=torch.tensor([1.0, 0.9, 0.5]))
    a.update(override)
    return ops.probs_from_logits(a["logits"], a["temperature"], a["top_k"], a["top_p"])


PFL_CASES = [
    (dict(logits=torch.randn(B, K, V)), ValueError, r"logits must be 2-D"),
    (dict(logits=torch.randn(B, 0)), ValueError, r"logits must have a non-empty vocabulary"),
    (dict(logits=torch.randn(V, B).t()), ValueError, r"logits must be contiguous"),
    (dict(logits=torch.ones(B, V, dtype=torch.int32)), TypeError, r"logits must be a floating-point"),
    (dict(logits=torch.randn(B, V, device=META)), ValueError, r"temperature must be on meta"),
    (dict(temperature=torch.tensor([0.0, 0.7, 1.0], device=META)), ValueError, r"temperature must be on cpu"),
    (dict(temperature=torch.tensor([1.0, 1.0])), ValueError, r"temperature must have size 3 \(rows of logits\)"),
    (dict(top_k=torch.tensor([1, 1, 1, 1])), ValueError, r"top_k must have size 3"),
    (dict(top_p=torch.tensor([1.0])), ValueError, r"top_p must have size 3"),
    (dict(temperature=torch.tensor([1.0, -0.5, 1.0])), ValueError, r"temperature\[1\] = -0.5 must be finite and >= 0"),
    (dict(temperature=torch.tensor([1.0, NAN, 1.0])), ValueError, r"temperature\[1\] = nan must be finite"),
    (dict(temperature=torch.tensor([INF, 1.0, 1.0])), ValueError, r"temperature\[0\] = inf must be finite"),
    (dict(top_k=torch.tensor([0, -1, 3])), ValueError, r"top_k\[1\] = -1 must be >= 0"),
    (dict(top_k=torch.tensor([0.0, 1.0, 3.0])), TypeError, r"top_k must be a[n]? integer tensor"),
    (dict(top_p=torch.tensor([1.0, 0.0, 0.5])), ValueError, r"top_p\[1\] = 0 must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([1.0, 0.9, 1.5])), ValueError, r"top_p\[2\] = 1.5 must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([NAN, 0.9, 0.5])), ValueError, r"top_p\[0\] = nan must be in \(0, 1\]"),
    (dict(top_p=torch.tensor([1, 1, 1])), TypeError, r"top_p must be a floating-point tensor"),
    # a sampled row whose largest logit / temperature overflows float32 (would be NaN); greedy row 0 is fine
    (dict(logits=torch.full((B, V), 3e38), temperature=torch.tensor([0.0, 0.5, 1.0])), ValueError,
     r"logits\[1\] has largest logit 3e\+38, which divided by temperature\[1\] = 0.5 overflows float32"),
]


@pytest.mark.parametrize("override,exc,match", PFL_CASES)
def test_probs_from_logits_bad_input(override, exc, match):
    with pytest.raises(exc, match=match):
        _pfl(**override)
    probs = _pfl()
    assert torch.allclose(probs.sum(-1), torch.ones(B), atol=1e-5)


# --------------------------------------------------------------------------- #
def _st(purpose="target", **override):
    a = dict(probs=_probs(B, V), seeds=torch.tensor([1, 2, 3]), positions=torch.tensor([0, 1, 2**40]))
    a.update(override)
    return ops.sample_tokens(a["probs"], a["seeds"], a["positions"], purpose=purpose)


ST_CASES = [
    (dict(probs=_probs(B, K, V)), ValueError, r"probs must be 2-D"),
    (dict(probs=_probs(B, 0)), ValueError, r"probs must have a non-empty vocabulary"),
    (dict(probs=_probs(V, B).t()), ValueError, r"probs must be contiguous"),
    (dict(probs=torch.ones(B, V, dtype=torch.int64)), TypeError, r"probs must be a floating-point"),
    (dict(probs=_nan_at(_probs(B, V), (1, 1))), ValueError, r"probs must hold finite non-negative"),
    (dict(probs=_nan_at(_probs(B, V), (2, 0), -0.5)), ValueError, r"probs must hold finite non-negative"),
    (dict(probs=_nan_at(_probs(B, V), (0, 6), INF)), ValueError, r"probs must hold finite non-negative"),
    (dict(seeds=torch.tensor([1, 2])), ValueError, r"seeds must have size 3 \(rows of probs\)"),
    (dict(positions=torch.tensor([1, 2, 3, 4])), ValueError, r"positions must have size 3"),
    (dict(positions=torch.tensor([1, -2, 3])), ValueError, r"positions\[1\] = -2 must be >= 0"),
    (dict(seeds=torch.tensor([1.5, 2.0, 3.0])), TypeError, r"seeds must be a[n]? integer tensor"),
    (dict(seeds=torch.tensor([1, 2, 3], device=META)), ValueError, r"seeds must be on cpu"),
    (dict(probs=_probs(B, V).to(META)), ValueError, r"seeds must be on meta"),
]


@pytest.mark.parametrize("override,exc,match", ST_CASES)
def test_sample_tokens_bad_input(override, exc, match):
    with pytest.raises(exc, match=match):
        _st(**override)
    assert _st().shape == (B,)


def test_sample_tokens_unknown_purpose():
    with pytest.raises(ValueError, match=r"purpose must be one of"):
        _st(purpose="accepted")
    with pytest.raises(ValueError, match=r"purpose must be one of"):
        _st(purpose=4)
    assert _st().shape == (B,)


def test_uniform_noise_unknown_purpose_names_the_choices():
    """Issue 14, defect 10: an unknown purpose was a bare KeyError."""
    one = torch.tensor([1])
    for purpose in ("accepted", 4, None, ["target"]):
        with pytest.raises(ValueError, match=r"purpose must be one of \['accept', 'draft', 'residual', 'target'\]"):
            ops.uniform_noise(one, one, purpose, one)
    with pytest.raises(ValueError, match=r"purpose must be one of"):
        _st(purpose=["target"])
    assert 0.0 < float(ops.uniform_noise(one, one, "accept", one)[0]) < 1.0


def test_testing_hooks_bad_input():
    with pytest.raises(ValueError, match=r"counter must have 4 words"):
        ops.philox4x32_10([0, 0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"key must have 2 words"):
        ops.philox4x32_10([0, 0, 0, 0], [0])
    with pytest.raises(ValueError, match=r"seeds, positions and index must have the same length"):
        ops.uniform_noise(torch.tensor([1, 2]), torch.tensor([1]), "target", torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"x must be 1-D"):
        ops.log_det(torch.ones(2, 2))
    assert len(ops.philox4x32_10([0, 0, 0, 0], [0, 0])) == 4


# --------------------------------------------------------------------------- #
# check_values=False on the CPU: the ops docstring promises the CUDA kernels stay in bounds
# without value checks (bad ids rejected, bad slots skipped). One contract per op means the
# CPU kernels must not read or write out of bounds either. Run in a child process: an
# out-of-bounds access may kill the interpreter (that is the bug this catches).
# --------------------------------------------------------------------------- #
_UNCHECKED = {
    "rejection_sample_bad_id": "tp = torch.full((1, 2, 7), 1 / 7.0); ids = torch.tensor([[10**8]], dtype=torch.int32)\n"
                               "ops.rejection_sample(tp, None, ids, [1], [1], [0], check_values=False)",
    "copy_blocks_bad_block": "c = torch.zeros(1, 2, 2, 2, 1, 4)\n"
                             "ops.copy_blocks([c], torch.tensor([[10**9, 1]]), check_values=False)",
    "write_kv_bad_slot": "c = torch.zeros(1, 2, 2, 2, 1, 4)\n"
                         "ops.write_kv(c, 0, torch.ones(1, 1, 4), torch.ones(1, 1, 4), torch.tensor([10**9]),"
                         " check_values=False)",
}


@pytest.mark.parametrize("case", sorted(_UNCHECKED))
def test_unchecked_cpu_kernels_never_crash(case, tmp_path):
    import subprocess
    import sys
    code = "import torch\nfrom specrt import ops\n" + _UNCHECKED[case] + "\nprint('survived')"
    # cwd outside the source tree: the child must import the installed specrt (with its _C)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0 and "survived" in proc.stdout, (case, proc.returncode, proc.stderr[-500:])


# --------------------------------------------------------------------------- #
# Integers wider than the kernels' int32 (issue 14, defect 5): range-checked on the real
# value before narrowing; without value checks they saturate (an id past the vocabulary is
# rejected, a huge top_k is off), never wrap around to a small valid value.
# --------------------------------------------------------------------------- #
_WIDE = [
    ("verify_greedy", dict(draft_token_ids=torch.tensor([[2**32 + 1, 0], [3, -1], [-1, -1]])),
     r"draft_token_ids\[0, 0\] = 4294967297 is out of range"),
    ("verify_greedy", dict(num_draft_tokens=torch.tensor([2**32 + 2, 1, 0])),
     r"num_draft_tokens\[0\] = 4294967298 must be in \[0, K=2\]"),
    ("rejection_sample", dict(draft_token_ids=torch.tensor([[2**32 + 1, 0], [3, -1], [-1, -1]])),
     r"draft_token_ids\[0, 0\] = 4294967297 is out of range"),
    ("rejection_sample", dict(num_draft_tokens=[2**32 + 2, 1, 0]), r"num_draft_tokens\[0\] = 4294967298 must be in"),
    ("probs_from_logits", dict(top_k=torch.tensor([0, 2**32 + 1, 3])), r"top_k\[1\] = 4294967297 must be <= 2\^31 - 1"),
    ("probs_from_logits", dict(top_k=[2**31, 0, 0]), r"top_k\[0\] = 2147483648 must be <= 2\^31 - 1"),
    ("probs_from_logits", dict(top_k=torch.tensor([0, -2**40, 3])), r"top_k\[1\] = -1099511627776 must be >= 0"),
]


@pytest.mark.parametrize("op,override,match", _WIDE)
def test_int64_arguments_range_checked_before_narrowing(op, override, match):
    call = {"verify_greedy": _vg, "rejection_sample": _rs, "probs_from_logits": _pfl}[op]
    with pytest.raises(ValueError, match=match):
        call(**override)


def test_unchecked_int64_arguments_saturate_instead_of_wrapping():
    logits = torch.tensor([[[0.0, 9.0, 1.0], [0.0, 0.0, 9.0]]])       # argmax 1, then 2
    # id 2**32 + 1 would wrap to 1 (the argmax) and be accepted; saturated, it is rejected
    out, acc = ops.verify_greedy(logits, torch.tensor([[2**32 + 1]]), [1], check_values=False)
    assert acc.tolist() == [0] and out.tolist() == [[1, -1]]
    tp = torch.nn.functional.one_hot(torch.tensor([[1, 2]]), 3).float()
    out, acc = ops.rejection_sample(tp, None, torch.tensor([[2**32 + 1]]), [1], [5], [0], check_values=False)
    assert acc.tolist() == [0] and out.tolist() == [[1, -1]]
    # a count of 2**32 + 2 would wrap to 2 (> K: clamped either way); 2**32 + 0 would wrap to 0
    out, acc = ops.verify_greedy(logits, torch.tensor([[1]]), [2**32], check_values=False)
    assert acc.tolist() == [1] and out.tolist() == [[1, 2]]
    # top_k 2**32 + 1 would wrap to 1 (top-1: one-hot); it means "keep more than V": off
    row = torch.tensor([[1.0, 2.0, 3.0]])
    off = ops.probs_from_logits(row, [1.0], [0], [1.0])
    assert torch.equal(ops.probs_from_logits(row, [1.0], [2**32 + 1], [1.0], check_values=False), off)
    assert torch.equal(ops.probs_from_logits(row, [1.0], torch.tensor([2**31]), [1.0], check_values=False), off)


def test_int_arguments_of_any_integer_dtype():
    """int8/int16/uint8 ids and counts are widened, not misread; bool is not an integer."""
    logits = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(5))
    ids = logits[:, :K].argmax(-1)
    ids[1, 1] = -1
    want = ops.verify_greedy(logits, ids.int(), torch.tensor([2, 1, 0], dtype=torch.int32))
    assert want[1].tolist() == [2, 1, 0]
    for dtype, count_dtype in ((torch.int8, torch.uint8), (torch.int16, torch.int16), (torch.int64, torch.int64)):
        got = ops.verify_greedy(logits, ids.to(dtype), torch.tensor([2, 1, 0], dtype=count_dtype))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(TypeError, match=r"num_draft_tokens must be an integer tensor"):
        _vg(num_draft_tokens=torch.tensor([True, False, False]))
    with pytest.raises(TypeError, match=r"top_k must be an integer tensor"):
        _pfl(top_k=torch.tensor([0, 1, 2], dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"top_k must be a tensor or a list of numbers"):
        _pfl(top_k=[2**64, 0, 0])


# --------------------------------------------------------------------------- #
# All-zero probability rows (issue 14, defect 10): nothing to sample. With value checks they
# are an error naming the row; without, the documented fallback is token 0.
# --------------------------------------------------------------------------- #
def test_all_zero_probability_rows_rejected_with_value_checks():
    probs = _probs(B, V)
    probs[1] = 0.0
    with pytest.raises(ValueError, match=r"probs\[1\] is all zero"):
        _st(probs=probs)
    assert int(ops.sample_tokens(probs, [1, 2, 3], [0, 1, 2], check_values=False)[1]) == 0
    # a target row the request can reach (position <= num_draft_tokens) ...
    tp = _probs(B, K + 1, V)
    tp[1, 1] = 0.0                       # request 1 drafts 1 token: it can reach position 1
    for method in ("rejection", "coupled"):
        with pytest.raises(ValueError, match=r"target_probs\[1, 1\] is all zero"):
            _rs(method=method, target_probs=tp)
    # ... but not one beyond it (padding rows are never read)
    tp = _probs(B, K + 1, V)
    tp[1, 2] = 0.0
    tp[2, 1:] = 0.0
    _rs(target_probs=tp)
    # a draft row a drafted token came from
    dp = _probs(B, K, V)
    dp[0, 1] = 0.0
    with pytest.raises(ValueError, match=r"draft_probs\[0, 1\] is all zero"):
        _rs(draft_probs=dp)
    _rs(method="coupled", draft_probs=dp)   # coupled mode never reads draft_probs
    _check_rejection_still_works()
