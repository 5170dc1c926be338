"""The drafter interface stays narrow (issue 37): the base ``Drafter`` has at most seven methods,
what only some drafters do is an optional capability checked with isinstance (pre-drafting for
overlap, the target's hidden states, a history of finished requests), the overlap machinery
lives in at most five files of specrt/, and a new drafter is its class plus one registration
line: a toy drafter defined here runs end to end through ``specrt.LLM`` on the built-in pair
with greedy output token-identical to plain decoding.

How the overlap files are counted (``overlap_files``): a file of specrt/ counts when its code
(not its comments, docstrings or strings) names an identifier matching ``pre_draft`` /
``PreDraft`` (any case, with or without the underscore), ``overlap``, ``fence`` or
``mark_verify``: a name, an attribute, a definition, an argument, a keyword or an imported
module. The names that are only names are allowed anywhere: the ``overlap`` flag
(SpecConfig.overlap, ``specrt serve --overlap``) and the overlap metrics (``record_overlap``,
``pre_drafts_made``, ``pre_drafts_used``)."""
from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.drafters import DraftAsk, Drafter, DraftProposal, History, ReadsTarget, register_drafter  # noqa: E402
from specrt.drafters import spec as spec_module  # noqa: E402
from specrt.drafters.predraft import PreDrafting  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_DRAFTER_METHODS = 7
MAX_OVERLAP_FILES = 5
OVERLAP_NAME = re.compile(r"(?i)pre_?draft|overlap|^fence$|^mark_verify$")
JUST_NAMES = {"overlap", "record_overlap", "pre_drafts_made", "pre_drafts_used"}   # a flag, metrics


def methods(cls) -> list[str]:
    """The methods a class defines itself (properties and class attributes are not methods)."""
    return sorted(name for name, v in vars(cls).items()
                  if isinstance(v, (staticmethod, classmethod)) or inspect.isfunction(v))


def code_names(tree: ast.AST):
    """Every identifier the code names (comments, docstrings and strings are no identifiers)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield n.name
        elif isinstance(n, ast.arg):
            yield n.arg
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.arg
        elif isinstance(n, ast.alias):
            yield n.name
            if n.asname:
                yield n.asname
        elif isinstance(n, ast.ImportFrom) and n.module:
            yield n.module


def overlap_files(root: Path = ROOT) -> dict[str, list[str]]:
    """{file under specrt/: the overlap identifiers it names} (module docstring: how they count)."""
    out = {}
    for path in sorted((root / "specrt").rglob("*.py")):
        names = {n for n in code_names(ast.parse(path.read_text(), str(path)))
                 if OVERLAP_NAME.search(n) and n not in JUST_NAMES}
        if names:
            out[str(path.relative_to(root))] = sorted(names)
    return out


def test_the_drafter_base_class_stays_narrow():
    got = methods(Drafter)
    assert len(got) <= MAX_DRAFTER_METHODS, f"Drafter has {len(got)} methods (at most {MAX_DRAFTER_METHODS}): {got}"
    # the optional capabilities are not on the base class: a drafter without them has none of their hooks
    for capability in (PreDrafting, ReadsTarget, History):
        assert not set(methods(capability)) & set(dir(Drafter)), capability


def test_overlap_lives_in_few_files():
    found = overlap_files()
    assert len(found) <= MAX_OVERLAP_FILES, (
        f"{len(found)} files of specrt/ implement overlap (at most {MAX_OVERLAP_FILES}):\n"
        + "\n".join(f"  {f}: {', '.join(n)}" for f, n in found.items()))
    assert "specrt/step/overlap.py" in found and "specrt/drafters/predraft.py" in found   # the counter sees them


def test_the_counter_sees_identifiers_not_prose():
    names = set(code_names(ast.parse('"""pre_draft overlap"""\nimport specrt.step.overlap as o\n'
                                     'def f(pre_draft=1):  # PreDraft\n    return x.mark_verify(k=1)\n')))
    assert {"specrt.step.overlap", "pre_draft", "mark_verify", "k"} <= names and "PreDraft" not in names


def test_every_network_drafter_but_the_feature_draft_pre_drafts():
    from specrt.drafters import FeatureDrafter, ModelDrafter, NgramDrafter, ReducedDrafter, SelfDrafter
    from specrt.drafters.suffix import SuffixDrafter

    assert all(issubclass(c, PreDrafting) for c in (ModelDrafter, ReducedDrafter, SelfDrafter))
    assert not any(issubclass(c, PreDrafting) for c in (FeatureDrafter, NgramDrafter, SuffixDrafter))
    assert issubclass(FeatureDrafter, ReadsTarget) and issubclass(SuffixDrafter, History)


# ----------------------------------------------------------------------------- a new drafter
class EchoDrafter(Drafter):
    """A toy drafter: proposes each request's last token k times (no model, no state)."""

    name = "echo"

    def __init__(self, device):
        self.device = device

    def propose(self, batch, ask: DraftAsk) -> DraftProposal:
        K = max(ask.ks, default=0)
        ids = torch.full((len(batch), K), -1, dtype=torch.int32)
        for b, (r, k) in enumerate(zip(batch, ask.ks)):
            ids[b, :k] = r.token_ids[-1]
        return DraftProposal(ids.to(self.device), list(ask.ks), None, None)


@pytest.fixture
def registry():
    """The drafter registry as it was before the test (the toy stays out of the other tests)."""
    saved = dict(spec_module._BUILDERS)
    yield
    spec_module._BUILDERS.clear()
    spec_module._BUILDERS.update(saved)


PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [20] * 10, [11, 12, 13], [60, 61, 62, 60, 61, 62, 60]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_a_new_drafter_is_its_class_and_one_registration_line(registry):
    register_drafter("echo", lambda spec, ctx: EchoDrafter(ctx.settings.device))    # the one line

    plain = specrt.LLM(target="builtin", seed=0)
    echo = specrt.LLM(target="builtin", draft="echo", seed=0, spec=SpecConfig(max_draft_length=3, overlap=True))
    assert echo.engine.draft_kind == "echo" and isinstance(echo.engine.drafter, EchoDrafter)
    assert tokens(echo.generate(PROMPTS, GREEDY)) == tokens(plain.generate(PROMPTS, GREEDY))
    stats = echo.stats()
    assert stats["total"]["drafted_tokens"] > 0                       # it really drafted
    assert not stats["overlap"]["active"] and "echo" in stats["overlap"]["note"]   # no PreDrafting: said once
    assert spec_module.parse_draft("echo:x=1").args == "x=1"


def test_a_registered_name_must_be_a_word(registry):
    for bad in ("", "Echo", "a b", "x:y", 3):
        with pytest.raises(ValueError, match="lower-case word"):
            register_drafter(bad, lambda spec, ctx: None)
