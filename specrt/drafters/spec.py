"""The ``draft=`` argument, parsed once into a typed record (``parse_draft``).

    None / "none"        no drafter: autoregressive decoding
    "ngram[:min[:max]]"  prompt lookup in the request's own context (specrt.drafters.ngram)
    "suffix[:k=v,...]"   suffix drafting over the request's and earlier requests' tokens (specrt.drafters.suffix)
    "self:N"             the target's first N layers (specrt.drafters.self_draft)
    "builtin", a name, a folder or a .gguf path   a draft model; a reduced-vocabulary DraftModel folder
                         (e.g. "smollm2-135m-draft") is told apart when it loads (specrt.drafters.factory)
    "MODEL+ngram[:min[:max]]" / "MODEL+suffix[:k=v,...]"   that lookup in front of a draft model or
                         self:N (specrt.drafters.lookup); one named alone gets SpecConfig.lookup there
    "NAME[:ARGS]"        a drafter registered under NAME (``register_drafter``; ARGS: ``DraftSpec.args``)

The drafter of each kind is built by the function registered for it (``register_drafter``: one
line per drafter; the built-in kinds' lines are in specrt.drafters.factory).

Every other module reads the record: the factory builds the drafter from it, loading learns whether
draft_quantize / draft_dtype apply, the server and the demo check their flags against it. The
settings after "suffix:" and the lookup's own options are read where they are used
(SuffixSettings.parse, make_lookup); this module only says which they are.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Callable, Literal

LookupKind = Literal["ngram", "suffix"]
LOOKUPS: tuple[str, ...] = ("ngram", "suffix")   # what may go in front of a draft model or self:N
BUILTIN_KINDS = ("none", "model", "self", "ngram", "suffix")   # spelled as the module docstring says

# build(spec, context) -> the drafter (specrt.drafters.base.Drafter) that ``spec`` asks for;
# context: specrt.drafters.factory.DraftContext (the target, the settings, how a model loads)
Builder = Callable[["DraftSpec", object], object]
_BUILDERS: dict[str, Builder] = {}


def register_drafter(name: str, build: Builder) -> None:
    """``draft="name"`` (or ``"name:ARGS"``) builds its drafter with ``build(spec, context)``. The
    built-in kinds are registered by specrt.drafters.factory; a new name must be a lower-case word
    that is not a built-in spelling. Registering a name again replaces its builder."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"a drafter's name must be a lower-case word, got {name!r:.40}")
    if not callable(build):
        raise ValueError(f"register_drafter({name!r}, build): build must be callable")
    _BUILDERS[name] = build


def drafter_builder(kind: str) -> Builder:
    """The function registered for ``kind`` (KeyError naming the registered ones otherwise)."""
    try:
        return _BUILDERS[kind]
    except KeyError:
        raise KeyError(f"no drafter registered as {kind!r} (registered: {sorted(_BUILDERS)})") from None


@dataclass(frozen=True)
class DraftSpec:
    """What a ``draft=`` argument asks for (``parse_draft`` makes one; see the module docstring).

    ``kind`` says which drafter: "none", "model" (any draft model: full, reduced-vocabulary or
    feature, told apart when it loads), "self" (self:N), or a lookup-only drafter, "ngram" or
    "suffix". The other fields belong to one kind each; ``lookup`` is the prompt lookup in front
    of a "model" or "self" drafter."""

    kind: str = "none"                     # a BUILTIN_KINDS entry or a registered name
    given: str | os.PathLike | None = None    # the argument as given (for messages)
    source: str | os.PathLike | None = None   # "model": "builtin", a name, a folder or a .gguf path
    self_layers: int | None = None         # "self": N, how many of the target's first layers draft
    ngram_sizes: tuple[int, ...] = ()      # "ngram": (min,) or (min, max) as given; (): the proposer's defaults
    suffix: str | None = None              # "suffix": its spelling "suffix[:key=value,...]" (SuffixSettings.parse)
    lookup: LookupKind | None = None       # the lookup in front of a "model" / "self" drafter (None: none)
    lookup_spec: str | None = None         # its spelling, "ngram[:min[:max]]" / "suffix[:key=value,...]" (make_lookup)
    lookup_named: bool = False             # the lookup came after '+' in the string (else from SpecConfig.lookup)
    args: str = ""                         # a registered kind: the text after "NAME:" (its builder reads it)

    @property
    def speculative(self) -> bool:
        """Whether there is a drafter at all (not None / "none")."""
        return self.kind != "none"

    @property
    def loads_model(self) -> bool:
        """Whether a separate draft model loads (what draft_quantize / draft_dtype apply to)."""
        return self.kind == "model"

    @property
    def takes_lookup(self) -> bool:
        """Whether a lookup may go in front of this drafter (a draft model or self:N)."""
        return self.kind in ("model", "self")

    @property
    def drafter_text(self) -> str:
        """The drafter's part of the argument, without the lookup: "self:2", "ngram:3", a folder."""
        if self.kind == "model":
            return str(self.source)
        if self.kind == "self":
            return f"self:{self.self_layers}"
        if self.kind == "ngram":
            return ":".join(["ngram", *(str(n) for n in self.ngram_sizes)])
        if self.kind == "suffix":
            return str(self.suffix)
        if self.kind != "none":
            return f"{self.kind}:{self.args}" if self.args else self.kind
        return "none"

    @property
    def text(self) -> str:
        """The ``draft=`` string this record parses back from (the lookup only when it was named)."""
        return f"{self.drafter_text}+{self.lookup_spec}" if self.lookup_named else self.drafter_text

    def with_suffix_settings(self, settings: list[str]) -> "DraftSpec | None":
        """This spec with ``settings`` ("key=value") added to its suffix drafter's or suffix
        lookup's (a named one); None when it has neither."""
        extra = ",".join(settings)
        if self.kind == "suffix":
            return replace(self, suffix=_add_settings(self.suffix, extra))
        if self.lookup_named and self.lookup == "suffix":
            return replace(self, lookup_spec=_add_settings(self.lookup_spec, extra))
        return None


def _add_settings(spelling: str, extra: str) -> str:
    """"suffix" + "a=1" -> "suffix:a=1"; "suffix:b=2" + "a=1" -> "suffix:b=2,a=1"."""
    return spelling + (":" if ":" not in spelling else ",") + extra


def parse_draft(draft: str | os.PathLike | None, lookup: str | None = None) -> DraftSpec:
    """The record for ``draft`` (the engine's ``draft=``); ``lookup`` (SpecConfig.lookup, already
    checked there) goes in front of a draft model or self:N named without one. A path object is
    always a draft model. Raises ValueError naming ``draft`` when the string cannot be what it says."""
    if draft is None:
        return DraftSpec()
    if isinstance(draft, os.PathLike):
        return _with_lookup(DraftSpec("model", draft, source=draft), lookup)
    if not isinstance(draft, str):
        raise ValueError(f"draft must be a string, a path or None, got {type(draft).__name__}")
    head, named = draft, None
    if "+" in draft:
        head, named = draft.rsplit("+", 1)
    spec = _parse_drafter(draft, head)
    if named is None:
        return _with_lookup(spec, lookup)
    if not spec.takes_lookup:
        raise ValueError(f"draft={draft!r}: a lookup ('+ngram', '+suffix') goes in front of a draft model or "
                         f"self:N, not {head!r}")
    kind = named.split(":", 1)[0]
    if kind not in LOOKUPS:
        raise ValueError(f"draft={draft!r}: the lookup after '+' must be 'ngram[:min[:max]]' or "
                         f"'suffix[:key=value,...]', got {named!r}")
    return replace(spec, lookup=kind, lookup_spec=named, lookup_named=True)


def _parse_drafter(draft: str, head: str) -> DraftSpec:
    """The drafter part of ``draft`` (``head``: the string before a lookup's '+')."""
    name, sep, rest = head.partition(":")
    if head == "none":
        return DraftSpec("none", draft)
    if name == "ngram":
        try:
            sizes = tuple(int(s) for s in rest.split(":")) if sep else ()
        except ValueError:
            sizes = ()
        if sep and not 1 <= len(sizes) <= 2:
            raise ValueError(f"draft={draft!r}: n-gram sizes must be 'ngram[:min[:max]]' with integers, "
                             f"got {head!r}")
        return DraftSpec("ngram", draft, ngram_sizes=sizes)
    if name == "suffix":
        return DraftSpec("suffix", draft, suffix=head)
    if name == "self" and sep:
        try:
            layers = int(rest)
        except ValueError:
            raise ValueError(f"draft={draft!r}: self:N needs an integer N, got {rest!r}") from None
        return DraftSpec("self", draft, self_layers=layers)
    if name in _BUILDERS and name not in BUILTIN_KINDS:
        return DraftSpec(name, draft, args=rest)
    return DraftSpec("model", draft, source=head)


def _with_lookup(spec: DraftSpec, lookup: str | None) -> DraftSpec:
    """``spec`` with SpecConfig's ``lookup`` in front when it takes one."""
    if lookup is None or not spec.takes_lookup:
        return spec
    kind = lookup.split(":", 1)[0]
    if kind not in LOOKUPS:
        raise ValueError(f"lookup must be 'suffix[:key=value,...]', 'ngram[:min[:max]]' or None, got {lookup!r:.60}")
    return replace(spec, lookup=kind, lookup_spec=lookup)
