"""Suffix drafting through the engine (draft="suffix", "MODEL+suffix"; specrt.drafters.suffix).

- greedy: output == autoregressive decoding in chain, fixed-tree and dynamic-tree modes, batches
  of 1-6, and in front of a draft model;
- coupled sampling equals plain sampling with the same seed;
- the global index: a request that repeats an earlier one drafts from its output, nearly every
  draft is accepted, and chains run past the tree's node budget; forget_outputs empties it;
- tenants: with scoping on, a request never drafts from another tenant's outputs;
- per-source counts reach stats() and /metrics; bad settings name the field.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import make_pair, tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.drafters.suffix import SuffixDrafter, SuffixSettings  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20, 21] * 5, [30, 31], [40, 41, 42, 43, 40, 41, 42], [70]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    return make_pair(tmp_path_factory.mktemp("suffix"))


@pytest.fixture(scope="module")
def ar(pair):
    return tokens(specrt.LLM(target=str(pair[0]), draft=None, seed=0).generate(PROMPTS, GREEDY))


def llm(pair, draft="suffix", **spec):
    d = draft.replace("MODEL", str(pair[1]))
    return specrt.LLM(target=str(pair[0]), draft=d, spec=SpecConfig(**spec), seed=0)


def drafted(eng) -> int:
    return eng.stats()["total"]["drafted_tokens"]


@pytest.mark.parametrize("tree", ["chain", "fixed", "dynamic"])
def test_greedy_equals_autoregressive(pair, ar, tree):
    eng = llm(pair, tree=tree)
    assert isinstance(eng.engine.drafter, SuffixDrafter)
    assert eng.engine.spec.max_draft_length == 16          # the suffix drafter's own default K
    for batch in (1, 3, 6):
        assert tokens(eng.generate(PROMPTS[:batch], GREEDY)) == ar[:batch], (tree, batch)
    assert drafted(eng) > 0


@pytest.mark.parametrize("draft", ["MODEL+suffix", "MODEL+suffix:min_match=2,max_match=8"])
def test_in_front_of_a_draft_model(pair, ar, draft):
    eng = llm(pair, draft, max_draft_length=4, tree="fixed")           # (drafts every step)
    assert eng.engine.spec.max_draft_length == 4 and eng.engine.drafter.name == "model+suffix"
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar                  # 6 at once: mostly the model alone
    for i in range(0, len(PROMPTS), 2):                                 # 2 at once: the lookup drafts,
        assert tokens(eng.generate(PROMPTS[i:i + 2], GREEDY)) == ar[i:i + 2]   # the global index matches too
    sources = eng.stats()["draft_sources"]
    assert sources["request"]["matches"] > 0 and sources["global"]["matches"] > 0


def test_coupled_sampling_equals_plain_sampling(pair):
    params = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=i) for i in range(len(PROMPTS))]
    want = tokens(specrt.LLM(target=str(pair[0]), draft=None, seed=0).generate(PROMPTS, params))
    for tree in ("chain", "fixed"):
        eng = llm(pair, tree=tree, acceptance="coupled")
        assert tokens(eng.generate(PROMPTS, params)) == want
        assert tokens(eng.generate(PROMPTS, params)) == want


def test_a_repeated_request_drafts_from_the_earlier_output(pair, ar):
    eng = llm(pair, tree="fixed", max_tree_nodes=4)
    prompt = [[90, 3, 17, 33]]
    first = tokens(eng.generate(prompt, GREEDY))
    before = eng.stats()
    eng.engine.reset_metrics()
    assert tokens(eng.generate(prompt, GREEDY)) == first
    snap = eng.stats()
    g = snap["draft_sources"]["global"]
    assert g["index_tokens"] >= 40 and g["index_bytes"] > 0
    assert g["matches"] > 0 and g["accepted"] >= 0.9 * g["drafted"] > 0
    # the second run's 40 tokens come in far fewer target forwards; chains ran past the 4-node budget
    assert snap["total"]["steps"] <= 8 < before["total"]["steps"]
    assert snap["total"]["drafted_tokens"] / snap["total"]["steps"] > 4


@pytest.mark.parametrize("spec", ["suffix", "ngram"])
def test_the_lookup_stays_out_of_big_batches(spec):
    from types import SimpleNamespace

    from specrt.drafters.lookup import LOOKUP_MAX_BATCH, make_lookup

    lookup = make_lookup(spec)

    def req():
        ids = [5, 6, 7, 5, 6, 7, 5, 6]
        return SimpleNamespace(prompt_token_ids=ids, output_token_ids=[], token_ids=ids, params=GREEDY, tenant=None,
                               lookup_state=None)

    for n, drafts in ((1, True), (LOOKUP_MAX_BATCH, True), (LOOKUP_MAX_BATCH + 1, False), (8, False)):
        batch = [req() for _ in range(n)]
        found = lookup.propose(batch, [4] * n, [False] * n)
        assert (sorted(found) == list(range(n))) if drafts else found == {}, (spec, n, found)


@pytest.mark.parametrize("lookup, name", [("suffix", "model+suffix"), ("suffix:min_match=2", "model+suffix"),
                                          ("ngram", "model+ngram"), (None, "model")])
def test_a_draft_model_named_alone_gets_the_configured_lookup(pair, ar, lookup, name):
    eng = llm(pair, "MODEL", max_draft_length=4, lookup=lookup)
    assert eng.engine.drafter.name == name
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar
    if lookup is None:
        assert "draft_sources" not in eng.stats()
    assert llm(pair, "MODEL", max_draft_length=4).engine.drafter.name == "model+suffix"     # the default
    assert llm(pair, "MODEL+ngram", lookup=lookup).engine.drafter.name == "model+ngram"      # the string wins
    assert llm(pair, "suffix", lookup=lookup).engine.drafter.name == "suffix"                # no lookup on a lookup


@pytest.mark.parametrize("bad", ["trie", "suffix:max_match=0", 3])
def test_a_bad_lookup_names_the_field(pair, bad):
    with pytest.raises(ValueError, match="lookup|max_match"):
        llm(pair, "MODEL", lookup=bad)


@pytest.mark.parametrize("draft", ["suffix", "MODEL"])
def test_a_seeded_sampled_request_does_not_depend_on_earlier_outputs(pair, draft):
    """Under rejection sampling a draft changes what a request samples: the global index (other
    requests' outputs) must not draft its sampled rows, or a seed would not reproduce its output."""
    eng = llm(pair, draft, tree="chain", max_draft_length=4)
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3)
    runs = [tokens(eng.generate(PROMPTS, params)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert eng.stats()["draft_sources"]["global"]["matches"] == 0
    greedy = tokens(eng.generate(PROMPTS, GREEDY))                 # greedy rows still read it
    assert tokens(eng.generate(PROMPTS, GREEDY)) == greedy
    assert eng.stats()["draft_sources"]["global"]["matches"] > 0


@pytest.mark.parametrize("draft", ["suffix", "MODEL+suffix"])
def test_forget_outputs_empties_the_global_index(pair, ar, draft):
    eng = llm(pair, draft, tree="fixed", max_tree_nodes=4)
    prompt = [[90, 3, 17, 33]]
    first = tokens(eng.generate(prompt, GREEDY))
    assert eng.stats()["draft_sources"]["global"]["index_tokens"] >= 40
    eng.engine.forget_outputs()
    eng.engine.reset_metrics()
    assert eng.stats()["draft_sources"]["global"]["index_tokens"] == 0
    assert tokens(eng.generate(prompt, GREEDY)) == first
    assert eng.stats()["draft_sources"]["global"]["matches"] == 0     # nothing earlier to draft from


def test_tenants_do_not_read_each_other(pair):
    eng = llm(pair, "suffix:scoped=1", tree="fixed")
    prompt = [[90, 3, 17, 33]]

    def global_matches() -> int:
        return eng.stats()["draft_sources"]["global"]["matches"]

    eng.generate(prompt, GREEDY, tenants=["alice"])
    eng.generate(prompt, GREEDY, tenants=["bob"])              # alice's output is not bob's to read
    assert global_matches() == 0
    eng.generate(prompt, GREEDY, tenants=["alice"])
    assert global_matches() > 0
    shared = llm(pair, "suffix", tree="fixed")                 # unscoped: one history for everyone
    shared.generate(prompt, GREEDY, tenants=["alice"])
    shared.generate(prompt, GREEDY, tenants=["bob"])
    assert shared.stats()["draft_sources"]["global"]["matches"] > 0
    with pytest.raises(ValueError, match="tenant"):
        eng.generate(prompt, GREEDY, tenants=[7])


def test_sources_reach_prometheus(pair):
    eng = llm(pair)
    eng.generate(PROMPTS, GREEDY)
    text = eng.engine.metrics.prometheus()
    assert 'specrt_draft_source_accepted_total{source="request"}' in text
    assert "specrt_suffix_index_tokens " in text


@pytest.mark.parametrize("draft, field", [
    ("suffix:max_match=0", "max_match"), ("suffix:min_prob=2", "min_prob"), ("suffix:bogus=1", "bogus"),
    ("suffix:min_match=9,max_match=4", "min_match"), ("suffix:max_nodes=x", "max_nodes"),
    ("suffix:match_factor=nan", "match_factor"),
])
def test_bad_settings_name_the_field(pair, draft, field):
    with pytest.raises(ValueError, match=field):
        llm(pair, draft)


def test_settings_parse():
    s = SuffixSettings.parse("suffix:max_match=8,min_prob=0.25,scoped=1,global_tokens=0")
    assert (s.max_match, s.min_prob, s.scoped, s.global_tokens) == (8, 0.25, True, 0)
    assert SuffixSettings.parse("suffix") == SuffixSettings()


def test_the_server_scopes_by_the_user_field(pair):
    """``specrt serve --draft-model suffix --suffix-scoped``: the OpenAI "user" names the tenant."""
    from fastapi.testclient import TestClient

    from specrt.step.engine import LLMEngine
    from specrt.server import create_app
    from specrt.server.serve import _suffix_flags

    engine = LLMEngine(str(pair[0]), _suffix_flags("suffix", True, None), SpecConfig(tree="fixed"), device="cpu")
    body = {"prompt": "w5 w6 w7 w8", "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    def global_matches() -> int:
        return engine.metrics.snapshot()["draft_sources"]["global"]["matches"]

    with TestClient(create_app(engine)) as client:       # warm-up and calibration outputs are not indexed
        assert client.post("/v1/completions", json={**body, "user": "alice"}).status_code == 200
        start = global_matches()
        assert client.post("/v1/completions", json={**body, "user": "bob"}).status_code == 200
        assert global_matches() == start
        assert client.post("/v1/completions", json={**body, "user": "alice"}).status_code == 200
        assert global_matches() > start
        assert "specrt_draft_source_matches_total" in client.get("/metrics").text
    with pytest.raises(ValueError, match="suffix drafter"):
        _suffix_flags("ngram", True, None)


def test_long_verify_chains_stay_on_the_kernel(pair, monkeypatch):
    """A verify of more than 16 rows (suffix chains run to 16 drafts and past) attends with the
    paged-attention kernel, as decoding its tokens would, not with a prefill's SDPA: greedy
    output stays token-identical in bf16 too."""
    from specrt.step import verify as verify_mod
    from specrt.models.attention import AttentionMetadata
    from specrt.models.attention_path import kernel_batch

    for verify in (None, [True]):  # on the CPU every chunk takes the kernel (elsewhere only a verify)
        meta = AttentionMetadata.build([40], [21], [[0, 1, 2]], 16, verify=verify)
        assert kernel_batch(meta) is not None
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    ar = specrt.LLM(target=str(pair[0]), draft=None, seed=0, dtype=torch.bfloat16)
    loop = [[5, 6] + tokens(ar.generate([[5, 6]], params))[0]]     # the pair's greedy text settles into a loop
    want = tokens(ar.generate(loop, params))
    rows = []
    build = verify_mod.build_verify_batch

    def spy(*args, **kwargs):
        vb = build(*args, **kwargs)
        rows.append((max(vb.attn_metadata.query_lens_host), kernel_batch(vb.attn_metadata) is not None))
        return vb

    monkeypatch.setattr("specrt.step.engine.build_verify_batch", spy)
    eng = specrt.LLM(target=str(pair[0]), draft="suffix:max_match=4,match_factor=8",
                     spec=SpecConfig(max_draft_length=24, tree="chain"), seed=0, dtype=torch.bfloat16)
    assert tokens(eng.generate(loop, params)) == want
    assert max(n for n, _ in rows[1:]) > 17                         # verifies of more than 17 rows ran ...
    assert all(on for _, on in rows[1:])                            # ... every one on the kernel (past the prefill)


def test_depth_rates_shorten_drafts_the_target_stops_following():
    """A source whose drafts the target follows for 2 tokens and then leaves: after enough verifies
    its deep nodes fall under min_prob, while a fresh source still drafts the whole chain."""
    from specrt.drafters.suffix import DepthRates, SuffixTree, _shape

    chain = SuffixTree(list(range(10, 18)), list(range(-1, 7)), [1.0] * 8, "request", 8)
    assert len(_shape(chain, 8, DepthRates(), 0.1).tokens) == 8          # the prior: 0.8 per level
    rates = DepthRates()
    for _ in range(200):
        rates.observe(8, 2)
    cut = _shape(chain, 8, rates, 0.1)
    assert cut.tokens == [10, 11] and min(cut.probs) > 0.95          # depth 3 was never accepted
    assert rates.factors(4)[3] < 0.01
    assert len(_shape(chain, 5, DepthRates(), 0.0).tokens) == 5          # the depth cap


@pytest.mark.parametrize("kind", ["model", "feature", "self:1"])
def test_the_lookup_in_front_learns_what_was_accepted(pair, tmp_path, kind):
    """Every model-backed drafter tells the suffix lookup in front what its drafts got accepted
    (per-source drafted/accepted counts and the depth rates): the feature and self:N drafters
    once skipped it, so their lookup never counted a draft."""
    from test_feature_drafter import save_feature_draft

    if kind == "model":
        target, draft = str(pair[0]), f"{pair[1]}+suffix"
    elif kind == "feature":
        target, draft = "builtin", f"{save_feature_draft(tmp_path / 'feature')}+suffix"
    else:
        target, draft = "builtin", "self:1+suffix"
    eng = specrt.LLM(target=target, draft=draft, spec=SpecConfig(max_draft_length=4, tree="fixed"), seed=0)
    for p in PROMPTS[:3]:
        eng.generate([p], GREEDY)
    req = eng.stats()["draft_sources"]["request"]
    assert req["matches"] > 0 and req["drafted"] > 0 and 0 < req["accepted"] <= req["drafted"]
    rates = eng.engine.drafter.lookup.suffix.indexes.rates["request"]
    assert rates != type(rates)()        # observed at least one verify
