"""One greedy rule (issue 37): the threshold below which a temperature is greedy lives in
csrc/include/specrt/sampling.h (kGreedyTemperature, is_greedy_temperature); the extension
exposes it, and Python's one ``ops.is_greedy`` reads it. The kernel, the reference, the
engine's SamplingParams.greedy and ops.is_greedy must agree on every temperature, and no
other module may carry a threshold or a greedy comparison of its own."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from specrt import SamplingParams, ops
from specrt.ops import reference

ROOT = Path(__file__).resolve().parent.parent
EPS = float(torch.ops.specrt.greedy_temperature()) if hasattr(torch.ops.specrt, "greedy_temperature") else 1e-5
BELOW = float(np.nextafter(np.float32(EPS), np.float32(0)))      # the largest float32 below the threshold
ABOVE = float(np.nextafter(np.float32(EPS), np.float32(1)))      # the smallest float32 above it
# a float64 a hair below the threshold that float32 (what the kernels read) rounds up to it: sampled
ROUNDS_UP = EPS * (1 - 1e-12)
TEMPERATURES = [0.0, 5e-6, BELOW, ROUNDS_UP, EPS, ABOVE, 2e-5, 1.0]
# logits this close together are far from one-hot at any temperature near the threshold
LOGITS = torch.tensor([[0.0, 1e-6, -1e-6, 5e-7]])


def _kernel_one_hot(t: float, device: str = "cpu") -> bool:
    x = LOGITS.to(device)
    probs = ops.probs_from_logits(x, torch.tensor([t], device=device), torch.tensor([0], device=device),
                                  torch.tensor([1.0], device=device)).cpu()
    return bool((probs == 1.0).any())


def test_python_threshold_is_the_extensions():
    assert hasattr(torch.ops.specrt, "greedy_temperature"), "the extension must expose the greedy threshold"
    assert ops.TEMPERATURE_EPS == float(torch.ops.specrt.greedy_temperature())
    assert ops.TEMPERATURE_EPS == float(np.float32(ops.TEMPERATURE_EPS))      # a float32 value, as the kernels see


@pytest.mark.parametrize("t", TEMPERATURES)
def test_kernel_reference_and_python_agree(t):
    greedy = _kernel_one_hot(t)
    assert greedy == (float(np.float32(t)) < EPS), t                # the rule itself: below the threshold
    assert ops.is_greedy(t) == greedy, t
    assert SamplingParams(temperature=t).greedy == greedy, t
    ref = reference.probs_from_logits(LOGITS, torch.tensor([t]), torch.tensor([0]), torch.tensor([1.0]))
    assert bool((ref == 1.0).any()) == greedy, t
    if torch.cuda.is_available() and ops.cuda_built():
        assert _kernel_one_hot(t, "cuda") == greedy, t


def test_nan_and_negative_are_greedy_as_in_the_kernel():
    """sampling.h: !(t >= eps), so NaN and negative temperatures are greedy (the ops refuse them
    when value checks are on; the rule itself must still say greedy)."""
    assert ops.is_greedy(float("nan")) and ops.is_greedy(-1.0) and not ops.is_greedy(float("inf"))


def _py_sources() -> list[Path]:
    return sorted((ROOT / "specrt").rglob("*.py"))


def _mentions(node: ast.AST, pattern: str) -> bool:
    return any((isinstance(n, ast.Name) and re.search(pattern, n.id, re.I)) or
               (isinstance(n, ast.Attribute) and re.search(pattern, n.attr, re.I)) for n in ast.walk(node))


def _is_eps_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, float) and abs(node.value - 1e-5) < 1e-9


# Where a temperature meets the threshold: ops.is_greedy, and the reference's spec of
# probs_from_logits (it sits below specrt.ops in the layers, so it reads the threshold itself).
RULE_SITES = {"specrt/ops/sampling.py", "specrt/ops/reference.py"}


def test_one_definition_in_python():
    """Exactly one is_greedy and one threshold (read from the extension, not a literal); no module
    compares a temperature with a number, or the threshold, outside the rule sites."""
    defs, thresholds, compares, sites, literals = [], [], [], set(), []
    for path in _py_sources():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), str(path))
        keyword_values = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and "norm" in (k.arg or "")}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "is_greedy":
                defs.append(f"{rel}:{node.lineno}")
            if _is_eps_literal(node) and id(node) not in keyword_values:     # rms_norm_eps=1e-5 is no threshold
                literals.append(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Compare):
                if _mentions(node, r"TEMPERATURE_EPS|greedy_temp"):
                    sites.add(rel)
                rhs = node.comparators[0]
                if len(node.ops) == 1 and _mentions(node.left, "temp") and isinstance(rhs, ast.Constant) and \
                        isinstance(rhs.value, (int, float)) and not isinstance(rhs.value, bool):
                    compares.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
        for node in tree.body:            # module-level names: a threshold by name, or a 1e-5 literal
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                literal = any(_is_eps_literal(n) for n in ast.walk(node.value))
                for name in [t.id for t in targets if isinstance(t, ast.Name)]:
                    if re.search(r"TEMPERATURE_EPS|GREEDY", name, re.I) or literal:
                        thresholds.append(f"{rel}:{node.lineno} {name}")
    assert len(defs) == 1 and defs[0].startswith("specrt/ops/sampling.py:"), defs
    assert len(thresholds) == 1 and thresholds[0].startswith("specrt/ops/sampling.py:"), thresholds
    assert not literals, f"a 1e-5 literal (a threshold of its own?) at {literals}"
    assert sites == RULE_SITES, f"the threshold is compared in {sorted(sites)}: call ops.is_greedy instead"
    assert not compares, "temperatures compared with a number outside ops.is_greedy:\n" + "\n".join(compares)


def test_one_definition_in_cpp():
    """kGreedyTemperature is defined once (sampling.h) and no kernel keeps a greedy test of its own."""
    defs, rules = [], []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh"):
            continue
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        defs += [rel for _ in re.finditer(r"kGreedyTemperature\s*=", text)]
        rules += [f"{rel}: {m.group(0)}" for m in re.finditer(r"\bbool\s+\w*greedy\w*\s*\(\s*float[^)]*\)", text)]
        rules += [f"{rel}: {m.group(0)}" for m in re.finditer(r"temperature\w*\s*[=!<>]=?\s*0(\.0*)?f?\b", text)]
    assert defs == ["csrc/include/specrt/sampling.h"], defs
    assert rules == ["csrc/include/specrt/sampling.h: bool is_greedy_temperature(float t)"], rules
