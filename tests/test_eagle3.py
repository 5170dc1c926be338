"""EAGLE-3 drafts: the target returns a low, a middle and a high layer's states (fused kernels,
the C++ layer stack and the plain path agree), a draft fuses them, the engine feeds them to it
(greedy output stays the target's), and the training store / loop around it (lazy shards,
held-out evaluation that keeps the best weights)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from specrt.models.draft_model import DraftModel
from specrt.training.draft_train import TrainConfig, collate, init_draft, train_draft
from specrt.training.teacher import load_teacher, sparse_targets
from specrt.training.teacher_store import open_teacher_store
from specrt.training.vocab import build_reduced_vocab, token_counts

BUILTIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specrt", "builtin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BUILTIN, "target", "model.safetensors")),
                                reason="specrt/builtin not exported")
LAYERS = (1, 3, 6)  # the built-in target has 6 layers: 6 = its final-normed state


@pytest.fixture(scope="module")
def target():
    from specrt.models import load_model
    return load_model(os.path.join(BUILTIN, "target"))


def _forward(model, seqs, q, hidden_layers, stack=True, seed=1):
    """Prefill ``seqs``, then a verify-shaped step of q tokens each; returns both steps' outputs."""
    from specrt.models.kv_cache import AttentionMetadata, allocate_kv_cache
    g = torch.Generator().manual_seed(seed)
    bs, lens = 16, [len(s) for s in seqs]
    tables, nxt = [], 0
    for n in lens:
        nb = -(-(n + q) // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    cache = allocate_kv_cache(model.config, nxt, bs, model.dtype, model.device)
    meta = AttentionMetadata.build(lens, lens, tables, bs, model.device)
    ids = torch.tensor([x for s in seqs for x in s])
    pos = torch.tensor([p for n in lens for p in range(n)])
    first = model(ids, pos, meta, cache, all_hidden=True, hidden_layers=hidden_layers)
    new = torch.randint(3, 4000, (len(seqs) * q,), generator=g)
    meta = AttentionMetadata.build([n + q for n in lens], [q] * len(seqs), tables, bs, model.device)
    pos = torch.tensor([n + i for n in lens for i in range(q)])
    saved, model.layer_stack = model.layer_stack, stack
    try:
        second = model(new, pos, meta, cache, all_hidden=True, hidden_layers=hidden_layers)
    finally:
        model.layer_stack = saved
    return first, second


def test_hidden_layers_concatenate_the_layer_outputs_and_leave_logits_alone(target):
    seqs = [list(range(5, 25)), list(range(100, 133))]
    (l0, h0), (l1, h1) = _forward(target, seqs, 3, None)
    (m0, g0), (m1, g1) = _forward(target, seqs, 3, LAYERS)
    H = target.config.hidden_size
    assert g0.shape == (53, 3 * H) and g1.shape == (6, 3 * H)
    assert torch.equal(l0, m0) and torch.equal(l1, m1)                 # logits bit-identical
    assert torch.equal(g0[:, 2 * H:], h0) and torch.equal(g1[:, 2 * H:], h1)  # index 6: final-normed
    # the C++ layer stack's capture equals the per-layer Python loop's, bit for bit
    (_, _), (_, loop) = _forward(target, seqs, 3, LAYERS, stack=False)
    assert torch.equal(g1, loop)
    # order follows the request: (3, 1) returns layer 3's block first
    (_, _), (_, rev) = _forward(target, seqs, 3, (3, 1))
    assert torch.equal(rev[:, :H], g1[:, H:2 * H]) and torch.equal(rev[:, H:], g1[:, :H])


def test_hidden_layers_match_the_unfused_float32_path(target):
    seqs = [list(range(7, 30))]
    f32 = target.float()
    try:
        (_, ref), _ = _forward(f32, seqs, 1, LAYERS)
        f32._fused = False  # the plain module path (prepare() is not rerun: _prepared stays)
        f32._prepared = True
        (_, plain), _ = _forward(f32, seqs, 1, LAYERS)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    torch.testing.assert_close(ref, plain, atol=1e-3, rtol=1e-3)


def test_bad_hidden_layers_name_the_argument(target):
    with pytest.raises(ValueError, match="hidden_layers"):
        _forward(target, [[5, 6, 7]], 1, (0, 7))
    with pytest.raises(ValueError, match="hidden_layers"):
        _forward(target, [[5, 6, 7]], 1, ())


@pytest.fixture(scope="module")
def vocab():
    return build_reduced_vocab(torch.arange(4096, 0, -1), 1024, always=[0])


def test_eagle3_draft_config_roundtrips_and_starts_as_its_single_feature_draft(tmp_path, target, vocab):
    t32 = target.float()
    try:
        single = init_draft(t32, "feature", [5], vocab, fc_init="sum")  # fc reads the feature
        fused = init_draft(t32, "feature", [5], vocab, fc_init="sum", feature_layers=LAYERS)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    assert fused.config.feature_size == 3 * 256 and fused.fuse.weight.shape == (256, 768)
    fused.save_pretrained(tmp_path / "d", dtype=torch.float32)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["specrt_draft"]["feature_layers"] == list(LAYERS) and raw["specrt_draft"]["target_num_layers"] == 6
    back = DraftModel.from_pretrained(tmp_path / "d", target.model.embed_tokens.weight.float())
    assert back.config.feature_layers == LAYERS and torch.equal(back.fuse.weight, fused.fuse.weight)
    # the fuse passes the final-normed block through: the same logits as the single-feature draft
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 4000, (2, 9), generator=g)
    feats = torch.randn(2, 9, 768, generator=g)
    feats[..., :512] *= 40  # residual streams are large: normalised before the fuse
    a, _ = single.forward_dense(ids, feats[..., 512:])
    b, _ = fused.forward_dense(ids, feats)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # inner layers' blocks reach the fuse RMS-normalised, the final-normed block as it is
    normed = fused.normalize_layers(feats)
    torch.testing.assert_close(normed[..., :512].reshape(2, 9, 2, 256).pow(2).mean(-1),
                               torch.ones(2, 9, 2), atol=1e-4, rtol=1e-4)
    assert torch.equal(normed[..., 512:], feats[..., 512:])
    raw["specrt_draft"]["feature_layers"] = [1, 9]
    (tmp_path / "d" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="feature_layers"):
        DraftModel.from_pretrained(tmp_path / "d", target)
    with pytest.raises(ValueError, match="feature_layers"):
        init_draft(target, "feature", [5], vocab, feature_layers=(1, 7))


def test_engine_feeds_an_eagle3_draft_its_fused_features_and_output_stays_the_targets(tmp_path, target, vocab):
    import specrt
    from specrt.drafters.feature import FeatureDrafter
    t32 = target.float()
    try:
        d = init_draft(t32, "feature", [5], vocab, feature_layers=LAYERS)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    with torch.no_grad():
        d.fuse.weight.normal_(0, 0.05)  # a draft that uses every block
    d.save_pretrained(tmp_path / "e3")
    (tmp_path / "e3" / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    widths = []
    real = FeatureDrafter.observe_target

    def spy(self, batch, vb, hidden):
        widths.append(hidden.shape[1])
        return real(self, batch, vb, hidden)

    prompts = [[5, 17, 300, 41], [9, 9, 1200, 7, 7], [77] * 6]
    params = specrt.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = specrt.SpecConfig(max_model_len=256, max_batch_size=4)
    plain = specrt.LLM(target="builtin", spec=spec).generate(prompts, params)
    FeatureDrafter.observe_target = spy
    try:
        llm = specrt.LLM(target="builtin", draft=str(tmp_path / "e3"), spec=spec)
        out = llm.generate(prompts, params)
    finally:
        FeatureDrafter.observe_target = real
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert widths and set(widths) == {768}


def test_lazy_store_reads_what_the_eager_one_holds(tmp_path, target):
    g = torch.Generator().manual_seed(3)
    for i, lens in enumerate([(12, 30), (25,), (9, 14, 40)]):
        seqs = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lens]
        os.makedirs(tmp_path / f"d{i % 2}", exist_ok=True)
        sparse_targets(target, seqs, [2] * len(seqs), k=8, features=True,
                       hidden_layers=LAYERS).save(str(tmp_path / f"d{i % 2}" / f"teacher_{i:05d}.safetensors"))
    lazy = open_teacher_store([str(tmp_path / "d0"), str(tmp_path / "d1")])
    eager = [load_teacher(str(tmp_path / "d0")), load_teacher(str(tmp_path / "d1"))]
    from specrt.training.teacher import TeacherShard
    eager = TeacherShard.concat(eager)
    assert lazy.num_sequences == 6 and lazy.num_positions == eager.num_positions and lazy.feature_width == 768
    assert torch.equal(lazy.token_ids, eager.token_ids) and torch.equal(lazy.offsets, eager.offsets)
    a, b = collate(lazy, [4, 0, 3], True), collate(eager, [4, 0, 3], True)
    for x, y in zip((a.input_ids, a.features, a.loss_mask, a.topk_ids, a.topk_logprobs),
                    (b.input_ids, b.features, b.loss_mask, b.topk_ids, b.topk_logprobs)):
        assert torch.equal(x, y)
    torch.testing.assert_close(lazy.teacher_mass(4096), eager.teacher_mass(4096).double())
    # shards of another feature width cannot train one draft
    sparse_targets(target, [[5, 6, 7, 8]], [1], k=8, features=True).save(str(tmp_path / "d1" / "teacher_9.safetensors"))
    with pytest.raises(ValueError, match="width"):
        open_teacher_store([str(tmp_path / "d0"), str(tmp_path / "d1")])


def test_training_keeps_the_best_held_out_weights_and_resumes_them(tmp_path, target):
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (30, 41, 22, 35)]
    store = sparse_targets(target, seqs, [3] * 4, k=8, features=True, hidden_layers=LAYERS)
    vocab = build_reduced_vocab(token_counts(store.token_ids, 4096), 1024, always=[0])
    t32 = target.float()
    try:
        d = init_draft(t32, "feature", [5], vocab, feature_layers=LAYERS)
        start = {k: v.clone() for k, v in d.state_dict().items()}
        wrong = init_draft(t32, "feature", [5], vocab)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    with pytest.raises(ValueError, match="wide"):
        train_draft(wrong, store, vocab, TrainConfig(steps=1), None, log=lambda *_: None)
    scores = iter([2.0, 1.5, 1.2, 1.1, 1.0])  # held-out tau only falls: the start stays the best
    seen = []

    def evaluate(draft):
        seen.append(draft.training)
        return {"tau": next(scores)}

    cfg = TrainConfig(steps=4, batch_tokens=96, warmup=1, lr=1e-2, chain_steps=2, eval_every=2)
    ck = str(tmp_path / "ck.pt")
    s1 = train_draft(d, store, vocab, cfg, ck, log=lambda *_: None, stop_at=2, evaluate=evaluate)
    assert s1["best"]["step"] == 0 and s1["positions_trained"] > 0
    s2 = train_draft(d, store, vocab, cfg, ck, log=lambda *_: None, evaluate=evaluate)
    assert s2["steps"] == 4 and s2["best"]["step"] == 0 and seen == [False] * len(seen)
    assert [h["step"] for h in s2["history"] if "heldout" in h] == [0, 2, 4]
    assert s2["positions_trained"] > s1["positions_trained"]
    for k, v in d.state_dict().items():
        assert torch.equal(v, start[k]), k  # the final weights scored worse: the start is kept


def test_text_store_teacher_forces_source_text_in_resumable_shards(tmp_path, target, monkeypatch):
    from specrt.models import load_tokenizer
    from specrt.training import sources
    from specrt.training.teacher import text_store
    texts = {"a": ["def f(x):\n    return x + 1\n" * 30, "short text here"], "b": ["class A:\n    pass\n" * 50]}
    monkeypatch.setattr(sources, "source_texts", lambda name, split: texts[name])
    tok = load_tokenizer(os.path.join(BUILTIN, "target"))
    out = str(tmp_path / "text")
    text_store(target, tok, out, ["a", "b"], "train", max_len=64, k=8, hidden_layers=LAYERS,
               shard_positions=200, log=lambda *_: None)
    store = open_teacher_store([out])
    want = []
    for t in texts["a"] + texts["b"]:
        ids = tok.encode(t)
        want += [ids[i:i + 64] for i in range(0, len(ids), 64) if len(ids[i:i + 64]) > 1]
    assert store.num_sequences == len(want) and len(store.shards) > 1
    assert sorted(tuple(store.sequence_rows(s)[0].tolist()) for s in range(store.num_sequences)) == \
        sorted(tuple(w) for w in want)
    assert store.feature_width == 768 and int(store.prompt_lens.max()) == 1  # every position is trained
    first = os.path.getmtime(os.path.join(out, "teacher_00000.safetensors"))
    text_store(target, tok, out, ["a", "b"], "train", max_len=64, k=8, hidden_layers=LAYERS,
               shard_positions=200, log=lambda *_: None)
    assert os.path.getmtime(os.path.join(out, "teacher_00000.safetensors")) == first  # resumed: nothing redone


def test_warm_start_grows_a_single_feature_draft_into_a_deeper_eagle3_one(tmp_path, target, vocab):
    from specrt.training.draft_distill import warm_start
    t32 = target.float()
    try:
        src = init_draft(t32, "feature", [5], vocab, fc_init="sum")
        deep = init_draft(t32, "feature", [5, 4], vocab, fc_init="sum", feature_layers=LAYERS)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)
    src.save_pretrained(tmp_path / "src", dtype=torch.float32)
    warm_start(deep, str(tmp_path / "src"), log=lambda *_: None)
    g = torch.Generator().manual_seed(2)
    ids, feats = torch.randint(3, 4000, (2, 7), generator=g), torch.randn(2, 7, 768, generator=g)
    a, _ = src.forward_dense(ids, feats[..., 512:])
    b, _ = deep.forward_dense(ids, feats)  # the added layer is the identity, the fuse a pass-through
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot start"):
        warm_start(src, _saved(deep, tmp_path / "deep"), log=lambda *_: None)  # 2 layers cannot start 1


def _saved(draft, folder):
    draft.save_pretrained(folder, dtype=torch.float32)
    return str(folder)


def test_resuming_with_another_vocabulary_is_refused(tmp_path, target):
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (30, 41)]
    store = sparse_targets(target, seqs, [3, 3], k=8, features=True)
    a = build_reduced_vocab(token_counts(store.token_ids, 4096), 1024, always=[0])
    b = build_reduced_vocab(torch.arange(4096), 1024, always=[0])  # another data set's ids
    t32 = target.float()
    try:
        d = init_draft(t32, "feature", [5], a)
        e = init_draft(t32, "feature", [5], b)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    ck = str(tmp_path / "ck.pt")
    cfg = TrainConfig(steps=2, batch_tokens=96, warmup=1)
    train_draft(d, store, a, cfg, ck, log=lambda *_: None, stop_at=1)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train_draft(e, store, b, cfg, ck, log=lambda *_: None)


def test_prompt_logprobs_with_an_eagle3_draft_are_chunked_and_equal_the_plain_ones(tmp_path, target, vocab,
                                                                                    monkeypatch):
    """The verify forward returns fused layer features for an EAGLE-3 draft; the final-normed state is
    one block of them, so prompt log-probabilities still come PROMPT_LOGPROB_ROWS rows at a time
    (before: the whole [T, V] logits from the forward) and equal plain decoding's."""
    import specrt
    import specrt.sampling.logprobs as logprobs
    t32 = target.float()
    try:
        d = init_draft(t32, "feature", [5], vocab, feature_layers=LAYERS)
    finally:
        target.to(torch.bfloat16)
        target._prepared = False
    d.save_pretrained(tmp_path / "e3")
    (tmp_path / "e3" / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    monkeypatch.setattr(logprobs, "PROMPT_LOGPROB_ROWS", 8)
    chunks = []
    real = logprobs.PromptRows.logits
    monkeypatch.setattr(logprobs.PromptRows, "logits", lambda self, a, e: chunks.append(e - a) or real(self, a, e))
    prompt = [5, 17, 300, 41, 9, 9, 1200, 7] * 5
    params = specrt.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3)
    spec = specrt.SpecConfig(max_model_len=256, max_batch_size=4)
    plain = specrt.LLM(target="builtin", spec=spec).generate([prompt], params)[0]
    assert chunks and max(chunks) <= 8
    chunks.clear()
    out = specrt.LLM(target="builtin", draft=str(tmp_path / "e3"), spec=spec).generate([prompt], params)[0]
    assert sum(chunks) == len(prompt) - 1 and max(chunks) <= 8
    def rows(o):
        return [None if p is None else (p.token_id, p.logprob, p.top) for p in o.prompt_logprobs]
    assert rows(out) == rows(plain) and rows(out)[1] is not None
