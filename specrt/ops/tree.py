"""Token-tree verification ops (docs/architecture.md section 2, "Token trees"): greedy and exact sampled
verification of a tree of draft tokens per request, fused (one call per step).

A request's tree: node j (0 <= j < num_nodes[b]) carries token ``node_token_ids[b, j]`` and
parent ``node_parents[b, j]`` in [-1, j-1] (-1 = a child of the root, the request's pending
token). Siblings are tried in index order; node depth = 1 + its parent's (the root's is 0).
Target row 0 is the root's distribution, row j+1 node j's. ``positions[b]`` is the absolute
position of the request's first emitted token: a node of depth d sits at positions[b] + d - 1.
A chain is the one-child case (parents [-1, 0, 1, ...]) and returns exactly what
``verify_greedy`` / ``rejection_sample`` return.

The ops are torch.ops.specrt.verify_tree_greedy / rejection_sample_tree (schemas in
csrc/tree_ops.cpp, CPU kernel csrc/cpu/tree_cpu.cpp, CUDA kernel csrc/cuda/tree_cuda.cu, shared
math csrc/include/specrt/tree.h, reference specrt/ops/reference.py).
"""
from __future__ import annotations

import torch

from specrt.ops.checks import _as, _check_values, _float_input, _has_kernels, _same_device
from specrt.ops.sampling import METHODS


def verify_tree_greedy(target_logits: torch.Tensor, node_token_ids, node_parents, num_nodes,
                       check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification: follow, from the root, the child equal to the target argmax.

    At the current node t = argmax of its row (NaN counts as -inf, ties to the lowest id, as
    ``verify_greedy``); its first child (lowest index) with token t is accepted and becomes
    current; otherwise t is emitted and the walk stops.

    Shape: target_logits [B, N+1, V], node_token_ids [B, N], node_parents [B, N] (in [-1, j-1]),
    num_nodes [B] (0..N).
    Returns: (output_token_ids [B, N+1] int32 padded with -1: the accepted path's tokens then the
    final token; num_accepted [B] int32; accepted_nodes [B, N] int32 padded with -1: the accepted
    node indices in path order).

    Examples:
        >>> # root -> {0: token 5, 1: token 7}, node 0 -> {2: token 9}; logits [1, 4, V]
        >>> out, n, nodes = ops.verify_tree_greedy(logits, [[5, 7, 9]], [[-1, -1, 0]], [3])
    """
    target_logits = _float_input(target_logits, "target_logits")
    node_token_ids = _as(node_token_ids, "node_token_ids", torch.int32, target_logits)
    node_parents = _as(node_parents, "node_parents", torch.int32, target_logits)
    num_nodes = _as(num_nodes, "num_nodes", torch.int32, target_logits)
    _has_kernels(target_logits, "target_logits")
    return torch.ops.specrt.verify_tree_greedy(target_logits, node_token_ids, node_parents, num_nodes,
                                               _check_values(target_logits, check_values))


def rejection_sample_tree(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, node_token_ids,
                          node_parents, num_nodes, seeds, positions, method: str = "rejection",
                          check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact sampled tree verification, fused: the output is distributed as the target alone.

    method="rejection" (recursive rejection sampling, SpecInfer's multi-draft rule): at the
    current node, with residual p_res = its target row, the children are tried in sibling order;
    the child of rank r with token x and draft row q_r is accepted iff u * q_r(x) < p_res(x), u the
    ACCEPT uniform at (seed, the child's position, index r) (a chain's only child: the chain
    kernel's coin); an accepted child becomes current; a rejection sets p_res = norm(max(p_res -
    q_r, 0)). When every child is rejected, a draw from p_res (RESIDUAL race) is emitted, at a leaf
    the bonus draw from its row; a residual with no mass falls back to the row, as
    ``rejection_sample`` does. draft_probs[b, j] is the distribution node j's token was drawn from,
    independently of its siblings (siblings drawn i.i.d. from one q all carry that q); None means
    deterministic drafts (one-hot q at each node's token, e.g. top-k children).

    method="coupled": at each node the target's own TARGET race winner at that position (what
    ``sample_tokens(..., purpose="target")`` emits there) is followed if some child drafted it and
    emitted otherwise: the output is plain autoregressive sampling with these seeds, whatever the
    tree. draft_probs is not used.

    Shape: target_probs [B, N+1, V], draft_probs [B, N, V] or None, node_token_ids [B, N],
    node_parents [B, N], num_nodes [B], seeds [B] int64, positions [B] int64 (the position of the
    first emitted token; a node of depth d sits at positions[b] + d - 1).
    Returns: (output_token_ids [B, N+1] int32 padded with -1, num_accepted [B] int32,
    accepted_nodes [B, N] int32 padded with -1), as ``verify_tree_greedy``.

    Examples:
        >>> # two top-k children of the root, one grandchild under the first; p [1, 4, V]
        >>> out, n, nodes = ops.rejection_sample_tree(p, None, [[5, 7, 9]], [[-1, -1, 0]], [3],
        ...                                           torch.tensor([7]), torch.tensor([30]))
    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    target_probs = _float_input(target_probs, "target_probs")
    if draft_probs is not None:
        draft_probs = _float_input(draft_probs, "draft_probs")
        _same_device(draft_probs, "draft_probs", target_probs)
    node_token_ids = _as(node_token_ids, "node_token_ids", torch.int32, target_probs)
    node_parents = _as(node_parents, "node_parents", torch.int32, target_probs)
    num_nodes = _as(num_nodes, "num_nodes", torch.int32, target_probs)
    seeds = _as(seeds, "seeds", torch.int64, target_probs)
    positions = _as(positions, "positions", torch.int64, target_probs)
    _has_kernels(target_probs, "target_probs")
    return torch.ops.specrt.rejection_sample_tree(target_probs, draft_probs, node_token_ids, node_parents,
                                                  num_nodes, seeds, positions, method,
                                                  _check_values(target_probs, check_values))
