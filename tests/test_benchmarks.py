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

from bench import cost_curve, costs, runner, sections, workloads  # noqa: E402
from bench.report import write_results  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("bench_pair"))


@pytest.fixture(scope="module")
def minimal_run(pair, tmp_path_factory):
    """Every section on the tiny pair with minimal settings: (settings, results.json, report.md)."""
    torch.set_num_threads(1)
    tdir, ddir = pair
    s = workloads.Settings.minimal()
    res = sections.run_all(str(tdir), str(ddir), "cpu", s, log=lambda *a: None)
    out = write_results(res, tmp_path_factory.mktemp("bench_out"))
    return s, json.loads((out / "results.json").read_text()), (out / "report.md").read_text(), out


def test_bench_minimal_writes_every_section(minimal_run):
    s, data, report, out = minimal_run
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
    assert "Pooled over every batch size" in report
    assert len(data["misaligned"]["cases"]) >= 2
    peer = data["peer"]
    assert "skipped" not in peer, peer
    assert peer["ratio_spec_vs_hf_assisted"] > 0
    assert set(data["costs"]["v"]) == {str(k) for k in range(1, max(s.ks) + 1)}
    assert ks["conditional_acceptance_at_kmax"], "the engine's conditional acceptance is reported"
    assert all(0.0 <= c <= 1.0 for c in _conditional_rates(data)), sorted(_conditional_rates(data))[-3:]

    for title in ("per prompt category", "Fixed K vs dynamic", "Temperature", "Batch size", "Misaligned",
                  "transformers", "Penalties", "Admission by acceptance", "Long context", "speedup estimate"):
        assert title in report
    for png in ("speedup_vs_k.png", "speedup_vs_batch.png", "acceptance_per_position.png",
                "speedup_per_category.png"):
        assert (out / png).stat().st_size > 1000, png


def test_penalties_section_rows(minimal_run, pair):
    """Per temperature a row per (autoregressive + every drafter) x penalty setting; greedy
    output with penalties equals autoregressive decoding with the same penalties."""
    from bench.penalties import PENALTIES

    s, data, report, _ = minimal_run
    pen = data["penalties"]
    assert set(pen["by_temperature"]) == {str(t) for t in s.penalty_temperatures}
    for t, rows in pen["by_temperature"].items():
        assert {(r["drafter"], r["penalties"]) for r in rows} == {
            (d, p) for d in ("ar", "model", "ngram", "self:1") for p in PENALTIES}
        for r in rows:
            assert r["tokens_per_s"] > 0 and r["vs_no_penalties"] > 0
            assert r["acceptance"] is None if r["drafter"] == "ar" else 0.0 <= r["acceptance"] <= 1.0
            if float(t) == 0.0:
                assert r["identical_to_ar"], r
    vocab = json.loads((pair[0] / "config.json").read_text())["vocab_size"]
    assert [c["V"] for c in pen["op_costs"]] == [vocab]       # the target's (minimal settings: no others)
    assert pen["op_costs"][0]["apply_penalties_ms"] > 0
    assert "penalties 'all (+min_p, bias)' vs none" in report


def test_batching_section_rows(minimal_run):
    """Acceptance admission against FIFO per setup: throughput ratio, mixed steps, same output."""
    s, data, report, _ = minimal_run
    bt = data["batching"]
    assert bt["requests"] == 2 * s.batching_requests_per_kind
    assert set(bt["setups"]) == {"ngram/fixed", "ngram/budget", "model/budget"}
    for r in bt["setups"].values():
        assert set(r["modes"]) == {"fifo", "acceptance"}
        assert r["throughput_ratio"] > 0 and r["identical"]        # greedy: admission order changes no token
        assert all(m >= 0 for m in r["mixed_tag_steps"].values())
    assert "admission by acceptance vs FIFO" in report


def test_long_context_section_rows(minimal_run):
    """Window vs full draft at each context: draft forward cost, acceptance, identical output."""
    s, data, report, _ = minimal_run
    lc = data["long_context"]
    assert set(lc["by_context"]) == {str(c) for c in s.long_contexts}
    for by in lc["by_context"].values():
        assert set(by) == {"full"} | {f"window {s.long_sinks}+{w}" for w in s.long_windows}
        for m, r in by.items():
            assert r["draft_forward_ms"] > 0 and r["step_ms"] > 0 and 0.0 <= r["acceptance"] <= 1.0
            if m != "full":
                assert r["identical_to_full"], m       # the target verifies over the full context
    assert "long context: draft forward ms / acceptance" in report


def test_speedup_estimate_section_rows(minimal_run):
    """Estimate vs measured per drafter, with the % difference."""
    s, data, report, _ = minimal_run
    se = data["speedup_estimate"]
    assert set(se["drafters"]) == {"model", "ngram", "self:1"}
    for r in se["drafters"].values():
        assert r["measured"] > 0 and r["identical_to_ar"]
        assert r["estimate"] is not None and r["estimate"] > 0     # calibration measured plain steps
        assert r["difference"] == pytest.approx(r["estimate"] / r["measured"] - 1.0)
    assert "runtime speedup estimate vs measured" in report


def test_set_overrides_a_setting_with_its_type():
    from bench.cli import apply_setting

    s = workloads.Settings.quick()
    apply_setting(s, "long_contexts=512,1024")
    apply_setting(s, "penalty_temperatures=0,0.8")
    apply_setting(s, "draft_length=6")
    assert s.long_contexts == (512, 1024) and s.penalty_temperatures == (0.0, 0.8) and s.draft_length == 6
    for bad in ("nope=1", "draft_length", "draft_length=x", "long_contexts=a,b"):
        with pytest.raises(ValueError, match="--set"):
            apply_setting(s, bad)


def _conditional_rates(x) -> list[float]:
    """Every conditional acceptance rate anywhere in a results dict."""
    if isinstance(x, dict):
        return [c for k, v in x.items() for c in (v if k.startswith("conditional_acceptance") else
                                                   _conditional_rates(v))]
    return [c for v in x for c in _conditional_rates(v)] if isinstance(x, list) else []


class _FakeLLM:
    """A comparison mode whose engine reports the given statistics (and emits one token)."""

    def __init__(self, total: dict):
        self.total = total
        self.engine = self

    device = torch.device("cpu")

    def reset_metrics(self) -> None:
        pass

    def forget_outputs(self) -> None:
        pass

    def generate(self, prompts, params=None):
        return [type("Out", (), {"token_ids": [7]})() for _ in prompts]

    def stats(self) -> dict:
        return {"total": self.total}


def test_conditional_acceptance_is_the_engines_and_never_above_one():
    """The bench reports P(i accepted | 0..i-1 accepted) as the engine counts it, not as a ratio of
    survival rates taken over different steps: with drafts cut short that ratio is 4 here (the
    report once printed 1.05), the engine's rate 1.0."""
    from specrt.observability.metrics import RequestStats

    st = RequestStats()
    for _ in range(3):
        st.record(1, 0, 1, 0.0, 0.0, 0.0)      # one draft, rejected
    st.record(2, 2, 3, 0.0, 0.0, 0.0)          # two drafts, both accepted
    total = st.summary()
    surv = total["acceptance_rate_per_position"]
    assert surv[1] / surv[0] == pytest.approx(4.0)
    res = runner.compare({"ar": (_FakeLLM({}), None), "fixed_K2": (_FakeLLM(total), None)}, [[1, 2, 3]], 1)
    assert res["fixed_K2"]["conditional_acceptance_per_position"] == [0.25, 1.0]
    assert res["ar"]["conditional_acceptance_per_position"] == []
    r, expected = costs.expected_accepted({1: res["fixed_K2"], 2: res["fixed_K2"]})
    assert r == 0.25 and expected[2]["formula_per_position"] == pytest.approx(1.25)


def test_modes_sharing_an_engine_get_their_own_stats(pair):
    """Two modes of one engine (other sampling parameters): each reports its own requests' steps,
    not the engine's total over both."""
    import specrt

    tdir, _ = pair
    llm = runner.make_llm(str(tdir), "ngram", specrt.SpecConfig(max_draft_length=2, max_model_len=128), "cpu")
    short, long = (specrt.SamplingParams(max_tokens=n, ignore_eos=True, seed=1) for n in (3, 12))
    res = runner.compare({"ar": (llm, short), "long": (llm, long)}, [[5, 9, 11, 20, 7]], 1)
    assert res["ar"]["tokens"] == 3 and res["long"]["tokens"] == 12
    assert 1 <= res["ar"]["steps"] <= 3 < res["long"]["steps"]
    standalone = runner.compare({"ar": (llm, short)}, [[5, 9, 11, 20, 7]], 1)
    assert standalone["ar"]["steps"] == res["ar"]["steps"]


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
