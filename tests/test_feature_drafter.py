"""The engine with an EAGLE-style feature draft (specrt.drafters.feature) on the built-in target.

- the target's verify forward returns every fed row's final-normed state only when the drafter
  asks (a ``ReadsTarget`` drafter), and its logits are bit-identical with or without it;
- each proposal consumes exactly the target's features of positions draft_cached-1..L-1 and then
  its own states: its tokens equal a dense teacher-forced DraftModel.forward_dense over the
  target's true features (and a drafter reading features one position off does not);
- fp32 greedy: speculative output == autoregressive output (batch 1 and mixed, K=1..4, prefix
  sharing, preemption), and drafting resumes where features are unknown (zeros);
- rejection sampling's exactness with a reduced-vocabulary feature draft: tests/test_reduced_draft.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import tokens  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402
from specrt.models.attention import AttentionMetadata  # noqa: E402

CODE = ["def foo(x):\n    return", "import os\nimport sys\n\nclass A:\n    def __init__(self):\n        self.",
        "for i in range(10):\n", "    if not isinstance(value, str):\n        raise TypeError(",
        "x = [", "def parse(text, sep=','):\n    \"\"\"Split text.\"\"\"\n    parts = []\n    for"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
FEATURE_SCALE = 0.1      # fc = [I, 0.1 I]: the features change the draft's tokens, it still agrees often


def save_feature_draft(out: Path, layers=(0, 5), scale: float = FEATURE_SCALE) -> Path:
    """A feature DraftModel for the built-in target: target layers ``layers``, fc = [I, scale * I],
    a head over the lower half of the vocabulary (the byte-level BPE's more frequent ids)."""
    from specrt.models import load_model
    from specrt.models.registry import resolve_model
    from specrt.training.draft_train import init_draft
    from specrt.training.vocab import ReducedVocab

    target = load_model(resolve_model("builtin", "target"))
    V, H = target.config.vocab_size, target.config.hidden_size
    draft = init_draft(target, "feature", list(layers), ReducedVocab.from_map(torch.arange(V // 2), V))
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([torch.eye(H), scale * torch.eye(H)], 1))
    draft.save_pretrained(out, generation_config={"bos_token_id": 0, "eos_token_id": 0}, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def fdir(tmp_path_factory):
    torch.set_num_threads(1)
    return save_feature_draft(tmp_path_factory.mktemp("feature") / "draft")


_cache: dict = {}


def llm(draft, **spec) -> specrt.LLM:
    key = (str(draft), tuple(sorted(spec.items())))
    if key not in _cache:
        _cache[key] = specrt.LLM(target="builtin", draft=None if draft is None else str(draft),
                                 spec=SpecConfig(**{"lookup": None, **spec}), seed=0,
                                 draft_quantize=None)   # the float draft's bits
    return _cache[key]


@pytest.fixture(scope="module")
def ar():
    return tokens(llm(None).generate(CODE, GREEDY))


# ----------------------------------------------------------------------------- the hidden states
def _forward(model, ids: list[list[int]], cached: list[int], all_hidden: bool):
    """One target forward over requests whose first ``cached[b]`` tokens are in a fresh cache
    (written by a prefill first), logits at each request's last row."""
    cfg, bs = model.config, 4
    nb = [-(-len(x) // bs) for x in ids]
    cache = torch.zeros(cfg.num_layers, 2, sum(nb), bs, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    tables, at = [], 0
    for n in nb:
        tables.append(list(range(at, at + n)))
        at += n
    pre = [(x[:c], c) for x, c in zip(ids, cached) if c]
    if pre:
        rows = [b for b, c in enumerate(cached) if c]
        meta = AttentionMetadata.build([c for _, c in pre], [c for _, c in pre], [tables[b] for b in rows], bs, "cpu")
        model(torch.tensor([t for x, _ in pre for t in x]), torch.tensor([p for _, c in pre for p in range(c)]),
              meta, cache)
    q = [len(x) - c for x, c in zip(ids, cached)]
    meta = AttentionMetadata.build([len(x) for x in ids], q, tables, bs, "cpu")
    feed = torch.tensor([t for x, c in zip(ids, cached) for t in x[c:]])
    pos = torch.tensor([p for x, c in zip(ids, cached) for p in range(c, len(x))])
    last = torch.tensor(q).cumsum(0) - 1
    return model(feed, pos, meta, cache, logits_indices=last, return_hidden=True, all_hidden=all_hidden), last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False])
def test_all_rows_hidden_leaves_the_logits_bit_identical(dtype, fused):
    """A prefill batch and a verify batch (3-5 rows per request after a cached prefix), on the
    fused CPU path and the op-by-op path: logits with all_hidden equal those without, bit for bit,
    and the hidden at the logits rows is the one return_hidden gives."""
    from specrt.models import load_model
    from specrt.models.registry import resolve_model

    model = load_model(resolve_model("builtin", "target"), dtype=dtype)
    model.set_fused_ops(fused)
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (7, 19, 12)]
    for cached in ([0, 0, 0], [4, 14, 9]):
        (logits, h), last = _forward(model, ids, cached, all_hidden=False)
        (logits_all, h_all), _ = _forward(model, ids, cached, all_hidden=True)
        assert model._fused == (fused and dtype in (torch.float32, torch.bfloat16))
        assert h_all.shape == (sum(len(x) - c for x, c in zip(ids, cached)), model.config.hidden_size)
        assert torch.equal(logits_all, logits)
        assert torch.equal(h_all.index_select(0, last), h)


def test_only_a_drafter_that_asks_gets_the_hidden_states(fdir):
    """The target's forward computes every row's state only for a drafter with
    is a ReadsTarget (plain decoding, a model draft, n-gram: never), and observe_target sees
    [T, H] with T the fed rows of the whole batch."""
    from specrt.drafters import FeatureDrafter, ModelDrafter, NgramDrafter, ReadsTarget, ReducedDrafter

    assert not any(issubclass(c, ReadsTarget) for c in (ModelDrafter, NgramDrafter, ReducedDrafter))
    for draft, wants in ((None, False), ("builtin", False), ("ngram", False), (fdir, True)):
        eng = llm(draft).engine
        calls, seen = [], []
        forward = eng.target.forward

        def spy(*a, **kw):
            calls.append(kw.get("all_hidden"))
            out = forward(*a, **kw)
            seen.append((a[0].shape[0], None if out[1] is None else tuple(out[1].shape)))
            return out
        eng.target.forward = spy
        try:
            llm(draft).generate(CODE[:2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        finally:
            del eng.target.forward
        assert calls and all(c is wants for c in calls), (draft, calls)
        H = eng.target.config.hidden_size
        assert all(s == ((t, H) if wants else None) for t, s in seen), seen
        assert isinstance(eng.drafter, FeatureDrafter) == wants


# ----------------------------------------------------------------------------- the protocol
def _target_features(target, ids: list[int]) -> torch.Tensor:
    """[len(ids), H] the target's final-normed states over ``ids`` (one prefill)."""
    (_, h), _ = _forward(target, [ids], [0], all_hidden=True)
    return h


def _proposals(fdir, wrap=None, k: int = 2):
    """Every proposal of a greedy run over CODE[:3] (one request at a time): (context, tokens)."""
    seen = []

    def record(drafter):
        drafter = wrap(drafter) if wrap else drafter
        propose = drafter.propose

        def spy(batch, ks, *a, **kw):
            ctx = [list(r.token_ids) for r in batch]
            out = propose(batch, ks, *a, **kw)
            ids = out.draft_token_ids.tolist()
            seen.extend((c, ids[b][:out.num_draft_tokens[b]]) for b, c in enumerate(ctx) if out.num_draft_tokens[b])
            return out
        drafter.propose = spy
        return drafter
    eng = specrt.LLM(target="builtin", draft=str(fdir), spec=SpecConfig(max_draft_length=k, max_batch_size=1, tree="chain", lookup=None),
                     seed=0, wrap_drafter=record, draft_quantize=None)
    eng.generate(CODE[:3], GREEDY)
    return eng, seen


def _dense_tokens(draft, target, ctx: list[int], k: int) -> list[int]:
    """What the protocol prescribes: the draft over the whole context fed the target's true
    features (position p reads f_{p-1}, position 0 zeros), then its own state for each next token."""
    H = draft.config.hidden_size
    f = _target_features(target, ctx)
    feats = torch.cat([torch.zeros(1, H), f[:-1]])
    ids, out = list(ctx), []
    for _ in range(k):
        logits, h = draft.forward_dense(torch.tensor([ids]), feats[None])
        out.append(int(draft.draft_to_target[logits[0, -1].argmax()]))
        ids.append(out[-1])
        feats = torch.cat([feats, h[0, -1:]])
    return out


def test_each_proposal_reads_the_true_features_then_its_own(fdir):
    """Every greedy proposal over several steps (catch-ups after accepted and rejected drafts) has
    the tokens of the dense teacher-forced draft over the target's true features; the same check
    fails for a drafter whose catch-up reads features one position off."""
    from specrt.models.draft_model import DraftModel

    eng, seen = _proposals(fdir)
    target = eng.engine.target
    draft = DraftModel.from_pretrained(fdir, target)
    assert len(seen) >= 20 and eng.stats()["total"]["accepted_tokens"] > 0
    mismatched = [(c, got) for c, got in seen if got != _dense_tokens(draft, target, c, len(got))]
    assert not mismatched, mismatched[:3]

    def off_by_one(drafter):
        def shifted(reqs, starts, prev_hidden, sel):
            if starts is None:
                return prev_hidden.index_select(0, sel)
            return torch.cat([r.drafter_state.gather(c, r.context_len, drafter._blank)
                              for r, c in zip(reqs, starts)])
        drafter._step_features = shifted
        return drafter
    _, wrong = _proposals(fdir, wrap=off_by_one)
    assert sum(got != _dense_tokens(draft, target, c, len(got)) for c, got in wrong) > 0


def test_features_are_trimmed_to_the_lag(fdir):
    """After every commit a request keeps only the verified features the next catch-up reads
    (positions draft_cached-1 .. target_cached-1): memory bounded by the lag, not the context."""
    for tree in ("fixed", "chain"):    # drafting every step (the planner may pause it, and the lag with it)
        _check_lag_bound(llm(fdir, max_draft_length=3, tree=tree).engine)


def _check_lag_bound(eng) -> None:
    from specrt.drafters.feature import TargetFeatures

    lags = []
    for r_id in [eng.add_request(CODE[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]:
        while eng.has_unfinished():
            eng.step()
            r = eng.scheduler.requests.get(r_id)
            if r is None or r.finished:
                break
            st = r.drafter_state
            assert isinstance(st, TargetFeatures) and st.spans
            first, end = st.spans[0].first, st.spans[-1].end
            assert first == max(r.draft_cached - 1, 0) and end == r.target_cached, (first, end, r.draft_cached)
            lags.append(end - first)
    assert lags and max(lags[1:]) <= 3 + 1     # past the prompt: at most K + 1 positions


# ----------------------------------------------------------------------------- greedy identity
def test_the_feature_draft_loads_as_its_own_drafter(fdir):
    from specrt.drafters import FeatureDrafter, ReadsTarget, module_bytes
    from specrt.drafters.predraft import PreDrafting
    from specrt.drafters.reduced import ReducedDrafter

    d = llm(fdir).engine.drafter
    assert isinstance(d, FeatureDrafter) and isinstance(d, ReadsTarget) and not isinstance(d, PreDrafting)
    dm = d.draft
    assert d.size_bytes() == module_bytes(dm.fc, *dm.layers, dm.norm) + dm.head.numel() * dm.head.element_size()
    assert d.draft.embed.data_ptr() == llm(fdir).engine.target.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="feature"):
        ReducedDrafter(dm, d.settings)
    model, n = d.step_model()         # the bench's cost hint runs fc + layers + head
    assert n is None and model.config.num_layers == 2


def test_overlap_is_refused_with_a_reason(fdir, ar):
    sp = llm(fdir, max_draft_length=2, overlap=True)
    status = sp.engine.metrics.info["overlap"]
    assert status["requested"] and not status["active"] and "hidden states" in status["note"]
    assert tokens(sp.generate(CODE, GREEDY)) == ar


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_equals_autoregressive(fdir, ar, k):
    sp = llm(fdir, max_draft_length=k, block_size=4)
    sp.engine.reset_metrics()
    assert tokens(sp.generate(CODE, GREEDY)) == ar
    total = sp.stats()["total"]
    assert total["drafted_tokens"] > 0 and total["accepted_tokens"] > 0
    for i in (0, 3):                  # alone (its prefix blocks now shared with the batch run's)
        assert tokens(sp.generate(CODE[i:i + 1], GREEDY)) == ar[i:i + 1]
    assert tokens(sp.generate(CODE[::-1], GREEDY)) == ar[::-1]


def test_drafting_resumes_over_a_shared_prefix(fdir, ar):
    """A request reusing another's prefix blocks never saw their features (its target forward
    starts past them): those positions read zeros, drafting goes on, the output is exact."""
    sp = specrt.LLM(target="builtin", draft=str(fdir), spec=SpecConfig(max_draft_length=3, block_size=4, tree="chain", lookup=None),
                     seed=0)
    eng = sp.engine
    seen = []
    alloc = eng.scheduler.try_allocate

    def spy(req):
        ok = alloc(req)
        seen.append(req.target_cached)
        return ok
    eng.scheduler.try_allocate = spy
    assert tokens(sp.generate(CODE[1:2], GREEDY)) == ar[1:2]
    sp.engine.reset_metrics()
    assert tokens(sp.generate(CODE[1:2], GREEDY)) == ar[1:2]
    assert seen[0] == 0 and seen[1] >= 8          # the second request's target skipped shared blocks
    assert sp.stats()["total"]["accepted_tokens"] > 0


def test_preemption_keeps_the_output_and_drafting_resumes(fdir, ar):
    """A KV cache too small for the batch: requests are preempted and recompute their context;
    greedy output stays token-identical and the preempted requests draft again afterwards."""
    from specrt.models.kv_cache import kv_bytes_per_block
    from specrt.models import load_model
    from specrt.models.draft_model import DraftModel
    from specrt.models.registry import resolve_model

    cfgs = [load_model(resolve_model("builtin", "target")).config, DraftModel.from_pretrained(fdir).lm_config]
    spec = SpecConfig(max_draft_length=3, block_size=4, tree="chain", lookup=None, kv_cache_budget=40 * kv_bytes_per_block(cfgs, 4, torch.float32))
    drafted_after = []

    def watch(drafter):
        propose = drafter.propose

        def spy(batch, ks, *a, **kw):
            out = propose(batch, ks, *a, **kw)
            drafted_after.extend(n for r, n in zip(batch, out.num_draft_tokens) if r.num_preemptions)
            return out
        drafter.propose = spy
        return drafter
    sp = specrt.LLM(target="builtin", draft=str(fdir), spec=spec, seed=0, wrap_drafter=watch)
    assert tokens(sp.generate(CODE, GREEDY)) == ar
    assert sp.stats()["preemptions"] > 0
    assert sum(drafted_after) > 0                  # preempted requests drafted again
    assert sp.engine.num_free_blocks() == sp.engine.kv.num_blocks
