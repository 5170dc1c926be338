"""The reduced-vocabulary draft pipeline (specrt distill): prompts, sparse teacher store,
vocabulary map, DraftModel forward against a naive reference, chain training, resume,
and an end-to-end run on the built-in target (seconds)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from specrt.models.draft_model import DraftModel
from specrt.training import prompts as P
from specrt.training.draft_train import (TrainConfig, chain_states, collate, init_draft, sparse_kl,
                                         train_draft)
from specrt.training.teacher import TeacherShard, generate_and_record, load_teacher, sparse_targets
from specrt.training.vocab import ReducedVocab, build_reduced_vocab, token_counts

BUILTIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specrt", "builtin")
needs_builtin = pytest.mark.skipif(not os.path.exists(os.path.join(BUILTIN, "target", "model.safetensors")),
                                   reason="specrt/builtin not exported")


@pytest.fixture(scope="module")
def target():
    from specrt.models import load_model
    return load_model(os.path.join(BUILTIN, "target"))


@pytest.fixture(scope="module")
def store(target):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (37, 52, 29, 45)]
    return sparse_targets(target, seqs, [4, 6, 1, 9], k=16, features=True)


@pytest.fixture(scope="module")
def vocab(store):
    return build_reduced_vocab(token_counts(store.token_ids, 4096), 1024, always=[0])


# ----------------------------------------------------------------------------- prompts
def test_heldout_prompts_use_no_training_filler():
    train = P.build_prompts("train", 1500)
    held = P.build_prompts("heldout", 120)
    assert not set(train) & set(held)
    assert len(set(held)) == 120 and {p.kind for p in held} >= {"chat", "code"}
    held_tasks = P._half(P.CODE_TASKS, True)
    for p in train:
        assert not any(t in p.text for t in held_tasks), p.text
    assert P.build_prompts("heldout", 120) == held  # deterministic
    with pytest.raises(ValueError, match="split"):
        P.build_prompts("test", 3)


# ----------------------------------------------------------------------------- teacher store
@needs_builtin
def test_sparse_targets_are_the_full_distributions_top_k(target, store):
    from specrt.training.teacher import target_outputs
    seq = store.token_ids[store.sequence(1)].tolist()
    logits, hidden = target_outputs(target, [seq])
    lp = torch.log_softmax(logits, -1)
    rows = store.sequence(1)
    top = lp.topk(16, -1)
    assert torch.equal(store.topk_ids[rows].long(), top.indices)
    torch.testing.assert_close(store.topk_logprobs[rows].float(), top.values, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(store.features[rows].float(), hidden, atol=2e-2, rtol=1e-2)


@needs_builtin
def test_teacher_store_roundtrips(tmp_path, store):
    store.save(str(tmp_path / "teacher_00000.safetensors"))
    half = TeacherShard(store.token_ids[:37], store.offsets[:2], store.prompt_lens[:1], store.topk_ids[:37],
                        store.topk_logprobs[:37], store.features[:37])
    half.save(str(tmp_path / "teacher_00001.safetensors"))
    back = load_teacher(str(tmp_path))
    n = store.token_ids.numel()
    assert back.num_sequences == 5 and back.offsets.tolist()[-2:] == [n, n + 37]
    for name in ("token_ids", "prompt_lens", "topk_ids", "topk_logprobs", "features"):
        a, b = getattr(back, name), getattr(store, name)
        assert a.dtype == b.dtype and torch.equal(a[:b.shape[0]], b), name
    with pytest.raises(ValueError, match="offsets"):
        TeacherShard(store.token_ids, store.offsets[:-1], store.prompt_lens, store.topk_ids, store.topk_logprobs)


@needs_builtin
def test_on_policy_greedy_data_equals_the_engines_greedy_output(target):
    import specrt
    prompts = [[5, 17, 300, 41], [9, 9, 1200], [77] * 6]
    st = generate_and_record(target, prompts, [0.0] * 3, 12, k=8, eos_ids=[], features=False)
    llm = specrt.LLM(target="builtin", spec=specrt.SpecConfig(max_model_len=256, max_batch_size=4))
    outs = llm.generate(prompts, specrt.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for s, (p, o) in enumerate(zip(prompts, outs)):
        stored = st.token_ids[st.sequence(s)].tolist()
        assert stored == (p + o.token_ids)[:-1]  # the final token has no teacher row
        assert st.topk_ids[st.sequence(s)][len(p) - 1:, 0].tolist() == o.token_ids  # argmax rows


# ----------------------------------------------------------------------------- vocabulary
def test_reduced_vocab_map_is_consistent():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    v = build_reduced_vocab(counts, 4, always=[6])
    assert v.draft_to_target.tolist() == [2, 3, 5, 6]  # counts 9, 9, 7; the forced 6 replaces 0 (count 5)
    assert torch.equal(v.target_to_draft[v.draft_to_target], torch.arange(4))
    assert (v.target_to_draft >= 0).sum() == 4
    assert v.coverage(torch.tensor([0, 2, 5, 6])) == 0.75
    w = build_reduced_vocab(counts, 3)
    assert w.draft_to_target.tolist() == [2, 3, 5]  # ties broken toward the lower id
    with pytest.raises(ValueError, match="ascending"):
        ReducedVocab.from_map(torch.tensor([3, 1]), 8)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        ReducedVocab.from_map(torch.tensor([1, 8]), 8)
    with pytest.raises(ValueError, match="size"):
        build_reduced_vocab(counts, 0)


@needs_builtin
def test_expand_probs_puts_draft_mass_on_mapped_ids_only(target, vocab):
    d = init_draft(target, "feature", [5], vocab)
    q = torch.softmax(torch.randn(3, vocab.size), -1)
    full = d.expand_probs(q)
    assert full.shape == (3, 4096)
    torch.testing.assert_close(full.sum(-1), torch.ones(3))
    assert torch.equal(full[:, vocab.draft_to_target], q)
    off = torch.ones(4096, dtype=torch.bool)
    off[vocab.draft_to_target] = False
    assert torch.count_nonzero(full[:, off]) == 0
    assert torch.equal(d.to_target_ids(torch.tensor([0, 5])), vocab.draft_to_target[[0, 5]])


# ----------------------------------------------------------------------------- model forward
def _naive_layer(layer, x, positions, theta, eps):
    """Token-by-token Llama layer over a whole sequence x [T, H] (independent of specrt's code)."""
    a, m = layer.self_attn, layer.mlp
    H, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim

    def norm(v, w):
        return w * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)

    def rope(v, p):  # v [heads, D]
        inv = 1.0 / theta ** (torch.arange(0, D, 2).double() / D)
        ang = torch.cat([p * inv, p * inv]).float()
        rot = torch.cat([-v[:, D // 2:], v[:, :D // 2]], -1)
        return v * ang.cos() + rot * ang.sin()

    h = norm(x, layer.input_layernorm.weight)
    q = [rope((h[t] @ a.q_proj.weight.T).view(H, D), positions[t]) for t in range(len(x))]
    k = [rope((h[t] @ a.k_proj.weight.T).view(Hkv, D), positions[t]) for t in range(len(x))]
    v = [(h[t] @ a.v_proj.weight.T).view(Hkv, D) for t in range(len(x))]
    out = []
    for t in range(len(x)):
        heads = []
        for i in range(H):
            j = i // (H // Hkv)
            s = torch.stack([q[t][i] @ k[u][j] for u in range(t + 1)]) / math.sqrt(D)
            w = torch.softmax(s, 0)
            heads.append(sum(w[u] * v[u][j] for u in range(t + 1)))
        y = x[t] + torch.cat(heads) @ a.o_proj.weight.T
        h2 = norm(y, layer.post_attention_layernorm.weight)
        out.append(y + (torch.nn.functional.silu(h2 @ m.gate_proj.weight.T) * (h2 @ m.up_proj.weight.T))
                   @ m.down_proj.weight.T)
    return torch.stack(out)


@needs_builtin
@pytest.mark.parametrize("kind", ["feature", "layers"])
def test_draft_forward_matches_a_naive_reference(target, store, vocab, kind):
    from specrt.models.kv_cache import AttentionMetadata, allocate_kv_cache
    d = init_draft(target, kind, [5] if kind == "feature" else [0, 5], vocab)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # not just copies of the target
    rows = store.sequence(0)
    ids = store.token_ids[rows].long()
    T = ids.numel()
    feats = torch.zeros(T, 256)
    feats[1:] = store.features[rows][:-1].float()
    f = feats if kind == "feature" else None
    # naive
    with torch.no_grad():
        x = d.embed[ids]
        if kind == "feature":
            x = torch.cat([x, feats], -1) @ d.fc.weight.T
        cfg = d.config.layer_config
        for layer in d.layers:
            x = _naive_layer(layer, x, torch.arange(T), cfg.rope_theta, cfg.rms_norm_eps)
        h_ref = d.norm.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        ref = h_ref @ d.head.T
        dense, h_dense = d.forward_dense(ids[None], None if f is None else f[None])
    torch.testing.assert_close(dense[0], ref, atol=1e-4, rtol=1e-4)
    # paged: two requests, a chunked prefill then one-token steps, mixed in one batch
    cache = allocate_kv_cache(cfg, 16, 4, torch.float32, "cpu")
    tables = [list(range(0, 10)), list(range(10, 16))]
    other = torch.randint(3, 4096, (20,))
    of = torch.randn(20, 256)
    got = []
    cuts = [(0, 20, 0, 12), (20, 21, 12, 13), (21, 22, 13, 14), (22, T, 14, 20)]
    for a, b, c, e in cuts:
        meta = AttentionMetadata.build([b, e], [b - a, e - c], tables, 4)
        x_ids = torch.cat([ids[a:b], other[c:e]])
        pos = torch.cat([torch.arange(a, b), torch.arange(c, e)])
        ff = None if f is None else torch.cat([f[a:b], of[c:e]])
        logits, h = d(x_ids, pos, meta, cache, features=ff)
        got.append(logits[: b - a])
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=1e-4)


@needs_builtin
def test_chain_training_equals_sequential_drafting(target, store, vocab):
    """Step j of chain_states at position p == the paged draft catching up with true features
    to the chain's start p-j and then feeding its own features j times."""
    from specrt.models.kv_cache import AttentionMetadata, allocate_kv_cache
    d = init_draft(target, "feature", [5], vocab)
    b = collate(store, [1], True)
    with torch.no_grad():
        states = chain_states(d, b.input_ids, b.features, 3)
    ids, feats = b.input_ids[0], b.features[0]
    for s in (0, 7, 30):
        cache = allocate_kv_cache(d.lm_config, 16, 4, torch.float32, "cpu")
        table = [list(range(16))]
        meta = AttentionMetadata.build([s + 1], [s + 1], table, 4)
        _, h = d(ids[:s + 1], torch.arange(s + 1), meta, cache, features=feats[:s + 1])
        own = h[-1:]
        torch.testing.assert_close(own[0], states[0][0, s], atol=1e-4, rtol=1e-4)
        for j in (1, 2):
            p = s + j
            meta = AttentionMetadata.build([p + 1], [1], table, 4)
            _, own = d(ids[p:p + 1], torch.tensor([p]), meta, cache, features=own)
            torch.testing.assert_close(own[0], states[j][0, p], atol=1e-4, rtol=1e-4)


def test_sparse_kl_is_the_exact_kl_when_nothing_is_truncated():
    g = torch.Generator().manual_seed(1)
    V = 12
    t_logits, d_logits = torch.randn(5, V, generator=g), torch.randn(5, V, generator=g)
    lp = torch.log_softmax(t_logits, -1)
    top = lp.topk(V, -1)
    full = ReducedVocab.from_map(torch.arange(V), V)
    exact = (lp.exp() * (lp - torch.log_softmax(d_logits, -1))).sum(-1)
    torch.testing.assert_close(sparse_kl(d_logits, top.indices, top.values, full.target_to_draft), exact,
                               atol=1e-5, rtol=1e-4)
    # truncated to the top 4 and reduced to 7 ids: still >= 0
    red = ReducedVocab.from_map(torch.tensor([0, 2, 3, 5, 7, 8, 11]), V)
    top4 = lp.topk(4, -1)
    kl = sparse_kl(d_logits[:, red.draft_to_target], top4.indices, top4.values, red.target_to_draft)
    assert (kl >= -1e-6).all() and (kl > 1e-3).any()
    # truncated only: zero when the draft is the teacher
    same = sparse_kl(t_logits, top4.indices, top4.values, full.target_to_draft)
    torch.testing.assert_close(same, torch.zeros(5), atol=2e-6, rtol=0)


def test_sparse_kl_top1_term_is_the_argmax_cross_entropy_where_covered():
    g = torch.Generator().manual_seed(2)
    V = 12
    t_logits, d_logits = torch.randn(6, V, generator=g), torch.randn(6, V, generator=g)
    lp = torch.log_softmax(t_logits, -1)
    top4 = lp.topk(4, -1)
    red = ReducedVocab.from_map(torch.tensor([0, 2, 3, 5, 7, 8, 11]), V)
    dl = d_logits[:, red.draft_to_target]
    base = sparse_kl(dl, top4.indices, top4.values, red.target_to_draft)
    with_top1 = sparse_kl(dl, top4.indices, top4.values, red.target_to_draft, top1_weight=0.5)
    d = red.target_to_draft[top4.indices[:, 0]]
    ce = torch.where(d >= 0, -torch.log_softmax(dl, -1).gather(1, d.clamp(min=0)[:, None])[:, 0], torch.zeros(6))
    assert (d < 0).any() and (d >= 0).any(), "the rows cover both cases"
    torch.testing.assert_close(with_top1, base + 0.5 * ce, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- training
@needs_builtin
def test_resuming_from_a_checkpoint_continues_identically(tmp_path, target, store, vocab):
    cfg = TrainConfig(steps=4, batch_tokens=96, warmup=1, lr=1e-3, chain_steps=2)
    a = init_draft(target, "feature", [5], vocab)
    train_draft(a, store, vocab, cfg, None, log=lambda *_: None)
    b = init_draft(target, "feature", [5], vocab)
    ck = str(tmp_path / "ck.pt")
    train_draft(b, store, vocab, cfg, ck, log=lambda *_: None, stop_at=2)
    c = init_draft(target, "feature", [5], vocab)
    summary = train_draft(c, store, vocab, cfg, ck, log=lambda *_: None)
    assert summary["steps"] == 4
    for (name, pa), pc in zip(a.state_dict().items(), c.state_dict().values()):
        assert torch.equal(pa, pc), name
    assert not torch.equal(a.fc.weight, init_draft(target, "feature", [5], vocab).fc.weight)


@needs_builtin
@pytest.mark.parametrize("arch,layers", [("feature", "auto"), ("layers", "0,5")])
def test_distill_end_to_end_on_the_builtin_target(tmp_path, target, arch, layers):
    from specrt.training.distill import main
    out = tmp_path / "draft"
    rc = main(["--target", "builtin", "--out", str(out), "--arch", arch, "--layers", layers,
               "--num-prompts", "6", "--gen-batch", "6", "--max-new-tokens", "8", "--heldout-prompts", "3",
               "--steps", "2", "--batch-tokens", "128", "--vocab", "512", "--threads", "1"])
    assert rc == 0
    d = DraftModel.from_pretrained(out, target)
    assert d.config.kind == arch and d.config.draft_vocab_size == 512
    assert d.draft_to_target.shape == (512,) and 0 in d.draft_to_target.tolist()  # EOS always covered
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 0 and gen["bos_token_id"] == 0
    summary = json.loads((out / "distill_summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["heldout"]["acceptance_per_position"]) == 4
    files = sorted(os.listdir(out))
    assert files == ["config.json", "distill_summary.json", "generation_config.json", "model.safetensors"]
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "embed" in k]  # embeddings come from the target


@needs_builtin
def test_draft_folder_errors_name_the_problem(tmp_path, target):
    with pytest.raises(ValueError, match="config.json"):
        DraftModel.from_pretrained(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not a specrt draft"):
        DraftModel.from_pretrained(tmp_path, target)


@needs_builtin
def test_corpus_files_become_sequences(tmp_path):
    from specrt.models import load_tokenizer
    from specrt.training.onpolicy import corpus_sequences
    tok = load_tokenizer(os.path.join(BUILTIN, "target"))
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "import os\nprint(os.getcwd())\n"}) + "\n\n")
    s = corpus_sequences([str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl")], tok, max_len=32)
    assert all(2 <= len(t) <= 32 for t in s.token_ids) and s.prompt_lens == [1] * len(s.token_ids)
    assert tok.decode(s.token_ids[-1]) == "import os\nprint(os.getcwd())\n"
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: expected an object with a 'text'"):
        corpus_sequences([str(tmp_path / "c.jsonl")], tok, 32)
    with pytest.raises(ValueError, match="no such file"):
        corpus_sequences([str(tmp_path / "missing.txt")], tok, 32)


SMOLLM2_DRAFT = os.path.join(BUILTIN, "smollm2-draft")


@pytest.mark.skipif(not os.path.exists(os.path.join(SMOLLM2_DRAFT, "model.safetensors")),
                    reason="specrt/builtin/smollm2-draft not shipped")
def test_shipped_smollm2_draft_is_small_and_consistent():
    """The packaged SmolLM2 draft: its own weights only (the target's embeddings are bound at
    load time), an ascending id map that covers the end-of-turn token, the target's special ids."""
    size = sum(os.path.getsize(os.path.join(SMOLLM2_DRAFT, f)) for f in os.listdir(SMOLLM2_DRAFT))
    assert size < 16e6
    embed = torch.randn(49152, 576) * 0.05  # stands in for SmolLM2's embedding table
    d = DraftModel.from_pretrained(SMOLLM2_DRAFT, embed)
    v = ReducedVocab.from_map(d.draft_to_target, 49152)  # validates: ascending, in range
    assert 2 in v.draft_to_target.tolist() and d.config.target_vocab_size == 49152
    assert torch.equal(d.head, embed[d.draft_to_target])
    gen = json.loads(open(os.path.join(SMOLLM2_DRAFT, "generation_config.json")).read())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    ids = torch.tensor([[1, 9690, 198, 2683]])
    feats = torch.randn(1, 4, 576) if d.config.kind == "feature" else None
    logits, h = d.forward_dense(ids, feats)
    assert logits.shape == (1, 4, d.config.draft_vocab_size) and torch.isfinite(logits).all()


@needs_builtin
def test_warm_start_copies_a_drafts_layers_and_refuses_another_kind(tmp_path, target, vocab):
    from specrt.training.draft_distill import warm_start
    src = init_draft(target, "feature", [5], vocab)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)  # differs from a fresh init
    src.save_pretrained(tmp_path / "src", dtype=torch.float32)
    other = build_reduced_vocab(token_counts(torch.arange(4096), 4096), 512, always=[0])
    fresh = init_draft(target, "feature", [5], other)   # another vocabulary: only the head differs
    warm_start(fresh, str(tmp_path / "src"), log=lambda *_: None)
    for name, p in src.state_dict().items():
        if name != "draft_to_target":
            assert torch.equal(fresh.state_dict()[name], p), name
    assert fresh.draft_to_target.shape == (512,)
    with pytest.raises(ValueError, match="cannot start a layers draft"):
        warm_start(init_draft(target, "layers", [0, 5], vocab), str(tmp_path / "src"))


def test_draft_depth_defaults():
    from argparse import Namespace

    from specrt.training.draft_distill import draft_depth
    assert draft_depth(Namespace(num_layers=None, init_from=None, arch="feature")) == 1
    assert draft_depth(Namespace(num_layers=None, init_from=None, arch="layers")) == 2
    assert draft_depth(Namespace(num_layers=3, init_from=None, arch="feature")) == 3
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specrt", "builtin",
                           "smollm2-draft")
    assert draft_depth(Namespace(num_layers=None, init_from=shipped, arch="feature")) == 1


@needs_builtin
def test_vocab_init_continues_a_draft_with_its_head_unchanged(tmp_path, target, vocab):
    """--vocab init keeps --init-from's vocabulary (a continuation on other data must not move the
    head); without --init-from it is an error naming the flag."""
    from specrt.training.distill import main
    src = init_draft(target, "feature", [5], vocab)
    src.save_pretrained(tmp_path / "src", dtype=torch.float32)
    out = tmp_path / "draft"
    args = ["--target", "builtin", "--out", str(out), "--arch", "feature", "--num-prompts", "4",
            "--gen-batch", "4", "--max-new-tokens", "8", "--heldout-prompts", "0", "--steps", "1",
            "--batch-tokens", "128", "--vocab", "init", "--threads", "1"]
    assert main(args + ["--init-from", str(tmp_path / "src")]) == 0
    d = DraftModel.from_pretrained(out, target)
    assert torch.equal(d.draft_to_target, src.draft_to_target)
    assert len(d.layers) == len(src.layers) == 1, "without --num-layers the depth follows --init-from"
    with pytest.raises(ValueError, match="--init-from"):
        main(args + ["--work", str(tmp_path / "w2")])
