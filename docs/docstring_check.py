"""Griffe extension for the API reference (mkdocs.yml): a public object without a docstring is a
warning, so `mkdocs build --strict` fails on it as on a broken cross-reference.

The public API is what the pages under docs/api/ render with `::: identifier`: that object, the
names of a module's `__all__` (or its `members:` option), and a class's public methods and
properties. Dataclass fields are documented in their class's docstring and are not checked.
`undocumented` (an option in mkdocs.yml) lists the objects known to lack a docstring, in files
whose owners still have to write it; an entry that has one by now is a warning too, so the list
only shrinks.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml
from griffe import Extension, Kind, Object, logger

PAGES = Path(__file__).resolve().parent / "api"
BLOCK = re.compile(r"^::: (\S+)\n((?:[ \t]+\S.*\n?)*)", re.MULTILINE)   # an identifier and its indented options


def _rendered(pages: Path) -> list[tuple[str, object]]:
    """(identifier, its `members` option or None) for each `::: identifier` block of the pages."""
    out = []
    for page in sorted(pages.glob("*.md")):
        for ident, options in BLOCK.findall(page.read_text()):
            members = ((yaml.safe_load(options) or {}).get("options") or {}).get("members") if options else None
            out.append((ident, members))
    return out


def _public(obj: Object, members) -> list[Object]:
    """The objects rendered for `obj`: itself and its public API members."""
    obj = obj.final_target if obj.is_alias else obj
    found = [obj]
    if members is False:
        return found
    if obj.kind is Kind.MODULE:
        names = members or [n for n in (obj.exports or []) if isinstance(n, str)] or \
            [n for n, m in obj.members.items() if not n.startswith("_") and not m.is_alias]
        for name in names:
            found += _public(obj.members[name], None)
    elif obj.kind is Kind.CLASS:
        for name, m in obj.members.items():
            if name.startswith("_") or (members and name not in members):
                continue
            m = m.final_target if m.is_alias else m
            if m.kind in (Kind.FUNCTION, Kind.CLASS) or "property" in m.labels:
                found.append(m)
    return found


class PublicDocstrings(Extension):
    """Warns about public API objects without a docstring (see the module's docstring)."""

    def __init__(self, package: str = "specrt", undocumented: list[str] | None = None) -> None:
        super().__init__()
        self.package = package
        self.undocumented = set(undocumented or ())

    def on_package(self, *, pkg, loader, **kwargs) -> None:
        """Check the rendered objects once the whole package is loaded (aliases resolve then)."""
        if pkg.name != self.package:
            return
        seen = set()
        for ident, members in _rendered(PAGES):
            for obj in _public(loader.modules_collection[ident], members):
                if obj.path in seen:
                    continue
                seen.add(obj.path)
                where = f"{obj.relative_filepath}:{obj.lineno}"
                if not obj.docstring and obj.path not in self.undocumented:
                    logger.warning(f"{where}: public {obj.kind.value} {obj.path} has no docstring")
                elif obj.docstring and obj.path in self.undocumented:
                    logger.warning(f"{where}: {obj.path} has a docstring now: remove it from `undocumented` in mkdocs.yml")
        for path in sorted(self.undocumented - seen):
            logger.warning(f"mkdocs.yml: `undocumented` lists {path}, which the reference does not render")
