"""Smoke test of the end-to-end benchmark harness (the repository's bench/ package) on the tiny
random pair: every section runs with minimal settings and the JSON, markdown report and plots
are written."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parent.parent))  # the bench package; after site-packages so an installed specrt wins
from _engine_utils import make_pair  # noqa: E402

from bench import cost_curve, runner, sections, workloads  # noqa: E402
from bench.report import write_results  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("bench_pair"))


def test_bench_minimal_writes_every_section(pair, tmp_path):
    torch.set_num_threads(1)
    tdir, ddir = pair
    s = workloads.Settings.minimal()
    res = sections.run_all(str(tdir), str(ddir), "cpu", s, log=lambda *a: None)
    out = write_results(res, tmp_path / "out")

    data = json.loads((out / "results.json").read_text())
    for sec in sections.SECTIONS:
        assert sec in data, sec
    cats = data["categories"]
    assert set(cats) == set(workloads.CATEGORIES)
    for cat in workloads.CATEGORIES:
        assert {"ar", "model", "ngram"} <= set(cats[cat])
        assert any(k.startswith("self:") for k in cats[cat])
        for name, v in cats[cat].items():
            assert v["tokens_per_s"] > 0
            # greedy: every drafter reproduces autoregressive decoding token for token
            assert v["identical_to_ar"], (cat, name)
            if name != "ar":
                assert "fraction_of_theoretical" in v
    ks = data["k_sweep"]
    assert ks["best_fixed_k"] in s.ks
    assert {"confidence", "budget"} <= set(ks["policies"])
    assert "head" in ks["policies"] or "head" in ks["skipped"]
    assert set(ks["expected_accepted"]) == {str(k) for k in s.ks}
    assert set(data["temperature"]["by_temperature"]) == {str(t) for t in s.temperatures}
    bt = data["batch"]
    assert set(bt["by_batch_size"]) == {str(b) for b in s.batch_sizes}
    for r in bt["by_batch_size"].values():
        assert {"ar", "ar_again", "fixed", "budget", "ngram_fixed", "ngram_budget"} <= set(r)
        assert all(v["identical_to_ar"] for v in r.values())
    assert set(bt["ar_vs_ar_noise"]) == set(bt["by_batch_size"])
    for m in ("budget", "ngram_budget"):
        assert set(bt[f"{m}_below_ar_beyond_noise_at"]) <= set(bt[f"{m}_below_ar_at"])
        assert set(bt[f"{m}_below_ar_significant_at"]) <= set(bt[f"{m}_below_ar_at"])
        for r in bt["by_batch_size"].values():
            lo, hi = r[m]["speedup_interval"]
            assert lo <= r[m]["speedup"] <= hi
        pooled = bt[f"{m}_pooled"]      # every batch size's paired ratios together
        assert pooled["n"] == sum(len(r[m]["speedup_ratios"]) for r in bt["by_batch_size"].values()) >= 2
        assert pooled["interval"][0] <= pooled["speedup"] <= pooled["interval"][1]
    assert "Pooled over every batch size" in (out / "report.md").read_text()
    assert len(data["misaligned"]["cases"]) >= 2
    peer = data["peer"]
    assert "skipped" not in peer, peer
    assert peer["ratio_spec_vs_hf_assisted"] > 0
    assert set(data["costs"]["v"]) == {str(k) for k in range(1, max(s.ks) + 1)}

    report = (out / "report.md").read_text()
    for title in ("per prompt category", "Fixed K vs dynamic", "Temperature", "Batch size", "Misaligned",
                  "transformers"):
        assert title in report
    for png in ("speedup_vs_k.png", "speedup_vs_batch.png", "acceptance_per_position.png",
                "speedup_per_category.png"):
        assert (out / png).stat().st_size > 1000, png


def test_misaligned_engine_changes_only_the_draft_params(pair):
    """The benchmark-only drafter hook perturbs draft rows; target rows and greedy output are untouched."""
    import specrt

    tdir, ddir = pair
    spec = specrt.SpecConfig(max_draft_length=3, max_batch_size=2, max_model_len=128)
    aligned = runner.make_llm(str(tdir), str(ddir), spec, "cpu")
    mis = runner.make_llm(str(tdir), str(ddir), spec, "cpu", misalign={"temperature": 1.0, "top_p": 0.9})
    params = specrt.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=3)
    prompt = [5, 9, 11, 20, 7, 5, 9]
    a = aligned.generate([prompt], params)[0]
    m = mis.generate([prompt], params)[0]
    assert a.token_ids == m.token_ids               # still exact
    assert m.metrics["drafted_tokens"] > 0


def test_cost_curve_tiny_cpu(tmp_path):
    torch.set_num_threads(1)
    res = cost_curve.cost_curve("tiny", "tiny", draft_layers=1, device="cpu", dtype="float32", ctx=32,
                                max_tokens=4, batch_sizes=(1, 2), kmax=3, reps=2, log=lambda *a: None)
    cost_curve.write_cost_curve(res, tmp_path)
    data = json.loads((tmp_path / "cost_curve.json").read_text())
    assert set(data["by_batch"]) == {"1", "2"}
    e = data["by_batch"]["1"]
    assert e["c"] > 0 and set(e["v"]) == {"1", "2", "3"}
    assert (tmp_path / "cost_curve.md").is_file()


def test_median_interval_order_statistics():
    """The distribution-free interval of a median: the textbook order statistics and coverage
    (n=9: x(2)..x(8), 96.1%; n=20: x(6)..x(15), 95.9%), the whole range below n=6, and it must
    contain the true median of a skewed distribution in ~95% of samples."""
    import random

    from bench.runner import median_interval

    assert median_interval(list(range(1, 10))) == (2, 8, pytest.approx(1 - 2 * 10 / 512))
    assert median_interval(list(range(1, 21)))[:2] == (6, 15)
    assert median_interval([3.0, 1.0, 2.0])[:2] == (1.0, 3.0)
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        lo, hi, _ = median_interval([rng.expovariate(1.0) for _ in range(15)])
        hits += lo <= math.log(2) <= hi
    assert 0.94 <= hits / 2000 <= 0.99


def test_specrt_bench_dispatches_to_the_bench_package(capsys):
    from specrt import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    assert "usage: specrt bench" in capsys.readouterr().out


def test_specrt_bench_outside_a_checkout_says_how_to_run_it(tmp_path):
    """An installed specrt without the repository's bench/ package: a clear message, exit code 2."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parent.parent
    shutil.copytree(root / "specrt", tmp_path / "specrt", ignore=shutil.ignore_patterns("builtin", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "specrt.cli", "bench", "--quick"], cwd=tmp_path,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "source checkout" in proc.stderr and "python -m bench --quick" in proc.stderr
