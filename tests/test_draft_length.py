"""One name for the draft length, clamped in one place (issue 37, item 3).

The public name is ``max_draft_length`` (SpecConfig field, ``specrt serve`` / ``specrt demo``
flag ``--max-draft-length``; ``--draft-length`` is a deprecated spelling of it, never another
setting). Inside specrt/ a request's draft length is ``k`` (``ks`` per batch, ``K`` the batch's
widest, a shape), its bound ``max_k`` (``max_ks``); the retired synonyms below appear in no
identifier. ``num_draft_tokens`` stays: it is the kernels' name (csrc op schemas) for how many
tokens a request did propose, not for the length asked. Every clamp of a draft length goes
through ``specrt.config.clamp_k``."""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from specrt.config import SpecConfig, clamp_k
from specrt.server.serve import build_parser, engine_kwargs

ROOT = Path(__file__).resolve().parent.parent
RETIRED = {"draft_length", "draft_lengths", "k_caps", "caps", "cap", "k_cap", "forced_k", "next_ks", "next_k",
           "kmax", "k1", "k_next", "nk", "headroom", "caps_vary", "out_caps"}
BOUNDS = {"max_draft_length", "min_draft_length", "max_k", "max_ks"}   # what a min() of them clamps


def identifiers(tree: ast.AST):
    """(identifier, line) of every name the code uses or defines (comments and strings are prose)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id, n.lineno
        elif isinstance(n, ast.Attribute):
            yield n.attr, n.lineno
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield n.name, n.lineno
        elif isinstance(n, ast.arg):
            yield n.arg, n.lineno
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.arg, n.value.lineno


def retired_uses(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / "specrt").rglob("*.py")):
        for name, line in identifiers(ast.parse(path.read_text(), str(path))):
            other_length = re.search(r"(?i)draft_length", name) and not re.search(r"(?i)(max|min)_draft_length", name)
            if name.lower() in RETIRED or other_length:
                out.append(f"{path.relative_to(root)}:{line}: {name}")
    return out


def clamps_outside_clamp_k(root: Path = ROOT) -> list[str]:
    """min() calls over a draft length's bound anywhere but in clamp_k."""
    out = []
    for path in sorted((root / "specrt").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "clamp_k"
                  for n in ast.walk(f)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "min" and id(n) not in inside:
                if {name for arg in n.args for name, _ in identifiers(arg)} & BOUNDS:
                    out.append(f"{path.relative_to(root)}:{n.lineno}: {ast.unparse(n)}")
    return out


def test_no_retired_synonym_of_the_draft_length():
    found = retired_uses()
    assert not found, "retired names of the draft length:\n" + "\n".join(found)


def test_the_draft_length_is_clamped_in_one_function():
    found = clamps_outside_clamp_k()
    assert not found, "clamp the draft length with specrt.config.clamp_k:\n" + "\n".join(found)
    assert clamp_k(8) == 8 and clamp_k(8, 3, 5) == 3 and clamp_k(4, -2) == 0 and clamp_k(-1) == 0


def test_the_checks_see_what_they_police(tmp_path):
    (tmp_path / "specrt").mkdir()
    (tmp_path / "specrt" / "bad.py").write_text(
        "def f(batch, k_caps, forced_k=None):\n    kmax = max(k_caps)\n    return min(kmax, spec.max_draft_length)\n"
        "def clamp_k(k, *limits):\n    return min((k, *limits))  # fine here\n")
    assert {u.rsplit(": ", 1)[1] for u in retired_uses(tmp_path)} == {"k_caps", "forced_k", "kmax"}
    assert len(clamps_outside_clamp_k(tmp_path)) == 1


def test_serve_flags_are_the_spec_config_fields():
    """Every serve flag that sets a SpecConfig field is spelled as the field (``--no-`` for a
    switch that turns it off); the draft length's flags are exactly its two fields, plus the
    deprecated spelling of the first."""
    fields = {f.name for f in dataclasses.fields(SpecConfig)}
    p = build_parser()
    for action in p._actions:
        if action.dest in fields and "--draft-length" not in action.option_strings:
            flag = "--" + action.dest.replace("_", "-")
            assert action.option_strings in ([flag], ["--no-" + flag[2:]], [flag, "--no-" + flag[2:]]), \
                (action.dest, action.option_strings)
    length_flags = sorted(o for a in p._actions for o in a.option_strings if "draft-length" in o)
    assert length_flags == ["--draft-length", "--max-draft-length", "--min-draft-length"]
    assert {a.dest for a in p._actions if "draft-length" in " ".join(a.option_strings)} <= fields


BASE = ["--target-model", "builtin", "--speculative-decoding"]


def _spec(*flags: str) -> SpecConfig:
    return engine_kwargs(build_parser().parse_args(BASE + list(flags)))["spec"]


def test_the_deprecated_flag_maps_to_max_draft_length():
    assert _spec("--max-draft-length", "5").max_draft_length == 5
    with pytest.warns(FutureWarning, match="--draft-length is deprecated: use --max-draft-length"):
        assert _spec("--draft-length", "5").max_draft_length == 5
    for order in (["--draft-length", "2", "--max-draft-length", "6"], ["--max-draft-length", "6", "--draft-length", "2"]):
        with pytest.warns(FutureWarning, match="--draft-length is deprecated"):
            assert _spec(*order).max_draft_length == 6                 # the new flag wins, as before
    assert _spec().max_draft_length == SpecConfig().max_draft_length


def test_the_demo_takes_the_same_name():
    from specrt.cli.demo import build_parser as demo_parser

    assert demo_parser().parse_args(["--max-draft-length", "3"]).max_draft_length == 3
    with pytest.warns(FutureWarning):
        assert demo_parser().parse_args(["--draft-length", "3"]).max_draft_length == 3
