"""bench/draft_lineage.json lists every shipped SmolLM2 draft, in order, and the last is the one shipped now.

bench.draft_lineage plots held-out acceptance against the lineage's training positions from this
file; a draft shipped without an entry would silently drop out of the curve.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINEAGE = json.loads((ROOT / "bench" / "draft_lineage.json").read_text())
MODEL = f"{LINEAGE['path']}/model.safetensors"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def history() -> list[str]:
    """Commits that changed the shipped draft's weights, oldest first (full hashes)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the source checkout's git history")
    if _git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("a shallow clone lacks the drafts' history")
    return _git("log", "--reverse", "--format=%H", "--", MODEL).split()


def test_entries_are_shipped_drafts_in_order(history):
    full = [_git("rev-parse", d["commit"]).strip() for d in LINEAGE["drafts"]]
    assert all(c in history for c in full), "every entry is a commit that changed the shipped weights"
    assert full == sorted(full, key=history.index), "entries in shipping order"
    for d in LINEAGE["drafts"]:
        assert d["new_positions"] > 0 and d["what"]


def test_the_last_entry_is_the_draft_shipped_now(history):
    head_blob = _git("rev-parse", f"HEAD:{MODEL}").strip()
    last_blob = _git("rev-parse", f"{LINEAGE['drafts'][-1]['commit']}:{MODEL}").strip()
    assert last_blob == head_blob, (
        f"the shipped draft changed after {LINEAGE['drafts'][-1]['commit']}: "
        "add its commit to bench/draft_lineage.json")


def test_checkout_draft_writes_the_folder(tmp_path, history):
    from bench.draft_lineage import checkout_draft

    first = LINEAGE["drafts"][0]["commit"]
    out = Path(checkout_draft(first, LINEAGE["path"], str(tmp_path), repo=ROOT))  # bench may be the installed one
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specrt_draft"]["kind"] == "feature"
    assert (out / "model.safetensors").stat().st_size > 1_000_000
