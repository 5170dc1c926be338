"""Health ranges, the measured speedup estimate and the conditional acceptance (issue 16, items
2, 3 and 10): a tag's window outside the design's ranges is logged (rate-limited) and exported
as alert-ready series with the causes the engine can see; the shipped alerting rules and
dashboard parse and name only series the server exports; the speedup estimate is the cost
model's measured plain-step time for the same tokens over the measured step time."""
from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import make_pair  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.observability.health import HealthLog, HealthRanges, judge  # noqa: E402
from specrt.observability.metrics import EngineMetrics, RequestStats, StepSample  # noqa: E402
from specrt.policy import CostModel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MONITORING = ROOT / "docs" / "monitoring"


def _window(steps=100, drafted=4, accepted=3, first=90, temperature=0.0, context=100, draft_s=0.1, verify_s=1.0,
            speedup=None):
    s = RequestStats()
    for i in range(steps):
        a = accepted if i < first else 0
        s.add(StepSample(drafted, a, a + 1, draft_s / steps, verify_s / steps, 0.0, (draft_s + verify_s) / steps,
                         None if speedup is None else speedup * (draft_s + verify_s) / steps, context, temperature))
    return s.summary()


def test_judge_in_range_and_below_with_causes():
    r = HealthRanges()
    ok = judge("code", _window(accepted=3, first=88, speedup=2.5), r)
    assert ok.judged and ok.healthy and not ok.causes
    assert {c.metric: c.status for c in ok.checks} == {"mean_accepted_length": "ok", "first_token_acceptance": "ok",
                                                       "estimated_speedup": "ok"}
    bad = judge("chat", _window(accepted=1, first=40, temperature=1.3, context=5000, draft_s=0.8, verify_s=1.0,
                                speedup=0.9), r, misaligned=True)
    assert not bad.healthy and {c.metric: c.direction for c in bad.checks} == \
        {"mean_accepted_length": -1, "first_token_acceptance": -1, "estimated_speedup": -1}
    assert bad.causes == ["misaligned_sampling", "high_temperature", "long_context", "costly_draft", "draft_too_long"]
    text = bad.describe()
    assert "first_token_acceptance=0.40 (low; healthy 0.7-0.9)" in text and "reduce K" in text
    high = judge("rep", _window(drafted=4, accepted=4, first=100, speedup=4.0), r)
    assert {c.metric: c.status for c in high.checks}["first_token_acceptance"] == "high" and not high.causes
    few = judge("x", _window(steps=5, accepted=0), r)
    assert not few.judged and few.healthy                    # too few steps: not judged
    unknown = judge("y", _window(), r)
    assert {c.metric: c.status for c in unknown.checks}["estimated_speedup"] == "unknown"


def test_health_warnings_are_rate_limited(caplog):
    ranges = HealthRanges(warn_every_s=60.0)
    bad = [judge("chat", _window(accepted=0, first=0), ranges)]
    log = HealthLog()
    with caplog.at_level(logging.WARNING, logger="specrt.health"):
        assert len(log.emit(bad, 0.0, ranges)) == 1
        assert log.emit(bad, 30.0, ranges) == []             # within warn_every_s: quiet
        assert len(log.emit(bad, 61.0, ranges)) == 1
    assert len([r for r in caplog.records if "outside its healthy range" in r.getMessage()]) == 2


def test_conditional_acceptance_never_exceeds_one():
    """The bench printed 1.05: a ratio of cumulative rates measured over different steps. Steps
    that draft fewer tokens (a stop rule, the end of max_tokens) reach later positions less often."""
    s = RequestStats()
    for drafted, accepted in [(4, 4)] * 5 + [(2, 1)] * 20 + [(4, 1)] * 5:
        s.add(StepSample(drafted, accepted, accepted + 1))
    sm = s.summary()
    cum = sm["acceptance_rate_per_position"]
    assert cum[2] / cum[1] > 1.0                             # the old estimator
    cond = sm["conditional_acceptance_per_position"]
    assert all(0.0 <= c <= 1.0 for c in cond)
    assert cond == [30 / 30, 5 / 30, 5 / 5, 5 / 5]           # accepted-at-i / reached-at-i


def test_speedup_estimate_arithmetic():
    """AR time of a step's tokens: its first token per request one plain step (prefill chunk
    included), every further token a plain decode step's share; over the measured step time."""
    c = CostModel()
    rng = np.random.default_rng(0)
    p = (2e-3, 1e-5, 2e-7, 5e-4)                            # 1, tokens, context, requests
    for _ in range(40):
        n = int(rng.integers(1, 8))
        tokens = n + int(rng.integers(0, 3)) * int(rng.integers(0, 200))
        ctx = int(rng.integers(50, 3000))
        c._prev_drafted = False
        c.add_verify(tokens, ctx, p[0] + p[1] * tokens + p[2] * ctx + p[3] * n, drafted=False, requests=n)
    assert c.ar_step_time(4, 1000, 4) == pytest.approx(p[0] + p[1] * 4 + p[2] * 1000 + p[3] * 4, rel=1e-6)
    empty = CostModel()
    assert empty.ar_step_time(1, 10, 1) is None
    # the engine's arithmetic on a step: 2 requests, 5 and 1 tokens emitted, measured 10 ms
    s = RequestStats()
    t_first, t_next = c.ar_step_time(2, 800, 2), c.ar_step_time(2, 800, 2)
    for emitted in (5, 1):
        s.add(StepSample(4, emitted - 1, emitted, step_s=0.005, ar_est_s=(t_first + (emitted - 1) * t_next) / 2))
    assert s.summary()["estimated_speedup"] == pytest.approx(6 * t_next / 2 / 0.010)
    inputs = s.summary()["estimated_speedup_inputs"]
    assert inputs["steps"] == 2 and inputs["measured_time_s"] == pytest.approx(0.010)
    assert RequestStats().summary()["estimated_speedup"] is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    return make_pair(tmp_path_factory.mktemp("pair"))


PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [40, 41, 42, 43, 44, 45, 46]]


def test_engine_reports_health_and_an_estimate_after_calibration(pair, caplog):
    tdir, ddir = pair
    llm = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=4, tree="chain", lookup=None), seed=0,
                     health=HealthRanges(min_steps=8, warn_every_s=0.0))   # chain: no planner's plain steps
    hot = [SamplingParams(temperature=1.5, max_tokens=40, ignore_eos=True, seed=i) for i in range(4)]
    llm.generate(PROMPTS, hot, tags=["hot"] * 4)
    assert llm.stats()["total"]["estimated_speedup"] is None          # no plain step measured yet
    llm.warmup(prompts=PROMPTS)                                       # calibrates: plain steps measured
    llm.engine.reset_metrics()
    llm.generate(PROMPTS, hot, tags=["hot"] * 4)
    snap = llm.stats()
    est = snap["by_tag"]["hot"]["estimated_speedup"]
    assert est is not None and 0.0 < est < 10.0
    health = snap["health"]["hot"]
    assert health["judged"] and not health["healthy"] and "high_temperature" in health["likely_causes"]
    with caplog.at_level(logging.WARNING, logger="specrt.health"):
        llm.engine.metrics.check_health()
    assert any("'hot'" in r.getMessage() and "temperature" in r.getMessage() for r in caplog.records)
    text = llm.engine.metrics.prometheus()
    model = tdir.name
    assert f'specrt_health_ok{{model="{model}",draft="model",tag="hot"}} 0' in text
    assert f'specrt_health_cause{{model="{model}",draft="model",tag="hot",cause="high_temperature"}} 1' in text
    assert re.search(r'specrt_health_out_of_range\{[^}]*metric="mean_accepted_length"\} -1', text)
    assert "specrt_estimated_speedup{" in text and "specrt_position_conditional_acceptance_rate{" in text


def _exported_series(pair) -> set[str]:
    """Every series name /metrics of a server exports (health windows judged)."""
    from fastapi.testclient import TestClient

    from specrt.step.engine import LLMEngine
    from specrt.server import create_app

    tdir, ddir = pair
    engine = LLMEngine(str(tdir), str(ddir), SpecConfig(max_draft_length=3, max_batch_size=4, lookup=None), device="cpu",
                       health=HealthRanges(min_steps=2))
    app = create_app(engine, warmup=True)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "w5 w6 w7", "max_tokens": 24, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200
        text = client.get("/metrics").text
        assert client.get("/v1/models").json()["data"][0]["specrt"]["kv_cache_tokens"] == engine.kv_cache_tokens
    return set(re.findall(r"^# TYPE (\w+) ", text, re.M)) | set(re.findall(r"^(\w+)\{", text, re.M))


def _series_in(expr: str) -> set[str]:
    return {m for m in re.findall(r"\b(specrt_\w+)", expr)}


def test_alert_rules_and_dashboard_name_exported_series(pair):
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((MONITORING / "specrt-alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert len(exprs) >= 5 and all(rule.get("alert") and rule.get("annotations")
                                   for g in rules["groups"] for rule in g["rules"])
    dash = json.loads((MONITORING / "specrt-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    exported = _exported_series(pair)
    used = set().union(*(_series_in(e) for e in exprs))
    assert {"specrt_health_out_of_range", "specrt_health_cause", "specrt_health_value", "specrt_health_ok",
            "specrt_estimated_speedup"} <= used
    assert used <= exported, sorted(used - exported)


def test_health_ranges_are_validated():
    with pytest.raises(ValueError, match="first_token_acceptance"):
        HealthRanges(first_token_acceptance=(0.9, 0.7))
    with pytest.raises(ValueError, match="min_steps"):
        HealthRanges(min_steps=0)
    m = EngineMetrics(health=HealthRanges(min_steps=1))
    assert m.fresh().health.min_steps == 1
