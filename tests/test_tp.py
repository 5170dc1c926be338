"""Tensor parallelism on the CPU (gloo): TP=2 must emit exactly the tokens of TP=1.

Each TPEngine spawns one worker process (~5-10 s to import torch); four engines cover
{model drafter, rejection, overlap}, {model drafter, coupled, budget policy}, {n-gram
drafter, rejection} and {self-draft (first target layer), rejection, confidence policy}, each
with a batch of greedy, seeded-sampled and unseeded-sampled requests (+ an abort).
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from _engine_utils import make_pair
from specrt.config import SamplingParams, SpecConfig
from specrt.step.distributed import TPEngine, create_engine, prefill_logits
from specrt.step.engine import LLMEngine
from specrt.models import ModelConfig, load_model
from specrt.models.tp import check_tp_divisible, shard_config

TIMEOUT = 120


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("tp_pair"), layers=3, draft_layers=1)


@pytest.fixture(autouse=True)
def one_thread():
    # ranks must run the replicated draft with the same thread count; 1 keeps 2 processes off each other
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


PROMPTS = [[1, 5, 9, 13, 5, 9], [1, 7, 7, 7, 7, 8, 7, 7], [1, 20, 30], [1, 44, 45, 46, 44, 45], "w11 w12 w13 w11 w12"]


def _params():
    return [SamplingParams(temperature=0.0, max_tokens=24),
            SamplingParams(temperature=1.0, seed=7, max_tokens=24),
            SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=20),          # unseeded: seed drawn by the engine
            SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4)]


def _run(engine) -> dict[str, list[int]]:
    ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, _params()))]
    done: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, out.finish_reason)
        steps += 1
        if steps == 2:   # an abort mid-run and a late arrival, replayed on the workers at the next step
            engine.abort_request(ids[2])
            engine.add_request([1, 9, 8, 7], SamplingParams(temperature=0.7, seed=11, max_tokens=12), request_id="late")
    return done


@pytest.mark.parametrize("draft_kind,acceptance,policy", [
    ("model", "rejection", "fixed"),     # + overlap pre-drafting
    ("model", "coupled", "budget"),      # K from per-rank timings: rank 0's K are broadcast
    ("ngram", "rejection", "fixed"),
    ("self", "rejection", "confidence"),  # the draft = the SHARDED target's first layer; host-side stops
])
def test_tp2_tokens_identical_to_tp1(pair, draft_kind, acceptance, policy):
    tdir, ddir = pair
    draft = {"model": ddir, "ngram": "ngram", "self": "self:1"}[draft_kind]
    # (coupled output does not depend on K, so budget's timing-dependent K still give TP=1's tokens)
    spec = SpecConfig(max_draft_length=3, min_draft_length=1, acceptance=acceptance, policy=policy,
                      max_batch_size=8, overlap=policy == "fixed" and draft_kind == "model")
    want = _run(LLMEngine(tdir, draft, spec, "cpu", seed=1234))
    engine = create_engine(tdir, draft, spec, "cpu", seed=1234, tensor_parallel_size=2, timeout_s=TIMEOUT)
    assert isinstance(engine, TPEngine)
    try:
        assert engine.kv["target"].shape[4] == 1   # 2 kv heads / 2 ranks: a per-rank cache
        if policy == "budget":
            engine.calibrate(batch_sizes=(1, 2), rounds=1)   # every rank in lockstep (collectives)
            assert engine.costs.num_plain > 0 and not engine.has_unfinished()
        got = _run(engine)
        assert got == want
        assert want["r2"][1] == "abort" and want["late"][1] in ("stop", "length")
        assert engine.num_free_blocks() == engine.kv.manager.num_blocks
        total = engine.metrics.snapshot()["total"]
        assert total["drafted_tokens"] > 0 and total["accepted_tokens"] > 0, total   # speculation happened
        if draft_kind == "model" and acceptance == "rejection":
            # one forward's full logits: sharded == unsharded (1e-5), also for a Qwen2-like model with
            # q/k/v biases, an untied head and a vocabulary (97) that 2 does not divide (padded shard)
            tokens = [1, 5, 9, 13, 5, 9, 40, 41, 3, 17, 88, 90, 91, 2, 60, 61, 62, 63, 64]
            ref = prefill_logits(load_model(tdir), tokens)
            assert torch.allclose(engine.forward_logits(tokens), ref, atol=1e-5, rtol=0)
            qdir = _qwen2_like(tdir.parent / "qwen2")
            ref = prefill_logits(load_model(qdir), tokens)
            assert torch.allclose(engine.forward_logits(tokens, model_path=qdir), ref, atol=1e-5, rtol=0)
    finally:
        procs = list(engine._workers)
        engine.close()
    assert all(not p.is_alive() for p in procs)
    engine.close()   # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def _qwen2_like(folder):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.15)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_tp_rejects_indivisible_heads(pair):
    tdir, _ = pair   # 4 heads, 2 kv heads, ffn 128
    cfg = ModelConfig.from_json(tdir / "config.json")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide .*num_key_value_heads=2"):
        check_tp_divisible(cfg, 4)
    with pytest.raises(ValueError, match=r"num_attention_heads=4, num_key_value_heads=2"):
        shard_config(cfg, 3)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        create_engine(tdir, None, SpecConfig(), "cpu", tensor_parallel_size=3)
    assert time.monotonic() - t0 < 5   # rejected before any process is spawned
    with pytest.raises(ValueError, match="positive integer"):
        create_engine(tdir, None, SpecConfig(), "cpu", tensor_parallel_size=0)
    assert isinstance(create_engine(tdir, None, SpecConfig(), "cpu", tensor_parallel_size=1), LLMEngine)


def test_tp_dead_worker_raises_not_hangs(pair):
    tdir, _ = pair
    engine = TPEngine(tdir, None, SpecConfig(max_batch_size=2), "cpu", tensor_parallel_size=2, timeout_s=30)
    try:
        engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=16))
        engine.step()
        os.kill(engine.worker_pids[0], signal.SIGKILL)
        engine._workers[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - t0 < 40
        with pytest.raises(RuntimeError, match="unusable"):
            engine.step()
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine._workers)


def _reseed_on_rank1(rank, request_id):
    if rank.tp_rank == 1:   # make rank 1 sample differently: its outputs no longer match rank 0's
        rank.engine.scheduler.requests[request_id].seed += 1


def test_tp_divergence_is_detected(pair, capfd):
    tdir, _ = pair
    engine = TPEngine(tdir, None, SpecConfig(max_batch_size=2), "cpu", tensor_parallel_size=2, timeout_s=30)
    try:
        rid = engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=5, max_tokens=32, ignore_eos=True))
        engine.step()
        engine.run_on_all_ranks(_reseed_on_rank1, rid)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            for _ in range(30):   # the seeds differ: within a few steps a token differs and rank 1 stops
                engine.step()
        assert time.monotonic() - t0 < 40
    finally:
        engine.close()
    assert "diverged from rank 0" in capfd.readouterr().err


def test_tp_startup_failure_cleans_up(pair, tmp_path):
    import multiprocessing

    import torch.distributed as dist

    tdir, _ = pair
    with pytest.raises(ValueError, match="draft model not found"):
        TPEngine(tdir, tmp_path / "no-such-draft", SpecConfig(), "cpu", tensor_parallel_size=2, timeout_s=30)
    assert not multiprocessing.active_children()   # the spawned worker was stopped
    assert not dist.is_initialized()                # and the process group torn down: a new engine can start
