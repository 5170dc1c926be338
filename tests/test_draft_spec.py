"""The ``draft=`` argument is parsed in one place (specrt.drafters.spec.parse_draft) into a typed
record that every other module, the benchmarks' (bench/) included, reads; no module passes settings
on the side (attributes set on a loader function and read back with getattr)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from specrt.drafters.spec import DraftSpec, parse_draft

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specrt" / "drafters" / "spec.py"


@pytest.mark.parametrize("draft, want", [
    (None, DraftSpec()),
    ("none", DraftSpec("none", "none")),
    ("ngram", DraftSpec("ngram", "ngram")),
    ("ngram:3", DraftSpec("ngram", "ngram:3", ngram_sizes=(3,))),
    ("ngram:2:5", DraftSpec("ngram", "ngram:2:5", ngram_sizes=(2, 5))),
    ("suffix", DraftSpec("suffix", "suffix", suffix="suffix")),
    ("suffix:max_match=8,scoped=1", DraftSpec("suffix", "suffix:max_match=8,scoped=1",
                                              suffix="suffix:max_match=8,scoped=1")),
    ("self:4", DraftSpec("self", "self:4", self_layers=4)),
    ("builtin", DraftSpec("model", "builtin", source="builtin")),
    ("smollm2-135m-draft", DraftSpec("model", "smollm2-135m-draft", source="smollm2-135m-draft")),
    ("some/folder", DraftSpec("model", "some/folder", source="some/folder")),
    ("models/draft.Q8_0.gguf", DraftSpec("model", "models/draft.Q8_0.gguf", source="models/draft.Q8_0.gguf")),
    ("self", DraftSpec("model", "self", source="self")),            # a folder called "self", not self:N
    ("some/folder+ngram", DraftSpec("model", "some/folder+ngram", source="some/folder", lookup="ngram",
                                    lookup_spec="ngram", lookup_named=True)),
    ("some/folder+ngram:1", DraftSpec("model", "some/folder+ngram:1", source="some/folder", lookup="ngram",
                                      lookup_spec="ngram:1", lookup_named=True)),
    ("builtin+suffix:min_match=2", DraftSpec("model", "builtin+suffix:min_match=2", source="builtin",
                                             lookup="suffix", lookup_spec="suffix:min_match=2", lookup_named=True)),
    ("a+b+suffix", DraftSpec("model", "a+b+suffix", source="a+b", lookup="suffix", lookup_spec="suffix",
                             lookup_named=True)),             # the lookup is after the last '+'
    ("self:2+ngram", DraftSpec("self", "self:2+ngram", self_layers=2, lookup="ngram", lookup_spec="ngram",
                               lookup_named=True)),
])
def test_every_spelling(draft, want):
    assert parse_draft(draft) == want
    assert parse_draft(draft).text == (draft if draft is not None else "none")   # and back


def test_a_path_is_a_draft_model():
    p = Path("ngram")
    assert parse_draft(p) == DraftSpec("model", p, source=p)
    assert parse_draft(p, "suffix").lookup == "suffix"


@pytest.mark.parametrize("draft, lookup, want", [
    ("builtin", "suffix", ("suffix", "suffix", False)),
    ("builtin", "ngram:2:3", ("ngram", "ngram:2:3", False)),
    ("self:1", "suffix:min_match=2", ("suffix", "suffix:min_match=2", False)),
    ("builtin+ngram", "suffix", ("ngram", "ngram", True)),       # the string wins
    ("builtin", None, (None, None, False)),
    ("ngram", "suffix", (None, None, False)),                    # no lookup in front of a lookup
    ("suffix", "ngram", (None, None, False)),
    ("none", "suffix", (None, None, False)),
    (None, "suffix", (None, None, False)),
])
def test_the_configured_lookup_goes_in_front_of_a_model_or_self(draft, lookup, want):
    spec = parse_draft(draft, lookup)
    assert (spec.lookup, spec.lookup_spec, spec.lookup_named) == want


@pytest.mark.parametrize("draft, model, speculative", [
    (None, False, False), ("none", False, False), ("ngram:3", False, True), ("suffix:scoped=1", False, True),
    ("self:2", False, True), ("self:2+ngram", False, True), ("builtin", True, True), ("x/y+suffix", True, True),
])
def test_what_loads_a_model(draft, model, speculative):
    spec = parse_draft(draft)
    assert (spec.loads_model, spec.speculative) == (model, speculative)


@pytest.mark.parametrize("draft, match", [
    ("ngram:x", "integers"), ("ngram:", "integers"), ("ngram:1:2:3", "integers"),
    ("self:x", "integer N"), ("self:", "integer N"),
    ("ngram+ngram", "in front of a draft model"), ("suffix+ngram", "in front of a draft model"),
    ("none+suffix", "in front of a draft model"),
    ("builtin+bigram", "ngram"), ("builtin+", "ngram"),
])
def test_bad_strings_name_draft(draft, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_draft(draft)
    assert f"draft={draft!r}" in str(info.value)


def test_a_bad_type_names_draft():
    with pytest.raises(ValueError, match="draft must be"):
        parse_draft(3)


def test_suffix_settings_fold_into_the_suffix_part():
    assert parse_draft("suffix").with_suffix_settings(["scoped=1"]).text == "suffix:scoped=1"
    assert parse_draft("suffix:max_match=4").with_suffix_settings(["scoped=1", "global_tokens=0"]).text == \
        "suffix:max_match=4,scoped=1,global_tokens=0"
    assert parse_draft("a+b+suffix").with_suffix_settings(["scoped=1"]).text == "a+b+suffix:scoped=1"
    for draft in ("builtin", "ngram", "builtin+ngram", None):
        assert parse_draft(draft).with_suffix_settings(["scoped=1"]) is None
    assert parse_draft("builtin", "suffix").with_suffix_settings(["scoped=1"]) is None   # only a named lookup


# ---------------------------------------------------------------- one parser, no side channels

# ways of taking the draft string apart (or of asking a loader function for what it was told)
PARSING = [
    (re.compile(r'"\+"\s+in\s'), '"+" in ...'),
    (re.compile(r'\.r?split\(\s*"\+"'), '.split("+") / .rsplit("+")'),
    (re.compile(r'\.r?partition\(\s*"\+"'), '.partition("+") / .rpartition("+")'),
    (re.compile(r'startswith\(\s*\(?\s*"(self|ngram|suffix)'), 'startswith("self:" / "ngram" / "suffix")'),
    (re.compile(r'"self:"'), '"self:"'),
    (re.compile(r'\bdraft\s*(==|!=|\bin\b|\bnot in\b)\s*\(?\s*(None\s*,\s*)?"(none|ngram|suffix|self)'),
     'draft == "none" / draft not in (None, "ngram")'),
]
SIDE_CHANNELS = [
    (re.compile(r'getattr\(\s*loader\s*,'), "getattr(loader, ...)"),
    (re.compile(r'^\s*load\.\w+\s*(,\s*load\.\w+\s*)*='), "attributes set on a loader function"),
    (re.compile(r'(?<!\bself)\.draft_misaligned\s*='), "metrics.draft_misaligned set from outside"),
    (re.compile(r'setattr\(\s*\w+\.config\s*,'), "setattr on a model's config"),
]


def offences(patterns, skip: Path | None = None, package: str = "specrt") -> list[str]:
    """'path:line: what' for every line of ``package``/ matching one of ``patterns`` (but ``skip``)."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path == skip:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in patterns:
                if pattern.search(code):
                    out.append(f"{path.relative_to(ROOT)}:{i}: {what}: {line.strip()}")
    return out


def test_only_spec_py_parses_the_draft_string():
    found = offences(PARSING, skip=SPEC)
    assert not found, "the draft string is parsed outside specrt/drafters/spec.py:\n" + "\n".join(found)


def test_the_benchmarks_use_the_same_parser():
    """bench/ asks parse_draft (e.g. ``.loads_model``) rather than taking the string apart itself."""
    found = offences(PARSING, package="bench")
    assert not found, "bench/ parses the draft string itself (use parse_draft):\n" + "\n".join(found)


def test_no_side_channels():
    found = offences(SIDE_CHANNELS)
    assert not found, "side channels:\n" + "\n".join(found)


def test_the_checks_see_what_they_police():
    """The patterns match the code they forbid (else the two tests above pass vacuously)."""
    bad = ['    named = "+" in kind', '    kind, lookup = kind.rsplit("+", 1)', '    head, sep, x = d.rpartition("+")',
           '    if d.startswith(("ngram", "self:")):', '    elif kind.startswith("self:"):',
           # what bench/ had before it used parse_draft
           '    return draft not in (None, "none") and not str(draft).startswith(("ngram", "self:"))',
           '            model_draft = draft not in (None, "ngram")', '    draft = None if args.draft == "none" else args.draft']
    for line in bad:
        assert any(p.search(line) for p, _ in PARSING), line
    side = ['    x = getattr(loader, "draft_dtype", None)', '    load.quantize, load.draft_dtype = q, d',
            '    self.metrics.draft_misaligned = True', '    m.draft_misaligned = self.draft_misaligned', '    setattr(module.config, QUANT_FLAG, kind)']
    for line in side:
        assert any(p.search(line) for p, _ in SIDE_CHANNELS), line


def test_request_slots_have_their_types():
    """Request's per-drafter, lookup and controls records are typed, not ``object``."""
    from specrt.step.scheduler import Request

    for name in ("drafter_state", "lookup_state", "controls_state"):
        hint = str(Request.__dataclass_fields__[name].type)
        assert "object" not in hint and hint.endswith("| None"), (name, hint)
