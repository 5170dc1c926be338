"""The draft's long-context KV window (issue 16, item 9): the draft attends to attention sinks
plus a recent window (a shorter block table over the same blocks; keys keep their positions),
so its attention stops growing with the context, while the target verifies over the full
context: the output is exact (greedy token-identical, coupled identical to autoregressive
sampling); only acceptance may change."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import make_pair  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig, ops  # noqa: E402
from specrt.models.attention import AttentionMetadata, KVWindow  # noqa: E402


def test_view_keeps_sink_blocks_and_the_recent_blocks():
    w = KVWindow(sinks=4, recent=40)
    table = list(range(100, 120))                    # 20 blocks of 16: 320 positions
    blocks, n = w.view(300, 1, table, 16)            # the query at 299 sees >= 260: blocks 16.. (256..299)
    assert blocks == [100] + table[16:19] and n == 16 + (300 - 256)
    blocks, n = w.view(300, 5, table, 16)            # the first query at 295 sees >= 256
    assert blocks == [100] + table[16:19]
    assert w.view(50, 1, table, 16) == (table[:4], 50)          # short: everything
    assert w.view(300, 300, table, 16) == (table[:19], 300)     # a prefill chunk sees it all
    assert KVWindow(0, 16).view(64, 1, table, 16) == (table[3:4], 16)   # no sinks: only the recent block
    with pytest.raises(ValueError):
        KVWindow(-1, 8)
    with pytest.raises(ValueError):
        KVWindow(4, 0)


@pytest.mark.parametrize("query_len", [1, 3])
def test_attention_over_the_view_is_attention_over_sinks_and_recent_keys(query_len):
    """The kernel over the shortened view equals, in float64, attention over the full context
    restricted to the kept keys at their true positions (causal order preserved)."""
    torch.manual_seed(0)
    bs, H, Hkv, D, s = 8, 4, 2, 16, 150
    nb = -(-s // bs)
    cache = torch.randn(2, nb + 3, bs, Hkv, D)
    table = list(torch.randperm(nb + 3)[:nb].tolist())
    w = KVWindow(sinks=3, recent=20)
    meta = AttentionMetadata.build([s], [query_len], [table], bs, window=w)
    assert meta.seq_lens_host[0] < s and meta.context_lens_host == [s] and meta.max_context_len == s
    q = torch.randn(query_len, H, D)
    got = ops.paged_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, D ** -0.5)
    blocks, _ = w.view(s, query_len, table, bs)
    kept = [b * bs + i for b in range(nb) if table[b] in blocks for i in range(bs)]   # true positions kept
    keys = torch.tensor([p for p in kept if p < s])
    k = cache[0, torch.tensor(table)[keys // bs], keys % bs].double().repeat_interleave(H // Hkv, 1)
    v = cache[1, torch.tensor(table)[keys // bs], keys % bs].double().repeat_interleave(H // Hkv, 1)
    pos = torch.arange(s - query_len, s)[:, None]
    scores = torch.einsum("nhd,shd->hns", q.double(), k) * D ** -0.5
    probs = scores.masked_fill(~(keys[None, :] <= pos), float("-inf")).softmax(-1)
    want = torch.einsum("hns,shd->nhd", probs, v).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert keys[:bs].tolist() == list(range(bs)) and len(keys) < s / 2   # the sink block, then recent ones


def test_writes_go_to_the_true_slots():
    w = KVWindow(sinks=0, recent=8)
    table = [7, 3, 9, 1]
    full = AttentionMetadata.build([60], [2], [table], 16)
    view = AttentionMetadata.build([60], [2], [table], 16, window=w)
    assert view.slot_mapping.tolist() == full.slot_mapping.tolist() == [1 * 16 + 10, 1 * 16 + 11]
    assert view.block_tables.tolist() == [[1]] and view.seq_lens_host == [60 - 48]
    assert AttentionMetadata.build([60], [2], [table], 16, write=False).slot_mapping.tolist() == [-1, -1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    return make_pair(tmp_path_factory.mktemp("pair"), max_position_embeddings=512)


LONG = [[(7 * i + 3 * (i // 5)) % 90 + 3 for i in range(n)] for n in (300, 180, 260)]


@pytest.mark.parametrize("draft", ["model", "self:2"])
def test_windowed_draft_keeps_the_output_exact(pair, draft):
    tdir, ddir = pair
    d = str(ddir) if draft == "model" else draft
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=i) for i in range(3)]
    ar = specrt.LLM(target=str(tdir), draft=None, seed=0)
    want_g, want_s = ar.generate(LONG, greedy), ar.generate(LONG, sampled)
    attended = {}
    for window in (0, 32):
        spec = dict(max_draft_length=3, draft_kv_window=window, draft_kv_sinks=4, tree="chain", lookup=None)   # 3 rows a phase
        llm = specrt.LLM(target=str(tdir), draft=d, spec=SpecConfig(**spec), seed=0)
        assert [o.token_ids for o in llm.generate(LONG, greedy)] == [o.token_ids for o in want_g]
        coupled = specrt.LLM(target=str(tdir), draft=d, spec=SpecConfig(acceptance="coupled", **spec), seed=0)
        assert [o.token_ids for o in coupled.generate(LONG, sampled)] == [o.token_ids for o in want_s]
        # (depth, tokens fed, attended, seconds) per drafting phase; steady decode: 3 rows, 1 token per forward
        steady = [att / fed for depth, fed, att, _ in llm.engine.costs.draft_samples if fed == depth * 3]
        assert steady
        attended[window] = max(steady)
        trees = specrt.LLM(target=str(tdir), draft=d, spec=SpecConfig(**{**spec, "tree": "fixed"}), seed=0)
        assert [o.token_ids for o in trees.generate(LONG, greedy)] == [o.token_ids for o in want_g]
        if window:
            assert llm.engine.drafter.settings.kv_window == specrt.models.attention.KVWindow(4, 32)
    # the window bounds what a row attends (the sink block, the recent window, two partial blocks)
    assert attended[32] <= 16 + 32 + 2 * 16 < 150 < attended[0]


def test_draft_kv_window_config_is_validated():
    with pytest.raises(ValueError, match="draft_kv_window"):
        SpecConfig(draft_kv_window=-1)
    with pytest.raises(ValueError, match="draft_kv_sinks"):
        SpecConfig(draft_kv_sinks=-2)
