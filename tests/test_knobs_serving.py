"""Serving knobs (issue 16, items 6, 7 and 8): admission by predicted acceptance (grouping, no
starvation), warm-up and cost-model calibration on typical prompts (LLM.warmup(prompts=...),
`specrt serve --warmup-prompts FILE`), the draft-size guard and the KV-cache memory budget
(`--kv-cache-memory`, with the tokens that fit reported)."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import make_pair  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.models.kv_cache import kv_bytes_per_block  # noqa: E402
from specrt.step.scheduler import Request, Scheduler  # noqa: E402
from specrt.server.settings import parse_memory, read_prompts_file  # noqa: E402


class _RoomyKV:
    """A KV cache that always has room (admission order alone is under test)."""

    num_blocks, block_size = 10 ** 6, 16

    def __init__(self):
        self.held = set()

    def can_allocate(self, n):
        return True

    def allocate(self, rid, token_ids):
        self.held.add(rid)
        return 0

    def cached_in_all_caches(self, rid):
        return 0

    def has_request(self, rid):
        return rid in self.held

    def free(self, rid):
        self.held.discard(rid)


def _req(name: str, rate: float) -> Request:
    r = Request(name, [1, 2, 3], SamplingParams(), seed=0)
    r.predicted = rate
    return r


def _scheduler(admission: str, max_batch: int = 2, max_wait: int = 8) -> Scheduler:
    return Scheduler(max_batch, _RoomyKV(), 4, admission=admission, max_wait=max_wait,
                     predict=lambda r: r.predicted)


def test_admission_groups_requests_of_similar_predicted_acceptance():
    for admission, want in (("fifo", ["low1"]), ("acceptance", ["high2"])):
        s = _scheduler(admission)
        s.add(_req("high1", 0.9))
        s.admit()
        s.add(_req("low1", 0.1))
        s.add(_req("high2", 0.85))
        s.add(_req("low2", 0.15))
        s.admit()                                    # one slot left: who joins high1?
        assert [r.request_id for r in s.running[1:]] == want
    # nothing running: the oldest waiting request anchors the group
    s = _scheduler("acceptance", max_batch=2)
    for name, rate in (("low1", 0.1), ("high1", 0.9), ("low2", 0.2), ("high2", 0.8)):
        s.add(_req(name, rate))
    s.admit()
    assert [r.request_id for r in s.running] == ["low1", "low2"]
    # everyone fits: no reordering at all
    s = _scheduler("acceptance", max_batch=8)
    for name, rate in (("a", 0.1), ("b", 0.9), ("c", 0.2)):
        s.add(_req(name, rate))
    s.admit()
    assert [r.request_id for r in s.running] == ["a", "b", "c"]


def test_admission_by_acceptance_never_starves_a_request():
    """A low-acceptance request behind an endless stream of high ones: once it has waited
    max_wait steps it goes before every other (and a preempted request goes first at once)."""
    max_wait = 5
    s = _scheduler("acceptance", max_batch=2, max_wait=max_wait)
    s.add(_req("h0", 0.9))
    s.add(_req("h1", 0.9))
    s.admit()
    s.add(_req("lonely", 0.05))
    admitted_at = None
    for step in range(40):
        s.add(_req(f"n{step}", 0.9))                 # a new high-acceptance request every step
        s.finish(s.running[0], "stop")               # a slot frees every step
        s.admit()
        if any(r.request_id == "lonely" for r in s.running):
            admitted_at = step
            break
    assert admitted_at is not None and admitted_at <= max_wait
    fifo = _scheduler("fifo")
    assert fifo.admission_order() == []
    # a preempted request is due at once
    s = _scheduler("acceptance", max_batch=1)
    s.add(_req("run", 0.9))
    s.admit()
    back = _req("back", 0.0)
    back.num_preemptions = 1
    s.add(_req("near", 0.9))
    s.add(back)
    s.finish(s.running[0], "stop")
    assert s.admission_order()[0] is back


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    return make_pair(tmp_path_factory.mktemp("pair"))


def test_admission_by_acceptance_in_the_engine_stays_exact(pair):
    """End to end: grouping changes only when requests run, never their greedy tokens; tags give
    the predictions (a repetitive tag accepts more with the n-gram drafter)."""
    tdir, _ = pair
    rep = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [12, 13] * 10, [14, 15, 16, 17] * 5]
    free = [[20 + i, 31 + 2 * i, 47 + i, 60 - i, 3 + 5 * i, 71 + i] for i in range(4)]
    prompts = [p for pair_ in zip(rep, free) for p in pair_]
    tags = ["rep", "free"] * 4
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ar = specrt.LLM(target=str(tdir), draft=None, seed=0).generate(prompts, params)
    order = {}
    for admission in ("fifo", "acceptance"):
        llm = specrt.LLM(target=str(tdir), draft="ngram", seed=0,
                         spec=SpecConfig(max_batch_size=2, admission=admission, max_draft_length=4))
        llm.generate(prompts, params, tags=tags)     # teaches the policy each tag's acceptance
        eng, seen = llm.engine, []
        ids = eng.add_requests(prompts, [params] * len(prompts), tags)
        outs = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.token_ids
            seen.append(tuple(sorted(r.tag for r in eng.scheduler.running)))
        assert [outs[i] for i in ids] == [o.token_ids for o in ar]
        order[admission] = seen
    mixed = {a: sum(1 for t in seen if len(set(t)) > 1) for a, seen in order.items()}
    assert mixed["acceptance"] < mixed["fifo"]


def test_warmup_calibrates_on_typical_prompts(pair):
    tdir, ddir = pair
    llm = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=3), seed=0)
    long_prompt = " ".join(f"w{3 + (i * 7) % 90}" for i in range(150))
    llm.warmup(prompts=[long_prompt, "w5 w6 w7"])
    contexts = [ctx for _, ctx, n, _ in llm.engine.costs.plain_samples if n == 1]
    assert contexts and max(contexts) >= 150          # calibrated on the typical (long) prompt
    assert llm.engine.costs.ar_step_time(1, 150, 1) is not None
    assert not llm.engine.has_unfinished() and llm.engine.num_free_blocks() == llm.engine.kv.num_blocks
    plain = specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(max_draft_length=3), seed=0)
    plain.warmup()                                    # synthetic prompts: short contexts only
    assert max(ctx for _, ctx, n, _ in plain.engine.costs.plain_samples if n == 1) < 150


def test_serve_warmup_prompts_and_kv_cache_memory(pair, tmp_path, monkeypatch, capsys, caplog):
    import uvicorn

    from specrt.server import main

    tdir, ddir = pair
    prompts = tmp_path / "typical.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": " ".join(f"w{3 + (i * 5 + j) % 90}" for j in range(120))})
                                 for i in range(3)) + "\n")
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app))
    budget = 2 * 1024 * 1024
    with caplog.at_level(logging.INFO, logger="specrt.server"):
        rc = main(["--target-model", str(tdir), "--draft-model", str(ddir), "--speculative-decoding",
                   "--port", "0", "--warmup-prompts", str(prompts), "--kv-cache-memory", "2MiB"])
    assert rc == 0
    state = seen["app"].state.specrt
    try:
        eng = state.engine
        per_block = kv_bytes_per_block(list(eng._kv_configs.values()), eng.spec.block_size, eng._kv_dtype)
        assert eng.kv.num_blocks == budget // per_block and eng.kv_cache_tokens == eng.kv.num_blocks * 16
        assert max(ctx for _, ctx, n, _ in eng.costs.plain_samples if n == 1) >= 120
        assert eng.metrics.snapshot()["kv_cache_tokens"] == eng.kv_cache_tokens
    finally:
        state.runner.stop()
    assert any(f"= {eng.kv_cache_tokens} tokens" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    assert main(["--target-model", str(tdir), "--kv-cache-memory", "lots"]) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err
    assert main(["--target-model", str(tdir), "--warmup-prompts", str(tmp_path / "missing.txt")]) == 2
    assert "--warmup-prompts" in capsys.readouterr().err


def test_parse_memory_and_prompts_file(tmp_path):
    assert parse_memory("2GiB") == 2 * 1024 ** 3 and parse_memory("512MB") == 512 * 10 ** 6
    assert parse_memory("1000000") == 1000000 and parse_memory("0.5") == 0.5 and parse_memory("1.0") == 1.0
    assert parse_memory("1.5k") == 1500
    for bad in ("", "-1GiB", "0.0", "two", "5 parsecs"):
        with pytest.raises(ValueError, match="kv"):
            parse_memory(bad, "--kv-cache-memory")
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompts_file(str(txt)) == ["first prompt", "second prompt"]
    js = tmp_path / "p.jsonl"
    js.write_text('"a\\nmultiline prompt"\n{"prompt": "b"}\n')
    assert read_prompts_file(str(js)) == ["a\nmultiline prompt", "b"]
    js.write_text('{"text": "b"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_prompts_file(str(js))


def test_draft_size_guard_warns_over_a_third(pair, caplog):
    tdir, ddir = pair
    with caplog.at_level(logging.WARNING, logger="specrt.engine"):
        big = specrt.LLM(target=str(tdir), draft=str(tdir), seed=0, draft_quantize=None)   # the target as its own draft
    size = big.stats()["draft_size"]
    assert size["ratio"] == pytest.approx(1.0) and size["over_limit"]
    assert any("100% of the target" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specrt.engine"):
        ngram = specrt.LLM(target=str(tdir), draft="ngram", seed=0)
    assert ngram.stats()["draft_size"] is None and not caplog.records
    # a draft under a third of the target's bytes: no warning
    small_t, small_d = make_pair(pair[0].parent / "deep", layers=12)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specrt.engine"):
        ok = specrt.LLM(target=str(small_t), draft=str(small_d), seed=0)
    assert not ok.stats()["draft_size"]["over_limit"] and not caplog.records
