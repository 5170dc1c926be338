"""Smoke test of bench/agentic.py (the offline agentic benchmark) on the tiny random pair: two
modes over a tiny edit + tools workload, with a trivial word-hash tokenizer (the pair's own
word-level vocabulary has no words for English text)."""
from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parent.parent))  # the bench package; after site-packages so an installed specrt wins
from _engine_utils import EOS, VOCAB, make_pair  # noqa: E402

from bench import agentic  # noqa: E402
from bench.agentic_workload import ChatCodec, Sizes, build_workloads, strip_stop  # noqa: E402


def word_codec() -> ChatCodec:
    """Words hashed onto the pair's ordinary ids (3..VOCAB-1); a 'role: content' template."""
    return ChatCodec(lambda msgs: "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:",
                     lambda text: [3 + zlib.crc32(w.encode()) % (VOCAB - 3) for w in text.split()])


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_history_is_the_models_ids():
    """Turn 2's prompt holds turn 1's answer verbatim (ids, not re-tokenized text), then turn 2's ask."""
    codec = word_codec()
    (edit,) = build_workloads(["edit"], codec, Sizes(edit_sessions=1, edit_turns=2, max_file_tokens=60), 0)
    s = edit.sessions[0]
    answer = (90, 91, 92, 93)
    p1, p2 = s.prompt(codec, []), s.prompt(codec, [answer])
    assert p2[:len(p1) - 1] == p1[:-1]                    # the same conversation, then more
    assert contains(p2, list(answer)) and not contains(p1, list(answer))
    assert strip_stop([5, 6, EOS], {EOS}) == (5, 6)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    return make_pair(tmp_path_factory.mktemp("agentic_pair"))


@pytest.fixture(scope="module")
def report(pair, tmp_path_factory):
    tdir, _ = pair
    out = tmp_path_factory.mktemp("agentic_out") / "agentic.json"
    rc = agentic.main(["--target", str(tdir), "--modes", "ar,ngram", "--workloads", "edit,tools",
                       "--dtype", "float32", "--max-tokens", "8", "--repeats", "2", "--edit-sessions", "1",
                       "--edit-turns", "2", "--tool-requests", "2", "--max-file-tokens", "60", "--out", str(out)],
                      codec=word_codec())
    assert rc == 0
    return json.loads(out.read_text())


def test_every_workload_and_mode_reported(report):
    assert set(report["results"]) == {"edit", "tools"}
    for w, rows in report["results"].items():
        assert set(rows) == {"ar", "ngram"}, w
        for m, r in rows.items():
            assert r["identical_to_ar"] is True, (w, m, r["first_mismatch"])
            assert r["speedup"] > 0 and r["tokens_per_s"] > 0, (w, m)
            assert len(r["speedup_ratios"]) == 2 and r["tau"] >= 1.0
        assert rows["ar"]["speedup_ratios"] == [1.0, 1.0]
    assert report["workloads"]["edit"]["requests"] == 2 and report["workloads"]["tools"]["requests"] == 2


def test_edit_history_is_fed_back(report):
    """The second turn's prompt, as the run sent it, contains the first turn's generated ids."""
    ids = report["ar_ids"]["edit"]
    assert report["workloads"]["edit"]["turns"] == [2]
    first = list(strip_stop(ids["outputs"][0], {EOS}))
    p0, p1 = ids["prompts"][0], ids["prompts"][1]
    assert first and p1[:len(p0) + len(first)] == p0 + first     # turn 1's prompt, its answer, then turn 2
    assert len(p1) > len(p0) + len(first)


def test_a_differing_mode_is_caught():
    """summarize() flags a mode whose tokens differ from ar's (main then exits 1)."""
    ar = [agentic.ModeRun(1.0, [[1]], [[5, 6, 7]], dict.fromkeys(agentic.STAT_KEYS, 0)) for _ in range(2)]
    same = agentic.summarize(ar, ar)
    assert same.identical_to_ar and same.speedup == 1.0
    other = [agentic.ModeRun(0.5, [[1]], out, ar[0].stats) for out in ([[5, 6, 7]], [[5, 9, 7]])]
    s = agentic.summarize(other, ar)
    assert not s.identical_to_ar and s.first_mismatch == {"repeat": 1, "request": 0, "token": 1}
    assert s.speedup == 2.0


def test_unknown_draft_fails_cleanly(pair, tmp_path, capsys):
    rc = agentic.main(["--target", str(pair[0]), "--modes", "ar,no-such-draft", "--workloads", "tools",
                       "--dtype", "float32", "--out", str(tmp_path / "x.json")], codec=word_codec())
    assert rc == 2 and not (tmp_path / "x.json").exists()
    err = capsys.readouterr().err
    assert "error: mode 'no-such-draft'" in err and "Traceback" not in err
