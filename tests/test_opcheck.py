"""specrt's kernels are real torch ops (issue 13): a schema per op, CPU (and CUDA)
implementations, fake kernels. ``torch.library.opcheck`` runs its schema, fake-tensor,
autograd-registration and AOT-dispatch checks on every op, and a small speculative step
compiled with ``torch.compile(fullgraph=True)`` (no graph break) matches eager.
"""
from __future__ import annotations

import pytest
import torch

from specrt import ops

from _cases import gen, random_rows, seeds_positions  # noqa: E402  (tests/ on sys.path)

SPECRT = torch.ops.specrt
OPS = ("probs_from_logits", "verify_greedy", "rejection_sample", "sample_tokens", "copy_blocks", "write_kv",
       "uniform_noise", "log_det", "apply_penalties", "verify_tree_greedy", "rejection_sample_tree", "copy_slots",
       "apply_token_bitmask")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and ops.cuda_built()), reason="needs a CUDA GPU and a CUDA build of specrt"))]
B, K, V = 3, 2, 11


def _step_inputs(device: str, seed: str = "step"):
    """(logits [B,K+1,V], temperature, top_k, top_p [B*(K+1)], draft ids [B,K], counts [B], seeds, positions)."""
    g = gen(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    rows = B * (K + 1)
    temperature = torch.tensor([0.0, 0.7, 1.0] * B)[:rows]
    top_k = torch.tensor([0, 5, 3] * B, dtype=torch.int32)[:rows]
    top_p = torch.tensor([1.0, 0.9, 0.8] * B)[:rows]
    ids = torch.randint(0, V, (B, K), generator=g, dtype=torch.int32)
    ids[0] = logits[0, :K].argmax(-1).int()          # request 0 drafts the argmaxes
    counts = torch.tensor([K, 1, 0], dtype=torch.int32)
    seeds, positions = seeds_positions(g, B)
    tensors = (logits, temperature, top_k, top_p, ids, counts, seeds, positions)
    return tuple(t.to(device) for t in tensors)


def _cases(device: str) -> dict[str, list[tuple]]:
    """Arguments for every op, as the op's schema takes them (several cases for some)."""
    g = gen("opcheck", device)
    logits, temperature, top_k, top_p, ids, counts, seeds, positions = _step_inputs(device)
    dev = torch.device(device)
    p = random_rows(g, (B, K + 1), V).to(dev)
    q = random_rows(g, (B, K), V).to(dev)
    flat = logits.reshape(-1, V)
    caches = [torch.randn(2, 2, 6, 4, 2, 3, generator=g).to(dev),
              torch.randn(1, 2, 7, 4, 1, 5, generator=g).to(device=dev, dtype=torch.bfloat16)]
    cache = torch.randn(3, 2, 5, 2, 2, 4, generator=g).to(dev)
    kv = torch.randn(4, 2, 4, generator=g).to(dev)
    tree_parents = torch.tensor([[-1, -1]] * B, dtype=torch.int32, device=dev)   # two siblings per request
    cases = {
        "probs_from_logits": [(flat, temperature, top_k, top_p, None, True),
                              (flat.clone().requires_grad_(), temperature, top_k.long(), top_p, None, False),
                              (flat, temperature, top_k, top_p, torch.tensor([0.0, 0.1, 0.5] * B, device=dev), True)],
        "verify_greedy": [(logits, ids, counts, True), (logits, ids.long(), counts.to(torch.int16), False)],
        "rejection_sample": [(p, q, ids, counts, seeds, positions, "rejection", True),
                             (p, None, ids, counts, seeds, positions, "rejection", True),
                             (p.clone().requires_grad_(), q, ids, counts, seeds, positions, "coupled", False)],
        "sample_tokens": [(p[:, 0].contiguous(), seeds, positions, 4, True),
                          (p[:, 1].contiguous(), seeds, positions, 1, False)],
        "copy_blocks": [(caches, torch.tensor([[0, 3], [5, 1]], device=dev), True),
                        (caches, torch.tensor([[2, 4]]), False)],                     # CPU mapping
        "write_kv": [(cache, 1, kv, kv * 2, torch.tensor([0, -1, 9, 4], device=dev), True)],
        "copy_slots": [(caches, torch.tensor([[5, 3], [3, 1], [20, 20]], device=dev), True),
                       (caches, torch.tensor([[2, 4]]), False)],                      # CPU mapping
        "verify_tree_greedy": [(logits, ids, tree_parents, counts, True),
                               (logits, ids.long(), tree_parents.long(), counts.to(torch.int16), False)],
        "rejection_sample_tree": [(p, q, ids, tree_parents, counts, seeds, positions, "rejection", True),
                                  (p, None, ids, tree_parents, counts, seeds, positions, "rejection", True),
                                  (p.clone().requires_grad_(), None, ids, tree_parents, counts, seeds, positions,
                                   "coupled", False)],
        "apply_penalties": [_penalty_args(flat, ids, dev, True), _penalty_args(flat, ids.long(), dev, False)],
        "apply_token_bitmask": [(flat.clone(), torch.tensor([[5], [-1]], dtype=torch.int32, device=dev),
                                 torch.tensor([4, 0], device=dev), True),
                                (flat.clone().bfloat16(), torch.zeros(flat.shape[0], 2, dtype=torch.int32, device=dev),
                                 torch.arange(flat.shape[0], dtype=torch.int32, device=dev), False)],
    }
    if device == "cpu":   # testing hooks: CPU only
        index = torch.tensor([0, 1, 2**31 - 1])
        cases["uniform_noise"] = [(seeds, positions, 2, index)]
        cases["log_det"] = [(torch.rand(7, generator=g) + 1e-3,)]
    return cases


def _penalty_args(flat, ids, dev, check):
    """apply_penalties over the [B*(K+1), V] rows of _step_inputs: row (b, i) after b's drafts [:i]."""
    t = lambda x, dtype=None: torch.tensor(x, dtype=dtype, device=dev)   # noqa: E731
    return (flat.clone(), t([b for b in range(B) for _ in range(K + 1)]), t(list(range(K + 1)) * B), ids,
            t([0, 2, 2, 3]), t([1, 4, 6], torch.int32), t([2, 0, 1], torch.int32), t([False, True, True]),
            t([0.5, 0.0, -1.0]), t([1.3, 1.0, 0.8]), t([0.2, 0.0, 0.5]), t([0.1, 0.0, -0.3]), check)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, device):
    cases = _cases(device)
    if name not in cases:
        pytest.skip(f"{name} has no {device} implementation (a CPU testing hook)")
    for args in cases[name]:
        torch.library.opcheck(getattr(SPECRT, name).default, args, raise_exception=True)


def test_every_op_has_a_schema_and_mutations_are_declared():
    for name in OPS:
        schema = getattr(SPECRT, name).default._schema
        mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == {"copy_blocks": ["caches"], "copy_slots": ["caches"], "write_kv": ["cache"],
                           "apply_penalties": ["logits"], "apply_token_bitmask": ["logits"]}.get(
            name, []), (name, str(schema))


def test_sampling_ops_are_not_differentiable():
    """Outputs never require grad (an Autograd fallthrough), instead of a grad_fn that would
    warn and return wrong (zero) gradients on backward."""
    x = torch.randn(2, 5, requires_grad=True)
    assert not ops.probs_from_logits(x, [1.0, 0.5], [0, 2], [1.0, 0.9]).requires_grad
    assert not ops.log_det(torch.rand(3, requires_grad=True) + 0.1).requires_grad


def _speculative_step(logits, temperature, top_k, top_p, ids, counts, seeds, positions):
    """Sample-mode and greedy verification of one step, as the engine chains the ops."""
    probs = ops.probs_from_logits(logits.reshape(-1, logits.shape[-1]), temperature, top_k, top_p)
    probs = probs.view(logits.shape)                                         # [B, K+1, V]
    out, accepted = ops.rejection_sample(probs, None, ids, counts, seeds, positions)
    coupled, coupled_accepted = ops.rejection_sample(probs, None, ids, counts, seeds, positions, method="coupled")
    greedy, greedy_accepted = ops.verify_greedy(logits, ids, counts)
    bonus = ops.sample_tokens(probs[:, 0].contiguous(), seeds, positions)
    return out, accepted, coupled, coupled_accepted, greedy, greedy_accepted, bonus


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_step_matches_eager_without_graph_breaks(backend, device):
    torch._dynamo.reset()
    inputs = _step_inputs(device)
    want = _speculative_step(*inputs)
    compiled = torch.compile(_speculative_step, fullgraph=True, backend=backend)
    got = compiled(*inputs)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert int(got[5][0]) == K                                               # request 0 drafted the argmaxes
    # new values, same shapes: the compiled graph is reused and still exact
    other = _step_inputs(device, seed="step-2")
    for a, b in zip(compiled(*other), _speculative_step(*other)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_kv_writes_mutate_the_cache(device):
    """write_kv / copy_blocks mutate their caches under torch.compile (functionalized and
    written back), exactly as in eager mode."""
    torch._dynamo.reset()

    def store(cache, k, v, slots, mapping):
        ops.write_kv(cache, 0, k, v, slots)
        ops.copy_blocks([cache], mapping)
        return cache.sum()

    g = gen("compiled-kv")
    dev = torch.device(device)
    cache = torch.zeros(1, 2, 4, 2, 1, 3, device=dev)
    k, v = torch.randn(3, 1, 3, generator=g).to(dev), torch.randn(3, 1, 3, generator=g).to(dev)
    slots = torch.tensor([0, 1, -1], device=dev)
    mapping = torch.tensor([[0, 2]], device=dev)
    want = cache.clone()
    total = store(want, k, v, slots, mapping)
    got = cache.clone()
    compiled_total = torch.compile(store, fullgraph=True, backend="aot_eager")(got, k, v, slots, mapping)
    assert torch.equal(got, want) and torch.equal(compiled_total, total)
    assert torch.equal(got[0, 0, 2], k[:2]) and torch.equal(got[0, 1, 2], v[:2])   # block 0 copied to block 2
