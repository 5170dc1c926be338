"""Llama-family runtime vs transformers on tiny random checkpoints, through the paged KV cache."""
from __future__ import annotations

import json
import os

import pytest
import torch

from _model_utils import VOCAB, Runner, hf_logits, make_checkpoint  # transformers-based tests skip without it

from specrt.models.attention import AttentionMetadata
from specrt.models.kv_cache import PagedKVCache
from specrt.models import (
    ModelConfig,
    check_draft_compatible,
    check_dtype_supported,
    check_prompt_length,
    load_generation_config,
    load_model,
    load_tokenizer,
)

torch.set_num_threads(1)
TOL = 1e-4
KINDS = ["llama", "llama3", "linear", "qwen2", "mistral", "mistral_sw"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """kind -> (folder, hf model, specrt model); built lazily, once per module."""
    made = {}

    def get(kind):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            hf = make_checkpoint(folder, kind, seed=len(made))
            made[kind] = (folder, hf, load_model(folder))
        return made[kind]

    return get


def prompt_of(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def maxdiff(a, b):
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_paged_decode_match_transformers(ckpt, kind):
    _, hf, model = ckpt(kind)
    prompt = prompt_of(29, seed=1)
    ref = hf_logits(hf, prompt)  # [29, V]
    ours = Runner(model, block_size=4).prefill("a", prompt)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert maxdiff(ours, ref) < TOL

    # incremental decode: prefill 5, then one token at a time across 6 block boundaries (block_size 4)
    r = Runner(model, block_size=4)
    rows = [r.prefill("b", prompt[:5])[-1]]
    for t in prompt[5:-1]:
        rows.append(r.decode("b", [t])[-1])
    assert maxdiff(torch.stack(rows), ref[4:-1]) < TOL
    assert len(r.cache.block_table("b")) == 7


def test_sharded_checkpoint(tmp_path):
    hf = make_checkpoint(tmp_path, "llama", seed=7, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = load_model(tmp_path)
    prompt = prompt_of(17, seed=3)
    assert maxdiff(Runner(model).prefill("a", prompt), hf_logits(hf, prompt)) < TOL


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral_sw", "dynamic"])
def test_greedy_64_tokens_identical_to_generate(ckpt, kind):
    _, hf, model = ckpt(kind)
    prompt = prompt_of(21, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
                          eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    assert len(expected) == 64
    assert Runner(model, num_blocks=32, block_size=4).greedy(prompt, 64) == expected


def test_mixed_batch_equals_separate_runs(ckpt):
    _, hf, model = ckpt("qwen2")
    pa, pb, pc, pd = prompt_of(13, 10), prompt_of(9, 11), prompt_of(11, 12), prompt_of(80, 13)
    verify = prompt_of(4, 14)  # K+1 = 4 positions

    # separately
    sep = {}
    r = Runner(model, num_blocks=128)
    sep["a"] = r.prefill("a", pa)
    r.prefill("b", pb)
    sep["b"] = r.decode("b", [7])
    r.prefill("c", pc)
    sep["c"] = r.decode("c", verify)
    r.prefill("d", pd[:6])  # then an 74-token chunk with earlier context (the "long" attention path)
    sep["d"] = r.decode("d", pd[6:])
    r.prefill("e", [5])  # one-token prompt
    sep["e"] = r.decode("e", [9])
    r.prefill("f", pd[:3])  # a 10-token chunk with earlier context: padded into the batch
    sep["f"] = r.decode("f", pd[3:13])

    # one forward over all of them
    r2 = Runner(model, num_blocks=128)
    c = r2.cache
    for rid, p in (("b", pb), ("c", pc), ("d", pd[:6]), ("e", [5]), ("f", pd[:3])):
        r2.prefill(rid, p)
    assert c.allocate("a", pa) == 0
    for rid, n in (("b", 1), ("c", 4), ("d", 74), ("e", 1), ("f", 10)):
        assert c.append_slots(rid, n)
    items = [("b", [7]), ("a", pa), ("c", verify), ("d", pd[6:]), ("e", [9]), ("f", pd[3:13])]
    got = dict(zip([i[0] for i in items], r2.step(items)))
    for rid in sep:
        assert maxdiff(got[rid], sep[rid]) < 1e-5, rid

    assert maxdiff(got["a"], hf_logits(hf, pa)) < TOL
    assert maxdiff(got["c"], hf_logits(hf, pc + verify)[-4:]) < TOL
    assert maxdiff(got["d"], hf_logits(hf, pd)[6:]) < TOL
    assert maxdiff(got["f"], hf_logits(hf, pd[:13])[3:]) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(ckpt):
    folder, hf, _ = ckpt("qwen2")
    model = load_model(folder, device="cuda")
    cache = PagedKVCache({"t": model.config}, num_blocks=64, block_size=4, device="cuda")
    prompts = [prompt_of(13, 95), prompt_of(5, 96)]
    for i, p in enumerate(prompts):
        cache.allocate(i, p)
    meta = cache.metadata([0, 1], [13, 5])
    ids = torch.tensor(prompts[0] + prompts[1], device="cuda")
    pos = torch.tensor(list(range(13)) + list(range(5)), device="cuda")
    logits, _ = model(ids, pos, meta, cache["t"])
    assert maxdiff(logits[:13].cpu(), hf_logits(hf, prompts[0])) < 1e-3
    assert cache.append_slots(1, 3)
    meta = cache.metadata([1], [3])
    logits, _ = model(torch.tensor([7, 8, 9], device="cuda"), torch.arange(5, 8, device="cuda"), meta, cache["t"])
    assert maxdiff(logits.cpu(), hf_logits(hf, prompts[1] + [7, 8, 9])[5:]) < 1e-3


def test_decode_batch_of_many_requests(ckpt):
    _, hf, model = ckpt("llama")
    r = Runner(model, num_blocks=256)
    prompts = [prompt_of(3 + 2 * i, 40 + i) for i in range(8)]
    for i, p in enumerate(prompts):
        r.prefill(i, p)
        assert r.cache.append_slots(i, 1)
    got = r.step([(i, [11]) for i in range(8)])
    for i, p in enumerate(prompts):
        assert maxdiff(got[i][0], hf_logits(hf, p + [11])[-1]) < TOL


def test_torch_fallback_kv_ops_match(ckpt, monkeypatch):
    """The pure-torch reference write_kv/copy_blocks (specrt.ops.reference) give the same logits as the kernels."""
    import specrt.models.kv_cache as kvc
    import specrt.models.llama as llama
    from specrt.ops import reference

    _, hf, model = ckpt("qwen2")
    prompt = prompt_of(9, 90)
    runs = []
    for write, copy in ((llama.write_kv, kvc.copy_blocks), (reference.write_kv, reference.copy_blocks)):
        monkeypatch.setattr(llama, "write_kv", write)
        monkeypatch.setattr(kvc, "copy_blocks", copy)
        r = Runner(model)
        r.prefill("p", prompt[:6])
        r.cache.fork("p", "c")
        runs.append(torch.cat([r.decode("c", prompt[6:]), r.decode("p", [3])]))
    assert torch.equal(runs[0], runs[1])
    assert maxdiff(runs[1][:3], hf_logits(hf, prompt)[6:]) < TOL


def test_padding_rows_are_ignored(ckpt):
    """Rows beyond the metadata's tokens (slot -1, e.g. a padded batch) write nothing and change nothing."""
    import dataclasses

    _, hf, model = ckpt("llama")
    r = Runner(model)
    for rid, p in ((0, prompt_of(5, 1)), (1, prompt_of(7, 2))):
        r.prefill(rid, p)
        assert r.cache.append_slots(rid, 1)
    meta = r.cache.metadata([0, 1], [1, 1])
    kv_before = r.kv.clone()
    meta = dataclasses.replace(meta, slot_mapping=torch.cat([meta.slot_mapping, torch.tensor([-1, -1])]))
    ids, pos = torch.tensor([9, 10, 0, 0]), torch.tensor([5, 7, 0, 0])
    logits, _ = model(ids, pos, meta, r.kv)
    assert logits.shape[0] == 4
    assert maxdiff(logits[0], hf_logits(hf, prompt_of(5, 1) + [9])[-1]) < TOL
    assert maxdiff(logits[1], hf_logits(hf, prompt_of(7, 2) + [10])[-1]) < TOL
    L, _, nb, bs = r.kv.shape[:4]
    changed = (r.kv != kv_before).view(L, 2, nb * bs, -1).any(-1).any(0).any(0)  # [slots]
    assert changed.nonzero().flatten().tolist() == sorted(meta.slot_mapping[:2].tolist())


def test_verify_k_plus_1_equals_single_steps(ckpt):
    _, _, model = ckpt("mistral")
    prompt, drafts = prompt_of(10, 20), prompt_of(5, 21)  # K+1 = 5 positions
    r1 = Runner(model)
    r1.prefill("v", prompt)
    verify = r1.decode("v", drafts)  # [5, V]
    r2 = Runner(model)
    r2.prefill("s", prompt)
    single = torch.stack([r2.decode("s", [t])[0] for t in drafts])
    assert maxdiff(verify, single) < 1e-5


def test_logits_indices_and_hidden(ckpt, tmp_path):
    folder, hf, model = ckpt("llama")
    prompt = prompt_of(12, 30)
    r = Runner(model)
    r.cache.allocate("a", prompt)
    meta = r.cache.metadata(["a"], [12])
    idx = torch.tensor([3, 11])
    logits, hidden = model(torch.tensor(prompt), torch.arange(12), meta, r.kv, logits_indices=idx, return_hidden=True)
    with torch.no_grad():
        hf_hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
    assert logits.shape == (2, VOCAB) and hidden.shape == (2, 64)
    assert maxdiff(logits, hf_logits(hf, prompt)[idx]) < TOL
    assert maxdiff(hidden, hf_hidden[idx]) < TOL


def test_first_n_layers_self_speculative(ckpt):
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM

    folder, hf, model = ckpt("llama3")
    hf2 = AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=2).eval()  # same weights, 2 layers
    prompt = prompt_of(15, 31)
    r = Runner(model)
    r.cache.allocate("a", prompt[:10])
    draft = r.step([("a", prompt[:10])], num_layers=2)[0]
    full = r.step([("a", prompt[:10])])[0]  # rewrites the same slots (layers 0-1 identically)
    assert maxdiff(draft, hf_logits(hf2, prompt[:10])) < TOL
    assert maxdiff(full, hf_logits(hf, prompt[:10])) < TOL
    # draft decode reuses layers 0..1 of the same cache
    assert r.cache.append_slots("a", 5)
    d = r.step([("a", prompt[10:])], num_layers=2)[0]
    assert maxdiff(d, hf_logits(hf2, prompt)[10:]) < TOL
    with pytest.raises(ValueError, match="num_layers"):
        r.step([("a", prompt[10:])], num_layers=4)


# ----------------------------------------------------------------------------- rollback / fork / prefix
def test_rollback_equals_never_written(ckpt):
    _, _, model = ckpt("qwen2")
    prompt, drafts = prompt_of(6, 50), prompt_of(5, 51)  # write K+1 = 5 positions (6..10)
    r = Runner(model, num_blocks=16, block_size=4)
    r.prefill("a", prompt)
    r.decode("a", drafts)
    assert len(r.cache.block_table("a")) == 3
    free_before = r.cache.num_free_blocks
    r.cache.rollback("a", 4)  # keep drafts[0] only: 7 tokens -> blocks for 0..6
    assert r.cache.num_tokens("a") == 7 and len(r.cache.block_table("a")) == 2
    assert r.cache.num_free_blocks == free_before + 1
    cont = r.decode("a", [42, 43, 44])

    ref = Runner(model, num_blocks=16, block_size=4)
    ref.prefill("a", prompt + drafts[:1])
    assert maxdiff(cont, ref.decode("a", [42, 43, 44])) < 1e-5


def test_fork_copy_on_write(ckpt):
    _, _, model = ckpt("llama")
    prompt = prompt_of(6, 60)  # 6 tokens, block_size 4: last block partial
    r = Runner(model, num_blocks=16, block_size=4)
    r.prefill("p", prompt)
    r.cache.fork("p", "c")
    assert r.cache.block_table("c")[0] == r.cache.block_table("p")[0]  # shared full block
    assert r.cache.block_table("c")[1] != r.cache.block_table("p")[1]  # partial block copied
    child = r.decode("c", [20, 21, 22])  # diverges (and crosses into a new block)
    parent = r.decode("p", [30, 31])

    ref = Runner(model, num_blocks=16, block_size=4)
    ref.prefill("x", prompt)
    assert maxdiff(parent, ref.decode("x", [30, 31])) < 1e-6
    ref.prefill("y", prompt)
    assert maxdiff(child, ref.decode("y", [20, 21, 22])) < 1e-6

    # rollback the child into the shared block, then write there: copy-on-write keeps the parent intact
    r.cache.rollback("c", 7)  # child keeps 2 tokens (inside shared block 0)
    assert r.cache.append_slots("c", 1)  # copies block 0 for the child before it is written
    assert r.cache.block_table("c")[0] != r.cache.block_table("p")[0]
    r.step([("c", [99])])
    assert maxdiff(r.decode("p", [32]), ref.decode("x", [32])) < 1e-6
    r.cache.free("p"), r.cache.free("c")
    assert r.cache.num_free_blocks == 16


def test_prefix_sharing_skips_cached_prefill(ckpt):
    _, hf, model = ckpt("mistral")
    prompt = prompt_of(14, 70)
    r = Runner(model, num_blocks=16, block_size=4, enable_prefix_sharing=True)
    r.prefill("a", prompt)
    r.cache.commit("a", prompt)
    other = prompt[:9] + [5, 6, 7]
    cached = r.cache.allocate("b", other)
    assert cached == 8  # two full shared blocks
    assert r.cache.block_table("b")[:2] == r.cache.block_table("a")[:2]
    got = r.step([("b", other[cached:])])[0]  # prefill only the uncached tail
    assert maxdiff(got, hf_logits(hf, other)[cached:]) < TOL
    r.cache.free("a"), r.cache.free("b")
    assert r.cache.num_free_blocks == 16


# ----------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_error_like_transformers(ckpt, dtype):
    """bf16/fp16 logits are as close to the fp32 reference as transformers' own bf16/fp16 logits."""
    AutoModelForCausalLM = pytest.importorskip("transformers").AutoModelForCausalLM
    folder, hf32, _ = ckpt("llama3")
    model = load_model(folder, dtype=dtype)
    assert model.dtype == dtype
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    prompt = prompt_of(16, 80)
    ours = Runner(model).prefill("a", prompt)
    assert ours.dtype == torch.float32
    ref = hf_logits(hf32, prompt)
    hf_half = hf_logits(hf, prompt)
    err_ours, err_hf = maxdiff(ours, ref), maxdiff(hf_half, ref)
    assert err_ours < 2 * err_hf + 1e-3, (err_ours, err_hf)
    assert err_ours < 0.05 * ref.abs().max().item()
    model.set_attention_fp32(False)  # attention in the model dtype, as transformers does
    assert maxdiff(Runner(model).prefill("a", prompt), hf_half) < 1e-2


def test_bf16_batched_greedy_equals_single_request(ckpt):
    """bf16 attention runs in fp32, so padding a request into a batch does not flip greedy tokens
    (with bf16 attention this fails within ~30 tokens on this config)."""
    folder, _, _ = ckpt("llama3")
    model = load_model(folder, dtype=torch.bfloat16)
    prompts = [prompt_of(5 + 3 * i, 100 + i) for i in range(6)]
    single = [Runner(model, num_blocks=32).greedy(p, 32) for p in prompts]
    r = Runner(model, num_blocks=256)
    last = [r.prefill(i, p)[-1] for i, p in enumerate(prompts)]
    outs = [[] for _ in prompts]
    for _ in range(32):
        toks = [int(x.argmax()) for x in last]
        for i, t in enumerate(toks):
            outs[i].append(t)
            assert r.cache.append_slots(i, 1)
        last = [x[0] for x in r.step([(i, [t]) for i, t in enumerate(toks)])]
    assert outs == single


def test_dtype_auto_reads_checkpoint(ckpt):
    folder, _, _ = ckpt("llama")
    cfg = json.loads((folder / "config.json").read_text())
    assert load_model(folder, dtype="auto").dtype == {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        cfg.get("dtype") or cfg.get("torch_dtype"), torch.float32)


def test_int8_weight_only_checkpoint_stays_int8(tmp_path, ckpt):
    """The specrt.models.quant on-disk format (int8 weight + float32 weight_scale) loads as an int8
    layer that stays int8 (its dequantized weight is q * scale)."""
    from specrt.models.linear import QuantLinear

    from safetensors.torch import load_file, save_file

    folder, _, model = ckpt("qwen2")
    sd = load_file(str(folder / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    w = sd[key]
    scale = w.abs().amax(1) / 127
    sd[key] = torch.round(w / scale[:, None]).to(torch.int8)
    sd[key + "_scale"] = scale
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    q = load_model(tmp_path)
    layer = q.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantLinear) and layer.weight.dtype == torch.int8
    got = layer.dequantize()
    assert got.dtype == torch.float32 and (got - w).abs().max() <= scale.max() / 2 + 1e-7
    prompt = prompt_of(9, 5)
    assert maxdiff(Runner(q).prefill("a", prompt), Runner(model).prefill("a", prompt)) < 0.1


# ----------------------------------------------------------------------------- bad input
def test_missing_files(tmp_path, ckpt):
    with pytest.raises(ValueError, match="model folder not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json not found"):
        load_model(tmp_path)
    folder, _, _ = ckpt("llama")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path)


def test_corrupt_safetensors(tmp_path, ckpt):
    folder, _, _ = ckpt("llama")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="corrupt or unreadable safetensors file .*model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt or unreadable safetensors"):
        load_model(tmp_path)


def test_mismatched_checkpoint(tmp_path, ckpt):
    folder, _, _ = ckpt("llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.symlink(folder / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.3"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="missing required keys.*intermediate_size"):
        ModelConfig.from_json({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_json({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                               "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_config_fields(ckpt):
    folder, _, _ = ckpt("llama3")
    c = ModelConfig.from_json(folder)
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("LlamaForCausalLM", 3, 4, 2, 16)
    assert c.tie_word_embeddings and c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert c.eos_token_ids == [2] and c.bos_token_id == 1 and c.sliding_window is None
    q = ModelConfig.from_json(ckpt("qwen2")[0])
    assert q.architecture == "Qwen2ForCausalLM" and q.attention_bias and not q.o_proj_bias
    assert ModelConfig.from_json(ckpt("mistral_sw")[0]).sliding_window == 7
    # transformers<5 layout
    old = ModelConfig.from_json({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                 "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0},
                                 "eos_token_id": [5, 6], "torch_dtype": "bfloat16"})
    assert old.rope_theta == 1e6 and old.rope_scaling == {"factor": 2.0, "rope_type": "linear"}
    assert old.eos_token_ids == [5, 6] and old.torch_dtype == "bfloat16" and old.num_kv_heads == 2


def test_prompt_longer_than_context(ckpt):
    _, _, model = ckpt("llama")  # max_position_embeddings 256
    check_prompt_length(model.config, 256)
    with pytest.raises(ValueError, match="prompt has 300 tokens, longer than the model's context of 256"):
        check_prompt_length(model.config, 300)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_prompt_length(model.config, 200, max_new_tokens=100)
    with pytest.raises(ValueError, match="exceed the model's context of 256"):
        AttentionMetadata.build([300], [300], [list(range(75))], 4, "cpu", max_model_len=256)
    cache = PagedKVCache({"t": model.config}, num_blocks=80, block_size=4)
    assert cache.allocate("a", list(range(3, 160)) * 2) == 0
    meta = cache.metadata(["a"], [314])
    with pytest.raises(ValueError, match="longer than the model's context of 256"):
        model(torch.zeros(314, dtype=torch.long), torch.arange(314), meta, cache["t"])


def test_dtype_device_cannot_run(ckpt, monkeypatch):
    folder, _, _ = ckpt("llama")
    with pytest.raises(ValueError, match="dtype torch.int8 cannot run the model on cpu"):
        check_dtype_supported(torch.int8, "cpu")
    with pytest.raises(ValueError, match="float8_e4m3fn cannot run the model on device cpu"):
        check_dtype_supported(torch.float8_e4m3fn, "cpu")
    with pytest.raises(ValueError, match="dtype 'float64' is not supported"):
        load_model(folder, dtype="float64")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(folder, dtype=torch.float16, device="cuda")

    # a device whose fp16 matmul is missing: the probe catches it before any weight is loaded
    import specrt.models.loader as loader

    real_linear = torch.nn.functional.linear

    def no_half(x, w, b=None):
        if x.dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real_linear(x, w, b)

    monkeypatch.setattr(loader.torch.nn.functional, "linear", no_half)
    with pytest.raises(ValueError, match="dtype torch.float16 cannot run the model on device cpu.*Half"):
        load_model(folder, dtype=torch.float16)


def test_wrong_kv_cache_shape(ckpt):
    _, _, model = ckpt("llama")
    cache = PagedKVCache({"t": model.config}, num_blocks=8, block_size=4)
    cache.allocate("a", [3, 4, 5])
    meta = cache.metadata(["a"], [3])
    bad = torch.zeros(3, 2, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="kv_cache .*expected"):
        model(torch.tensor([3, 4, 5]), torch.arange(3), meta, bad)


# ----------------------------------------------------------------------------- tokenizer / draft checks
def _write_tokenizer(folder, extra_vocab=(), eos="</s>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *extra_vocab]
    trainer = trainers.BpeTrainer(vocab_size=140, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["hello world, speculative decoding is fast", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": eos, "chat_template": template}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4], "temperature": 0.7}))


def test_tokenizer_roundtrip_and_chat_template(tmp_path):
    _write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    text = "hello world, the lazy fox!"
    ids = tok.encode(text)
    assert ids[0] == 1 == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.eos_token_ids == [2, 4] and tok.vocab_size == len(tok.tokenizer.get_vocab()) > 256
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    assert load_generation_config(tmp_path)["temperature"] == 0.7
    assert load_generation_config(tmp_path / "missing") == {}


def test_chat_template_is_sandboxed(tmp_path):
    _write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_draft_with_different_vocabulary(tmp_path, ckpt):
    t_dir, d_dir = tmp_path / "t", tmp_path / "d"
    t_dir.mkdir(), d_dir.mkdir()
    make_checkpoint(t_dir, "llama", vocab_size=320)
    make_checkpoint(d_dir, "qwen2", vocab_size=300)  # same tokenizer, fewer padding rows (like Qwen2.5 7B/0.5B)
    _write_tokenizer(t_dir)
    _write_tokenizer(d_dir)
    info = check_draft_compatible(t_dir, d_dir)
    assert info == {"target_vocab_size": 320, "draft_vocab_size": 300, "shared_vocab_size": 300}

    small = tmp_path / "s"
    small.mkdir()
    make_checkpoint(small, "llama", vocab_size=VOCAB)
    _write_tokenizer(small)
    with pytest.raises(ValueError, match=f"draft model vocab_size {VOCAB} < tokenizer vocabulary"):
        check_draft_compatible(t_dir, small)

    _write_tokenizer(d_dir, extra_vocab=("<tool>",), eos="<|im_end|>")
    (d_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    with pytest.raises(ValueError) as e:
        check_draft_compatible(t_dir, d_dir)
    msg = str(e.value)
    assert "shared vocabulary" in msg
    assert "tokenizer vocabulary size: target 261 != draft 262" in msg
    assert "'<tool>' (id 5)" in msg and "256 token ids differ, e.g. '!': target id 5 / draft id 6" in msg
    assert "eos_token_ids: target [2, 4] != draft [4, 3, 2]" in msg

    # models only: vocab sizes compared directly
    other = tmp_path / "o"
    other.mkdir()
    make_checkpoint(other, "llama", vocab_size=VOCAB + 32)
    with pytest.raises(ValueError, match=f"vocab_size: target {VOCAB} != draft {VOCAB + 32}"):
        check_draft_compatible(ckpt("llama")[2], load_model(other))


def test_chat_template_jinja_file_as_transformers_5_saves_it(tmp_path):
    """transformers>=5 writes the template to chat_template.jinja (not tokenizer_config.json); the
    file wins over a tokenizer_config.json template, and named extra templates are kept."""
    _write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(tmp_path).apply_chat_template(msgs)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}", encoding="utf-8")
    assert load_tokenizer(tmp_path).apply_chat_template(msgs) == "[user] hi\n[assistant] "
    cfg["chat_template"] = "{{ 'from tokenizer_config' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_tokenizer(tmp_path).apply_chat_template(msgs) == "[user] hi\n[assistant] "
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    tok = load_tokenizer(tmp_path)
    assert [t["name"] for t in tok.tokenizer_config["chat_template"]] == ["default", "tool_use"]
    assert tok.apply_chat_template(msgs) == "[user] hi\n[assistant] "
