"""Property-based fuzz of specrt.ops argument checking (issue 14's hostile suite, ops half).

Hypothesis builds a valid call of every op (random sizes including empty ones, random
values) and then mutates some arguments: wrong dtype (incl. bool, complex, int8), wrong or
empty shape, non-contiguous, the meta device, non-tensors (None, lists, strings), and special
values (NaN, +-inf, negatives, 3e38, denormals, integers past int32 and int64 ids past V).
The property: every call either

* raises ValueError / TypeError / RuntimeError whose message names one of the op's
  arguments, or
* returns a valid result: with value checks on, exactly what specrt/ops/reference.py returns
  (probabilities to 1e-5 and valid distributions); with them off, outputs of the documented
  shapes and dtypes with token ids in range (the kernels never trust unchecked values).

Never a crash, a hang or another exception. The examples run in ONE child process (a
segfault or an abort there is a test failure here, not a dead test run) that logs each
example before running it, so a crash names its input. Derandomized: the same examples on
every run; bounded by FUZZ_EXAMPLES per op and a timeout.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import traceback

import pytest
from _env import CHILD_CWD, child_env  # noqa: E402  (tests/ on sys.path)

OPS = ("probs_from_logits", "verify_greedy", "rejection_sample", "sample_tokens", "copy_blocks", "write_kv",
       "uniform_noise", "log_det", "verify_tree_greedy", "rejection_sample_tree", "copy_slots")
FUZZ_EXAMPLES = 200          # per op
CHILD_TIMEOUT_S = 300        # all ops together; ~20-40 s when the machine is quiet


# =============================================================================== parent side
@pytest.fixture(scope="module")
def fuzz_log(tmp_path_factory) -> dict:
    """Run every op's fuzz in one child process; {op: {"status", "detail"}} from its log."""
    log = tmp_path_factory.mktemp("fuzz") / "log.jsonl"
    env = child_env()
    code = f"import test_ops_fuzz as f; f.child_main({str(log)!r}, {FUZZ_EXAMPLES})"
    crash = None
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              cwd=CHILD_CWD, timeout=CHILD_TIMEOUT_S)
        if proc.returncode != 0:
            crash = f"child exited with {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        crash = f"child hung: no result within {CHILD_TIMEOUT_S} s"
    results: dict = {}
    last_example = None
    for line in log.read_text().splitlines() if log.exists() else []:
        entry = json.loads(line)
        if entry["kind"] == "example":
            last_example = entry
        else:
            results[entry["op"]] = entry
    if crash:
        where = f"; last example started: {last_example}" if last_example else ""
        for op in OPS:
            results.setdefault(op, {"status": "crash", "detail": crash + where})
    return results


@pytest.mark.parametrize("op", OPS)
def test_fuzz_op_named_error_or_valid_result(fuzz_log, op):
    entry = fuzz_log.get(op, {"status": "missing", "detail": "the child never reached this op"})
    assert entry["status"] == "pass", f"{op}: {entry['status']}: {entry['detail']}"
    # hypothesis really ran the examples, and they exercised both sides of the property
    assert entry["examples"] >= FUZZ_EXAMPLES // 2, entry
    assert entry["valid"] >= FUZZ_EXAMPLES // 10 and entry["errors"] >= FUZZ_EXAMPLES // 10, entry


# =============================================================================== child side
# Everything below runs in the child process only (imported by child_main).
def child_main(log_path: str, examples: int) -> None:
    import torch
    torch.set_num_threads(1)
    with open(log_path, "w") as log:
        for op in OPS:
            _Fuzzer(op, log).run(examples)


_FLOATS = (float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1e-45, 1e-8, 0.5, 1.0, 3e38, -3e38, 1e30)
_INTS = (-1, 0, 1, 2**31 - 1, 2**31, 2**32 + 1, -2**31 - 1, 2**62, -2**63)
_ARGS = {
    "probs_from_logits": ("logits", "temperature", "top_k", "top_p"),
    "verify_greedy": ("target_logits", "draft_token_ids", "num_draft_tokens"),
    "rejection_sample": ("target_probs", "draft_probs", "draft_token_ids", "num_draft_tokens", "seeds",
                         "positions", "method"),
    "sample_tokens": ("probs", "seeds", "positions", "purpose"),
    "copy_blocks": ("caches", "block_mapping"),
    "write_kv": ("cache", "layer", "k", "v", "slot_mapping"),
    "uniform_noise": ("seeds", "positions", "purpose", "index"),
    "log_det": ("x",),
    "verify_tree_greedy": ("target_logits", "node_token_ids", "node_parents", "num_nodes"),
    "rejection_sample_tree": ("target_probs", "draft_probs", "node_token_ids", "node_parents", "num_nodes", "seeds",
                              "positions", "method"),
    "copy_slots": ("caches", "slot_mapping"),
}


class _Fuzzer:
    """One op: hypothesis draws a valid call, mutates it, runs it, checks the property."""

    def __init__(self, op: str, log):
        self.op, self.log, self.count = op, log, 0
        self.outcomes = {"valid": 0, "errors": 0}

    def _write(self, **entry) -> None:
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()

    def run(self, examples: int) -> None:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(st.data())
        def fuzz(data):
            self.one_example(data)

        try:
            fuzz()
            self._write(kind="result", op=self.op, status="pass", detail="", examples=self.count, **self.outcomes)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            self._write(kind="result", op=self.op, status="fail", detail=traceback.format_exc()[-3000:],
                        examples=self.count, **self.outcomes)

    def one_example(self, data) -> None:
        import torch
        self.count += 1
        args, check = getattr(_Builders, self.op)(_Draw(data))
        self._write(kind="example", op=self.op, n=self.count, args=_describe(args), check_values=check)
        snapshot = _clone(args)
        try:
            result = _call(self.op, args, check)
        except (ValueError, TypeError, RuntimeError) as exc:
            names = _ARGS[self.op]
            msg = str(exc)
            assert any(re.search(rf"(?<![A-Za-z_]){re.escape(n)}(?![A-Za-z_])", msg) for n in names), (
                f"{type(exc).__name__} names no argument of {self.op}: {msg[:500]}")
            self.outcomes["errors"] += 1
            return
        checked = check is True or (check is None and _main_device(args) == torch.device("cpu"))
        _Validate(self.op, snapshot, args, result, checked).run()
        self.outcomes["valid"] += 1


class _Draw:
    """Small helpers over hypothesis' interactive data.draw."""

    def __init__(self, data):
        from hypothesis import strategies as st
        self.data, self.st = data, st
        import torch
        self.g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def pick(self, choices):
        return self.data.draw(self.st.sampled_from(list(choices)))

    def chance(self, p: float) -> bool:
        """True with probability ~p (hypothesis' floats and integers lean to their bounds)."""
        hits = round(20 * p)
        return self.pick([False] * (20 - hits) + [True] * hits)   # shrinks towards False

    def check_values(self):
        return self.pick([None, None, True, False])


def _mutate(d: _Draw, t, kind_float: bool, vocab: int, p: float = 0.3):
    """Return t, or (with probability ~p) a mutated copy: dtype, shape, layout, device,
    special value or non-tensor."""
    import torch
    if not isinstance(t, torch.Tensor) or not d.chance(p):
        return t
    how = d.pick(["dtype", "shape", "noncontig", "device", "value", "value", "nontensor", "empty"])
    if how == "dtype":
        dtype = d.pick([torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16,
                        torch.int32, torch.int64, torch.bool, torch.complex64])
        return t.to(dtype)
    if how == "shape":
        return d.pick([t.unsqueeze(0), t.reshape(-1), t[:1] if t.dim() else t, torch.cat([t, t]) if t.dim() else t])
    if how == "noncontig" and t.dim() >= 1 and t.shape[-1] > 1:
        return torch.stack([t, t], -1)[..., 0] if d.chance(0.5) else t.transpose(0, -1)
    if how == "device":
        return t.to("meta")
    if how == "nontensor":
        return d.pick([None, 3.5, "7", t.tolist(), [[0.5, "x"]], object()])
    if how == "empty" and t.dim() >= 1:
        return t[:0]
    if how == "value" and t.numel() > 0:
        t = t.clone() if (kind_float or t.dtype == torch.int64) else t.to(torch.int64)
        value = d.pick(_FLOATS) if kind_float else d.pick(_INTS + (vocab, -vocab - 1))
        t.view(-1)[d.int(0, t.numel() - 1)] = value
    return t


def _tree(d: _Draw, b: int, n: int, v: int):
    """(node_token_ids [b, n] int32, node_parents [b, n] int32 valid, num_nodes [b] int32)."""
    import torch
    parents = torch.full((b, n), -1, dtype=torch.int32)
    for j in range(1, n):
        parents[:, j] = torch.randint(-1, j, (b,), generator=d.g, dtype=torch.int32)
    return (torch.randint(0, v, (b, n), generator=d.g, dtype=torch.int32), parents,
            torch.randint(0, n + 1, (b,), generator=d.g, dtype=torch.int32))


class _Builders:
    """A valid call of each op (args dict, check_values), then mutations."""

    @staticmethod
    def probs_from_logits(d: _Draw):
        import torch
        n, v = d.int(0, 4), d.int(1, 9)
        logits = torch.randn(n, v, generator=d.g) * d.pick([0.1, 3.0, 1e3])
        args = dict(logits=logits, temperature=torch.tensor([d.pick([0.0, 1e-6, 0.5, 1.0, 2.0]) for _ in range(n)]),
                    top_k=torch.tensor([d.pick([0, 1, 2, v, v + 3]) for _ in range(n)], dtype=torch.int32),
                    top_p=torch.tensor([d.pick([1.0, 0.9, 0.5, 1e-3]) for _ in range(n)]))
        return {k: _mutate(d, t, k != "top_k", v) for k, t in args.items()}, d.check_values()

    @staticmethod
    def verify_greedy(d: _Draw):
        import torch
        b, k, v = d.int(0, 4), d.int(0, 3), d.int(1, 9)
        counts = torch.randint(0, k + 1, (b,), generator=d.g, dtype=torch.int32)
        args = dict(target_logits=torch.randn(b, k + 1, v, generator=d.g),
                    draft_token_ids=torch.randint(0, v, (b, k), generator=d.g, dtype=torch.int32),
                    num_draft_tokens=counts)
        return {key: _mutate(d, t, key == "target_logits", v) for key, t in args.items()}, d.check_values()

    @staticmethod
    def rejection_sample(d: _Draw):
        import torch
        b, k, v = d.int(0, 4), d.int(0, 3), d.int(1, 9)
        target = torch.softmax(torch.randn(b, k + 1, v, generator=d.g) * 2, -1)
        draft = torch.softmax(torch.randn(b, k, v, generator=d.g) * 2, -1) if d.chance(0.7) else None
        args = dict(target_probs=target, draft_probs=draft,
                    draft_token_ids=torch.randint(0, v, (b, k), generator=d.g, dtype=torch.int32),
                    num_draft_tokens=torch.randint(0, k + 1, (b,), generator=d.g, dtype=torch.int32),
                    seeds=torch.randint(-2**62, 2**62, (b,), generator=d.g),
                    positions=torch.randint(0, 2**40, (b,), generator=d.g))
        args = {key: _mutate(d, t, key.endswith("probs"), v) for key, t in args.items()}
        args["method"] = d.pick(["rejection"] * 3 + ["coupled"] * 2 + ["greedy", None, 1])
        return args, d.check_values()

    @staticmethod
    def sample_tokens(d: _Draw):
        import torch
        n, v = d.int(0, 4), d.int(1, 9)
        args = dict(probs=torch.rand(n, v, generator=d.g) * d.pick([1.0, 1e-30, 7.0]),
                    seeds=torch.randint(-2**62, 2**62, (n,), generator=d.g),
                    positions=torch.randint(0, 2**40, (n,), generator=d.g))
        args = {key: _mutate(d, t, key == "probs", v) for key, t in args.items()}
        args["purpose"] = d.pick(["target", "draft", "accept", "residual"] * 2 + ["bogus", 4, None])
        return args, d.check_values()

    @staticmethod
    def copy_blocks(d: _Draw):
        import torch
        caches = []
        for _ in range(d.int(1, 3)):
            shape = (d.int(1, 2), 2, d.int(1, 5), d.int(1, 3), d.int(1, 2), d.int(1, 4))
            caches.append(torch.randn(*shape, generator=d.g).to(d.pick([torch.float32, torch.bfloat16])))
        blocks = min(c.shape[2] for c in caches)
        perm = torch.randperm(blocks, generator=d.g)
        pairs = d.int(0, blocks // 2)
        mapping = torch.stack([perm[:pairs], perm[pairs:2 * pairs]], 1).to(torch.int64)
        caches = [_mutate(d, c, True, blocks) for c in caches]
        if d.chance(0.1):
            caches = d.pick([[], None, caches[0], tuple(caches), "caches"])
        mapping = _mutate(d, mapping, False, blocks)
        if d.chance(0.1):
            mapping = d.pick([[[0.9, 1.7]], [], [0, 1], [[0, 1, 2]], [[2**70, 0]]])
        return dict(caches=caches, block_mapping=mapping), d.check_values()

    @staticmethod
    def write_kv(d: _Draw):
        import torch
        layers, blocks, size, heads, dim = d.int(1, 3), d.int(1, 4), d.int(1, 3), d.int(1, 2), d.int(1, 4)
        dtype = d.pick([torch.float32, torch.float16])
        t = d.int(0, blocks * size)
        slots = torch.randperm(blocks * size, generator=d.g)[:t]
        slots[torch.rand(t, generator=d.g) < 0.2] = -1
        args = dict(cache=torch.zeros(layers, 2, blocks, size, heads, dim, dtype=dtype),
                    k=torch.randn(t, heads, dim, generator=d.g).to(dtype),
                    v=torch.randn(t, heads, dim, generator=d.g).to(dtype), slot_mapping=slots.to(torch.int64))
        args = {key: _mutate(d, x, key != "slot_mapping", blocks * size) for key, x in args.items()}
        args["layer"] = d.pick([0, layers - 1] * 3 + [layers, -1, 0.9, 1.0, None, True, 2**70, "0"])
        return args, d.check_values()

    @staticmethod
    def uniform_noise(d: _Draw):
        import torch
        n = d.int(0, 5)
        args = dict(seeds=torch.randint(-2**62, 2**62, (n,), generator=d.g),
                    positions=torch.randint(0, 2**40, (n,), generator=d.g),
                    index=torch.randint(0, 2**31, (n,), generator=d.g))
        args = {key: _mutate(d, t, False, 2**31) for key, t in args.items()}
        args["purpose"] = d.pick(["target", "draft", "accept", "residual", "bogus", 4, None, ["target"]])
        return args, None

    @staticmethod
    def log_det(d: _Draw):
        import torch
        x = torch.rand(d.int(0, 6), generator=d.g) * d.pick([1.0, 1e30, 1e-30]) + 1e-38
        return dict(x=_mutate(d, x, True, 0, p=0.5)), None

    @staticmethod
    def verify_tree_greedy(d: _Draw):
        import torch
        b, n, v = d.int(0, 4), d.int(0, 4), d.int(1, 9)
        ids, parents, counts = _tree(d, b, n, v)
        args = dict(target_logits=torch.randn(b, n + 1, v, generator=d.g), node_token_ids=ids, node_parents=parents,
                    num_nodes=counts)
        return {key: _mutate(d, t, key == "target_logits", v) for key, t in args.items()}, d.check_values()

    @staticmethod
    def rejection_sample_tree(d: _Draw):
        import torch
        b, n, v = d.int(0, 4), d.int(0, 4), d.int(1, 9)
        ids, parents, counts = _tree(d, b, n, v)
        draft = torch.softmax(torch.randn(b, n, v, generator=d.g) * 2, -1) if d.chance(0.7) else None
        args = dict(target_probs=torch.softmax(torch.randn(b, n + 1, v, generator=d.g) * 2, -1), draft_probs=draft,
                    node_token_ids=ids, node_parents=parents, num_nodes=counts,
                    seeds=torch.randint(-2**62, 2**62, (b,), generator=d.g),
                    positions=torch.randint(0, 2**40, (b,), generator=d.g))
        args = {key: _mutate(d, t, key.endswith("probs"), v) for key, t in args.items()}
        args["method"] = d.pick(["rejection"] * 3 + ["coupled"] * 2 + ["greedy", None, 1])
        return args, d.check_values()

    @staticmethod
    def copy_slots(d: _Draw):
        import torch
        caches = []
        for _ in range(d.int(1, 3)):
            shape = (d.int(1, 2), 2, d.int(1, 4), d.int(1, 3), d.int(1, 2), d.int(1, 4))
            caches.append(torch.randn(*shape, generator=d.g).to(d.pick([torch.float32, torch.bfloat16])))
        slots = min(c.shape[2] * c.shape[3] for c in caches)
        pairs = d.int(0, slots)
        dst = torch.randperm(slots, generator=d.g)[:pairs]                 # distinct destinations
        src = torch.randint(0, slots, (pairs,), generator=d.g)             # any sources, overlaps included
        mapping = torch.stack([src, dst], 1).to(torch.int64)
        caches = [_mutate(d, c, True, slots) for c in caches]
        if d.chance(0.1):
            caches = d.pick([[], None, caches[0], tuple(caches), "caches"])
        mapping = _mutate(d, mapping, False, slots)
        if d.chance(0.1):
            mapping = d.pick([[[0.9, 1.7]], [], [0, 1], [[0, 1, 2]], [[2**70, 0]], [[0, 1], [1, 1]]])
        return dict(caches=caches, slot_mapping=mapping), d.check_values()


def _call(op: str, args: dict, check):
    from specrt import ops
    a = dict(args)
    if op == "rejection_sample":
        return ops.rejection_sample(a.pop("target_probs"), a.pop("draft_probs"), a.pop("draft_token_ids"),
                                    a.pop("num_draft_tokens"), a.pop("seeds"), a.pop("positions"),
                                    method=a.pop("method"), check_values=check)
    if op == "rejection_sample_tree":
        return ops.rejection_sample_tree(a.pop("target_probs"), a.pop("draft_probs"), a.pop("node_token_ids"),
                                         a.pop("node_parents"), a.pop("num_nodes"), a.pop("seeds"), a.pop("positions"),
                                         method=a.pop("method"), check_values=check)
    if op in ("uniform_noise", "log_det"):
        return getattr(ops, op)(**a)
    return getattr(ops, op)(**a, check_values=check)


def _main_device(args: dict):
    import torch
    for value in args.values():
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            return value[0].device
    return torch.device("cpu")


def _clone(args: dict) -> dict:
    import torch

    def one(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, (list, tuple)):
            return type(x)(one(y) for y in x)
        return x
    return {k: one(v) for k, v in args.items()}


def _describe(args: dict) -> dict:
    import torch

    def one(x):
        if isinstance(x, torch.Tensor):
            return f"tensor{list(x.shape)} {x.dtype} {x.device}" + ("" if x.is_contiguous() else " non-contiguous")
        if isinstance(x, (list, tuple)):
            return [one(y) for y in x][:8]
        return repr(x)[:80]
    return {k: one(v) for k, v in args.items()}


def _same_bits(a, b) -> bool:
    """Bit-identical tensors (NaN payloads included, unlike torch.equal)."""
    import torch
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class _Validate:
    """A returned result is valid: the reference's answer (checked) or in bounds (unchecked)."""

    def __init__(self, op, before, after, result, checked):
        self.op, self.before, self.after, self.result, self.checked = op, before, after, result, checked

    def run(self) -> None:
        getattr(self, self.op)()

    def probs_from_logits(self):
        import torch
        from specrt.ops import reference
        a = self.before
        logits = a["logits"]
        n, v = logits.shape
        assert self.result.shape == (n, v) and self.result.dtype == torch.float32
        if not self.checked:
            return
        got = self.result
        assert bool(torch.isfinite(got).all()) and bool((got >= 0).all()), got
        assert torch.allclose(got.double().sum(-1), torch.ones(n, dtype=torch.float64), atol=1e-5), got
        want = reference.probs_from_logits(logits.float(), torch.as_tensor(a["temperature"]).float(),
                                           torch.as_tensor(a["top_k"]), torch.as_tensor(a["top_p"]).float())
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got, want)

    def _tokens(self, b: int, k1: int, v: int):
        import torch
        out, accepted = self.result
        assert out.shape == (b, k1) and accepted.shape == (b,)
        assert out.dtype == torch.int32 and accepted.dtype == torch.int32
        assert bool(((out >= -1) & (out < v)).all()) and bool(((accepted >= 0) & (accepted < k1)).all())
        for r in range(b):   # num_accepted + 1 tokens, then -1 padding
            m = int(accepted[r])
            assert bool((out[r, : m + 1] >= 0).all()) and bool((out[r, m + 1:] == -1).all()), out

    def verify_greedy(self):
        from specrt.ops import reference
        a = self.before
        b, k1, v = a["target_logits"].shape
        self._tokens(b, k1, v)
        if self.checked:
            want = reference.verify_greedy(a["target_logits"].float(), a["draft_token_ids"], a["num_draft_tokens"])
            assert all(bool((x == y).all()) for x, y in zip(self.result, want)), (self.result, want)

    def rejection_sample(self):
        import torch
        from specrt.ops import reference
        a = self.before
        b, k1, v = a["target_probs"].shape
        self._tokens(b, k1, v)
        if self.checked:
            dp = a["draft_probs"].float() if a["draft_probs"] is not None else None
            want = reference.rejection_sample(a["target_probs"].float(), dp, a["draft_token_ids"],
                                              torch.as_tensor(a["num_draft_tokens"]), torch.as_tensor(a["seeds"]),
                                              torch.as_tensor(a["positions"]), method=a["method"])
            assert all(bool((x == y).all()) for x, y in zip(self.result, want)), (self.result, want)

    def sample_tokens(self):
        import torch
        from specrt.ops import reference
        a = self.before
        n, v = a["probs"].shape
        assert self.result.shape == (n,) and self.result.dtype == torch.int32
        assert bool(((self.result >= 0) & (self.result < v)).all())
        if self.checked:
            want = reference.sample_tokens(a["probs"].float(), torch.as_tensor(a["seeds"]),
                                           torch.as_tensor(a["positions"]), a["purpose"])
            assert bool((self.result == want).all()), (self.result, want)

    def copy_blocks(self):
        import torch
        from specrt.ops import reference
        assert self.result is None
        caches = self.before["caches"]
        caches = [caches] if isinstance(caches, torch.Tensor) else list(caches)
        if self.checked:
            reference.copy_blocks(caches, torch.as_tensor(self.before["block_mapping"]).reshape(-1, 2))
            after = self.after["caches"]
            after = [after] if isinstance(after, torch.Tensor) else list(after)
            assert all(_same_bits(x, y) for x, y in zip(after, caches))

    def write_kv(self):
        from specrt.ops import reference
        assert self.result is None
        if self.checked:
            b = self.before
            reference.write_kv(b["cache"], int(b["layer"]), b["k"], b["v"], b["slot_mapping"])
            assert _same_bits(self.after["cache"], b["cache"])

    def _tree_tokens(self, b: int, n1: int, v: int):
        import torch
        out, accepted, nodes = self.result
        assert out.shape == (b, n1) and accepted.shape == (b,) and nodes.shape == (b, n1 - 1)
        assert out.dtype == accepted.dtype == nodes.dtype == torch.int32
        assert bool(((out >= -1) & (out < v)).all()) and bool(((accepted >= 0) & (accepted < n1)).all())
        assert bool(((nodes >= -1) & (nodes < n1 - 1)).all())
        for r in range(b):   # num_accepted + 1 tokens and num_accepted nodes, then -1 padding
            m = int(accepted[r])
            assert bool((out[r, : m + 1] >= 0).all()) and bool((out[r, m + 1:] == -1).all()), out
            assert bool((nodes[r, :m] >= 0).all()) and bool((nodes[r, m:] == -1).all()), nodes

    def verify_tree_greedy(self):
        import torch
        from specrt.ops import reference
        a = self.before
        b, n1, v = a["target_logits"].shape
        self._tree_tokens(b, n1, v)
        if self.checked:
            want = reference.verify_tree_greedy(a["target_logits"].float(), a["node_token_ids"], a["node_parents"],
                                                torch.as_tensor(a["num_nodes"]))
            assert all(bool((x == y).all()) for x, y in zip(self.result, want)), (self.result, want)

    def rejection_sample_tree(self):
        import torch
        from specrt.ops import reference
        a = self.before
        b, n1, v = a["target_probs"].shape
        self._tree_tokens(b, n1, v)
        if self.checked:
            dp = a["draft_probs"].float() if a["draft_probs"] is not None else None
            want = reference.rejection_sample_tree(a["target_probs"].float(), dp, a["node_token_ids"],
                                                   a["node_parents"], torch.as_tensor(a["num_nodes"]),
                                                   torch.as_tensor(a["seeds"]), torch.as_tensor(a["positions"]),
                                                   method=a["method"])
            assert all(bool((x == y).all()) for x, y in zip(self.result, want)), (self.result, want)

    def copy_slots(self):
        import torch
        from specrt.ops import reference
        assert self.result is None
        caches = self.before["caches"]
        caches = [caches] if isinstance(caches, torch.Tensor) else list(caches)
        if self.checked:
            reference.copy_slots(caches, torch.as_tensor(self.before["slot_mapping"]).reshape(-1, 2))
            after = self.after["caches"]
            after = [after] if isinstance(after, torch.Tensor) else list(after)
            assert all(_same_bits(x, y) for x, y in zip(after, caches))

    def uniform_noise(self):
        import torch
        from specrt import ops
        from specrt.ops import reference
        a = self.before
        want = reference.uniform(a["seeds"], a["positions"], ops.PURPOSES[a["purpose"]], a["index"])
        assert self.result.dtype == torch.float32 and torch.equal(self.result, want)
        assert bool(((self.result > 0) & (self.result < 1)).all())

    def log_det(self):
        import torch
        from specrt.ops import reference
        x = self.before["x"].float()
        assert self.result.shape == x.shape and self.result.dtype == torch.float32
        normal = (x > 1.1754944e-38) & torch.isfinite(x)
        assert torch.equal(self.result[normal], reference.log_det(x[normal]))
