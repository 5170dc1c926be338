"""Hostile-run defects of the Python API (issue 39): a stream left early, and one LLM used from
several threads."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

import specrt
from specrt import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return specrt.LLM(target="builtin", draft="builtin", seed=0)


def _idle(llm, free_before: int) -> None:
    """No request left running and every KV block back."""
    assert not llm.engine.has_unfinished()
    assert llm.engine.num_free_blocks() == free_before


def _stream_until_first(llm, how: str) -> None:
    gen = llm.generate_stream(["a b c", "d e f g"], GREEDY)
    next(gen)
    if how == "close":
        gen.close()
    elif how == "gc":
        del gen
        gc.collect()
    else:
        for _ in gen:
            break
        gen.close()   # the for-loop's break leaves the generator suspended; it is closed when dropped


@pytest.mark.parametrize("how", ["break", "close", "gc"])
def test_leaving_a_stream_early_aborts_its_requests(llm, how):
    free = llm.engine.num_free_blocks()
    want = llm.generate(["hello there"], LONG)[0].token_ids
    _idle(llm, free)
    _stream_until_first(llm, how)
    _idle(llm, free)            # aborted at once: their KV is free before any further step
    # the next call collects only its own outputs (it used to raise KeyError: 'req-N')
    outs = llm.generate(["hello there", "x y"], [LONG, GREEDY])
    assert outs[0].token_ids == want and len(outs[1].token_ids) == 6
    _idle(llm, free)


def test_break_out_of_a_for_loop(llm):
    """The plain ``for ...: break`` of the report: the stream, dropped, is collected at once."""
    free = llm.engine.num_free_blocks()

    def leave():
        for _ in llm.generate_stream(["a b c", "d e f"], GREEDY):
            break

    leave()
    _idle(llm, free)
    assert [len(o.token_ids) for o in llm.generate(["q", "r s"], [GREEDY, LONG])] == [6, 24]


def test_two_streams_interleaved_in_one_thread(llm):
    """Two streams advanced alternately: each yields only its own requests, none is lost."""
    free = llm.engine.num_free_blocks()
    seen = {"a": {}, "b": {}}

    def interleave():
        live = {"a": llm.generate_stream(["one two", "three"], GREEDY),
                "b": llm.generate_stream(["four five six"], LONG)}
        while live:
            for name in list(live):
                try:
                    o = next(live[name])
                except StopIteration:
                    del live[name]
                    continue
                seen[name][o.request_id] = o

    t = threading.Thread(target=interleave, daemon=True)   # a stream whose outputs went to the other spins
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "a stream never finished"
    assert sorted(len(o.token_ids) for o in seen["a"].values()) == [6, 6]
    assert [len(o.token_ids) for o in seen["b"].values()] == [24]
    assert not set(seen["a"]) & set(seen["b"])
    _idle(llm, free)


def test_generate_from_several_threads(llm):
    """Four threads generate at once (two of them stream): every call gets exactly its own requests'
    outputs, the same tokens as when run alone (greedy), and nothing hangs."""
    prompts = [["a b", "c d e"], ["f"], ["g h i j", "k", "l m"], ["n o p"]]
    params = [GREEDY, LONG, SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True), LONG]
    alone = [[o.token_ids for o in llm.generate(p, q)] for p, q in zip(prompts, params)]
    free = llm.engine.num_free_blocks()
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(2):
                if i % 2:
                    outs = llm.generate(prompts[i], params[i])
                    results[i] = [o.token_ids for o in outs]
                else:
                    final = {}
                    for o in llm.generate_stream(prompts[i], params[i]):
                        final[o.request_id] = o
                    results[i] = [o.token_ids for o in sorted(final.values(), key=lambda o: int(o.request_id[4:]))]
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a generate call hung"
    assert not errors, errors
    assert [results[i] for i in range(len(prompts))] == alone
    _idle(llm, free)


def test_an_exception_in_a_call_aborts_its_requests(llm, monkeypatch):
    free = llm.engine.num_free_blocks()
    calls = {"n": 0}
    step = llm.engine.step

    def failing_step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return step(*a, **k)

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a b c"], LONG)
    monkeypatch.undo()
    _idle(llm, free)
    assert len(llm.generate(["z"], GREEDY)[0].token_ids) == 6


def test_warmup_refuses_while_a_call_is_in_flight(llm):
    gen = llm.generate_stream(["a b c"], LONG)
    next(gen)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.warmup(num_requests=1, max_tokens=2)
    gen.close()
    assert not llm.engine.has_unfinished()


def test_a_stream_collected_inside_a_step_is_aborted_after_it(llm, monkeypatch):
    """A dropped stream in a reference cycle is freed by the cyclic GC, which may run inside another
    call's step (this thread holds the step lock): its requests are aborted when the step ends,
    without waiting for the lock itself (a deadlock)."""
    free = llm.engine.num_free_blocks()
    gc.disable()
    try:
        gen = llm.generate_stream(["a b c", "d e"], LONG)
        next(gen)
        cycle = [gen]
        cycle.append(cycle)
        del gen, cycle
        step = llm.engine.step

        def step_and_collect(*a, **k):
            outs = step(*a, **k)
            gc.collect()
            return outs

        monkeypatch.setattr(llm.engine, "step", step_and_collect)
        result = []
        t = threading.Thread(target=lambda: result.append(llm.generate(["q r"], GREEDY)), daemon=True)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive(), "deadlocked"
    finally:
        gc.enable()
    monkeypatch.undo()
    assert len(result[0][0].token_ids) == 6
    _idle(llm, free)
