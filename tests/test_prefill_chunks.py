"""Chunked prefill (specrt.step.prefill, SpecConfig.prefill_chunk): a long prompt is fed a chunk per step
while the other requests keep decoding; chunk boundaries depend only on the request, so speculative
and plain decoding still emit the same tokens; a feature drafter sees every chunk's features."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import pair_for_tests, tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.step.prefill import split_prefill  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = [3 + (i * 7) % 90 for i in range(150)]
SHORT = [[11, 12, 13], [20] * 5]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory)


def _req(context: int, cached: int, prompt_logprobs=None, generated: int = 0):
    return SimpleNamespace(context_len=context, target_cached=cached, num_generated=generated, prompt_logprobs=None,
                           params=SimpleNamespace(prompt_logprobs=prompt_logprobs))


def test_split_chunks_long_prompts_and_caps_the_step():
    decoding, long_a, long_b, short, last = _req(30, 29), _req(100, 0), _req(90, 10), _req(5, 0), _req(40, 32)
    s = split_prefill([decoding, long_a, long_b, short, last], chunk=16)
    # long_a takes the whole budget: long_b's next chunk waits; short (5) does not fit either
    assert s.batch == [decoding] and s.prefill == [(long_a, 16)] and s.waiting == [long_b, short, last]
    s = split_prefill([decoding, short, last, long_b], chunk=16)
    # short (5) and last (8, its final chunk: an ordinary request) fit; long_b's 16 do not
    assert s.batch == [decoding, short, last] and s.prefill == [] and s.waiting == [long_b]
    s = split_prefill([long_b, long_a], chunk=16)   # the first prefilling request always runs
    assert s.prefill == [(long_b, 26)] and s.waiting == [long_a]
    whole = split_prefill([long_a, long_b], chunk=0)
    assert whole.batch == [long_a, long_b] and not whole.prefill and not whole.waiting
    scoring = _req(100, 0, prompt_logprobs=1)        # scores its prompt: fed whole
    assert split_prefill([scoring], chunk=16).batch == [scoring]


def test_chunk_boundaries_do_not_depend_on_other_requests():
    for others in ([], [_req(30, 29)], [_req(8, 0)]):
        r = _req(100, 7)
        s = split_prefill(others + [r], chunk=16)
        assert (r, 23) in s.prefill or r in s.waiting


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_speculative_equals_autoregressive_with_chunks(pair, draft):
    tdir, ddir = pair
    spec = dict(prefill_chunk=16, max_draft_length=3)
    ar = specrt.LLM(target=str(tdir), draft=None, spec=SpecConfig(prefill_chunk=16), seed=0)
    sp = specrt.LLM(target=str(tdir), draft=str(ddir) if draft == "model" else "ngram",
                    spec=SpecConfig(**spec, tree="chain"), seed=0)
    prompts = [LONG, *SHORT, LONG[:40]]
    assert tokens(sp.generate(prompts, GREEDY)) == tokens(ar.generate(prompts, GREEDY))


def test_a_streaming_request_keeps_decoding_while_a_long_prompt_is_fed(pair):
    tdir, _ = pair
    chunk = 16
    llm = specrt.LLM(target=str(tdir), draft=None, spec=SpecConfig(prefill_chunk=chunk), seed=0)
    eng = llm.engine
    (sid,) = eng.add_requests([SHORT[0]], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)])
    for _ in range(3):
        eng.step()
    (lid,) = eng.add_requests([LONG], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    steps, short_tokens = 0, 0
    while True:
        outs = {o.request_id: o for o in eng.step()}
        steps += 1
        short_tokens += len(outs[sid].new_token_ids) if sid in outs else 0
        if lid in outs and outs[lid].new_token_ids:
            break
    # the prompt took ceil(150 / 16) steps, and the short request got a token in each of them
    assert steps == -(-len(LONG) // chunk)
    assert short_tokens == steps
    unchunked = specrt.LLM(target=str(tdir), draft=None, spec=SpecConfig(prefill_chunk=0), seed=0).engine
    unchunked.add_requests([LONG], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert any(o.new_token_ids for o in unchunked.step())      # without chunks: one step


def test_a_feature_drafter_sees_every_chunks_features(tmp_path):
    from specrt.drafters.feature import TargetFeatures

    from test_feature_drafter import save_feature_draft

    fdir = save_feature_draft(tmp_path / "draft")
    seen = []

    def watch(drafter):
        observe = drafter.observe_target

        def spy(batch, vb, hidden):
            observe(batch, vb, hidden)
            seen.extend((r.request_id, r.drafter_state) for r in batch)
        drafter.observe_target = spy
        return drafter
    llm = specrt.LLM(target="builtin", draft=str(fdir), spec=SpecConfig(prefill_chunk=16, tree="chain"), seed=0,
                     wrap_drafter=watch, draft_quantize=None)
    prompt = LONG[:70]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    states = [s for _, s in seen if isinstance(s, TargetFeatures) and s.spans]
    # after the prompt's chunks, the features span every prompt position from 0 (none read zeros)
    first = next(s for s in states if s.spans[-1].end >= len(prompt))
    assert first.spans[0].first == 0 and all(a.end == b.first for a, b in zip(first.spans, first.spans[1:]))


def test_bad_prefill_chunk_is_refused_by_name():
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            SpecConfig(prefill_chunk=bad)


def test_the_serve_flag_sets_it():
    from specrt.server.serve import build_parser, engine_kwargs

    base = ["--target-model", "builtin"]
    assert engine_kwargs(build_parser().parse_args(base))["spec"].prefill_chunk == SpecConfig().prefill_chunk
    assert engine_kwargs(build_parser().parse_args(base + ["--prefill-chunk", "64"]))["spec"].prefill_chunk == 64

