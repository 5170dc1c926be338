"""ops.paged_attention: the paged multi-position attention kernel.

CPU kernel vs the float64 reference (specrt/ops/reference.py) and vs the model's gather + SDPA path
on ragged batches (GQA, sliding window, query lengths 1..K+1, contexts spanning several chunks,
shuffled and shared blocks, fp32 / bf16 / fp16 caches); bit-exact invariances (batch neighbours,
query count, block size, thread count, instruction set); bad input rejected with errors naming
the argument; opcheck; greedy decoding token-identical to the SDPA backend; CUDA vs CPU bit for
bit (skipped without a GPU)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from specrt import ops
from specrt.ops import reference
from specrt.models.attention import AttentionMetadata
from specrt.models.config import ModelConfig
from specrt.models.llama import LlamaForCausalLM, paged_attention_sdpa

TOL = 1e-5


@dataclass
class Case:
    q: torch.Tensor             # [T, H, D] float32 (T may exceed the metadata's rows: padding)
    cache: torch.Tensor         # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata
    scale: float
    window: int                 # 0 = none

    def args(self):
        m = self.meta
        return (self.q, self.cache, m.block_tables, m.seq_lens, m.query_start_loc, self.scale, self.window)

    def run(self, **kw) -> torch.Tensor:
        return ops.paged_attention(*self.args(), **kw)

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(*self.args())


def make_case(seq_lens, query_lens, heads=9, kv_heads=3, head_dim=64, block_size=16, window=0,
              dtype=torch.float32, padding_rows=0, share_prefix=False, seed=0) -> Case:
    """Random q / cache; every request's blocks are shuffled over the cache; with share_prefix the
    last request reuses the first request's leading full blocks (prefix sharing)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(ids[i:i + n])
        i += n
    if share_prefix and len(tables) > 1:
        shared = min(seq_lens[0] - query_lens[0], seq_lens[-1] - query_lens[-1]) // block_size
        tables[-1][:shared] = tables[0][:shared]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata.build(list(seq_lens), list(query_lens), tables, block_size)
    q = torch.randn(sum(query_lens) + padding_rows, heads, head_dim, generator=g)
    return Case(q, cache, meta, head_dim ** -0.5, window)


RAGGED = dict(seq_lens=[1, 17, 300, 700, 530, 64], query_lens=[1, 5, 3, 5, 16, 2])


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 40)])
@pytest.mark.parametrize("window", [0, 7, 300])
def test_matches_reference(dtype, heads, kv_heads, head_dim, window):
    """fp32 accumulation: within 1e-5 of float64 on the same cache values, for every cache dtype
    (the 16-bit caches convert exactly)."""
    case = make_case(**RAGGED, heads=heads, kv_heads=kv_heads, head_dim=head_dim, window=window, dtype=dtype,
                     padding_rows=3, share_prefix=True)
    out = case.run()
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    assert (out - case.reference()).abs().max().item() <= TOL
    assert torch.all(out[-3:] == 0)  # padding rows


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("window", [None, 20])
def test_matches_gather_sdpa_path(block_size, window):
    """The model's current gather + SDPA path is the oracle too."""
    case = make_case(**RAGGED, block_size=block_size, window=window or 0, seed=3)
    T = case.q.shape[0]
    kv = torch.zeros(T, case.cache.shape[3], case.q.shape[2])  # only fresh prefills read these: none here
    want = paged_attention_sdpa(case.q, kv, kv, case.cache, case.meta, case.scale, window)
    assert (case.run() - want).abs().max().item() <= TOL


def test_long_context_spans_many_chunks():
    case = make_case([4100, 2049], [5, 1], block_size=16, seed=4)
    assert (case.run() - case.reference()).abs().max().item() <= TOL


# ----------------------------------------------------------------------------- invariances (bit for bit)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_independent_of_batch_neighbours_and_query_count(dtype):
    """A query's bits do not depend on its neighbours or on how many queries its request has (a
    one-token decode takes the narrow tile, a bf16 one reading the cache in place; a 5-token
    verify's 15 lanes the wide one)."""
    case = make_case(**RAGGED, window=0, dtype=dtype, seed=5)
    full = case.run()
    m = case.meta
    starts = m.query_start_loc.tolist()
    for b, (s, n) in enumerate(zip(m.seq_lens_host, m.query_lens_host)):
        table = [x for x in m.block_tables[b].tolist() if x >= 0]
        rows = case.q[starts[b]:starts[b] + n]
        alone = AttentionMetadata.build([s], [n], [table], m.block_size)
        got = ops.paged_attention(rows.contiguous(), case.cache, alone.block_tables, alone.seq_lens,
                                  alone.query_start_loc, case.scale)
        assert torch.equal(got, full[starts[b]:starts[b] + n])
        # each query alone, as a one-token decode at its position
        for i in range(n):
            one = AttentionMetadata.build([s - n + i + 1], [1], [table], m.block_size)
            got = ops.paged_attention(rows[i:i + 1].contiguous(), case.cache, one.block_tables, one.seq_lens,
                                      one.query_start_loc, case.scale)
            assert torch.equal(got[0], full[starts[b] + i])


def test_output_independent_of_block_size():
    """Tiles and chunks are fixed in key positions, so re-paging the same context changes nothing."""
    seq_lens, query_lens = [700, 33, 260], [5, 1, 4]
    big = make_case(seq_lens, query_lens, block_size=16, seed=6)
    keys = []  # the logical K/V of every request, [2, s, Hkv, D]
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        blocks = big.meta.block_tables[b].long()[pos // 16]
        keys.append(big.cache[:, blocks, pos % 16])
    bs = 4
    rng = random.Random(0)
    need = [-(-s // bs) for s in seq_lens]
    ids = list(range(sum(need)))
    rng.shuffle(ids)
    cache = torch.zeros(2, sum(need), bs, *big.cache.shape[3:])
    tables, i = [], 0
    for b, (s, n) in enumerate(zip(seq_lens, need)):
        tables.append(ids[i:i + n])
        i += n
        pos = torch.arange(s)
        cache[:, torch.tensor(tables[-1])[pos // bs], pos % bs] = keys[b]
    meta = AttentionMetadata.build(seq_lens, query_lens, tables, bs)
    small = Case(big.q, cache, meta, big.scale, 0)
    assert torch.equal(small.run(), big.run())


def test_output_independent_of_thread_count():
    case = make_case(**RAGGED, window=40, dtype=torch.bfloat16, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.run()
        torch.set_num_threads(2)
        two = case.run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def on_every_level(run) -> list[torch.Tensor]:
    """run() at every instruction-set level this CPU has (not only up to the default one: level 4 is
    AVX-512 too), the default restored afterwards."""
    default = ops.attention_cpu_isa(-1)
    try:
        ops.attention_cpu_isa(4)
        top = ops.attention_cpu_isa(-1)
        outs = []
        for level in range(top + 1):
            ops.attention_cpu_isa(level)
            assert ops.attention_cpu_isa(-1) == level
            outs.append(run())
    finally:
        ops.attention_cpu_isa(default)
    assert ops.attention_cpu_isa(-1) == default
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(9, 3, 40, 33), (9, 3, 64, 0), (16, 2, 128, 70),
                                                            (4, 4, 32, 5), (8, 2, 128, 0)])
def test_every_instruction_set_returns_the_same_bits(dtype, heads, kv_heads, head_dim, window):
    """Levels 0-4 (scalar, AVX2, AVX-512 16-wide groups, AVX-512 with narrow groups, and with the
    many-lane tile reading keys in place): the same bits, over query counts that give every narrow
    group size (1..8 live lanes) and wide ones; a group alone in its tile with 1-6 or 9-12 lanes (a
    decode or a short verify) transposes a bf16 cache's keys in registers (head dims 32, 64, 128)."""
    case = make_case([300, 40, 9, 700, 90, 260], [5, 3, 1, 2, 4, 8], heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, window=window, dtype=dtype, seed=8)
    outs = on_every_level(case.run)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert (outs[0] - case.reference()).abs().max().item() <= TOL


@pytest.mark.parametrize("head_dim,window", [(64, 0), (128, 21)])
def test_many_lane_groups_return_the_same_bits(head_dim, window):
    """Groups of 9..16 live lanes on a bf16 cache (the narrow tile, and from 15 lanes the many-lane
    tile, which at level 4 reads keys in place) against the scalar and 16-wide levels, bit for bit,
    including short and masked tiles, and requests of 17 and 31 lanes (a many-lane group beside a
    narrow one, which still needs the transposed keys, and two many-lane groups, which do not)."""
    case = make_case([300, 40, 16, 700, 290, 57, 30, 520, 64, 200], [9, 10, 11, 12, 13, 14, 15, 16, 17, 31],
                     heads=2, kv_heads=2,
                     head_dim=head_dim, window=window, dtype=torch.bfloat16, seed=12)
    outs = on_every_level(case.run)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert (outs[0] - case.reference()).abs().max().item() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_len", [1, 3, 15, 16])
def test_exp2_edge_values_same_bits_on_every_instruction_set(dtype, query_len):
    """Softmax weights at exp2's edges (x = -126, -127 and between, far below, -inf, a NaN query):
    with qscale exactly 1, one-hot keys and values make each output element one weight / l, so every
    instruction set's exp2 is compared bit for bit (NaN lanes: NaN on every level)."""
    xs = [0.0, -0.5, -125.5, -126.0, -126.5, -127.0, -127.5, -128.0, -200.0, float("-inf")]
    keys, d = 32, 64
    cache = torch.zeros(2, 1, keys, 1, d)
    for j, x in enumerate(xs):
        cache[0, 0, j, 0, 0] = x      # key j's score is x for q = e_0 (qscale = 1: scale = ln 2)
        cache[1, 0, j, 0, j] = 1.0    # value j is e_j: output element j is p_j / l
    cache[0, 0, len(xs):, 0, 0] = -300.0
    cache = cache.to(dtype)
    meta = AttentionMetadata.build([keys], [query_len], [[0]], keys)
    q = torch.zeros(query_len, 1, d)
    q[:, 0, 0] = 1.0
    q[0, 0, 1] = float("nan")         # the first query's scores are all NaN
    scale = 0.6931471805599453
    args = (q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, 0)
    outs = on_every_level(lambda: ops.paged_attention(*args))
    nan = torch.isnan(outs[0])
    assert nan[0].all() and not nan[1:].any()
    for o in outs[1:]:
        assert torch.equal(torch.isnan(o), nan)
        assert torch.equal(o[1:], outs[0][1:])
    if query_len > 1:  # weights from x = -126 up are positive, below it exactly 0
        row = outs[0][1, 0]
        assert (row[:4] > 0).all() and (row[4:] == 0).all()


def test_empty_request_and_default_bounds():
    """A request with no new rows is skipped; max_query_len / max_seq_len default from CPU tensors."""
    case = make_case([20, 9], [3, 2], seed=9)
    m = case.meta
    qsl = torch.tensor([0, 3, 3, 5])
    seq = torch.tensor([20, 4, 9])
    tables = torch.cat([m.block_tables[:1], torch.full((1, m.block_tables.shape[1]), -1, dtype=torch.int32),
                        m.block_tables[1:]])
    got = ops.paged_attention(case.q, case.cache, tables, seq, qsl, case.scale)
    assert torch.equal(got, case.run(max_query_len=3, max_seq_len=20))
    # no requests at all: only padding rows, all zero
    none = ops.paged_attention(case.q[:2].contiguous(), case.cache, tables[:0], seq[:0], qsl[:1], case.scale)
    assert none.shape == (2, *case.q.shape[1:]) and torch.all(none == 0)
    with pytest.raises(ValueError, match=r"query_start_loc\[0\] = 3 must be 0"):
        ops.paged_attention(case.q, case.cache, tables[:0], seq[:0], qsl[1:2], case.scale)


# ----------------------------------------------------------------------------- bad input
def _bad(case, name, value):
    args = dict(zip(("q", "kv_cache", "block_tables", "seq_lens", "query_start_loc", "scale", "window"),
                    case.args()))
    args[name] = value
    return args


def _mutations(case):
    m = case.meta
    bt = m.block_tables
    out_of_range = bt.clone()
    out_of_range[0, 0] = case.cache.shape[1]
    negative = bt.clone()
    negative[1, 1] = -1
    shrink = m.seq_lens.clone()
    shrink[1] = 2  # request 1 has 5 new tokens
    backwards = m.query_start_loc.clone()
    backwards[1] = 7
    return [
        ("q", case.q.double(), TypeError, "q must have dtype torch.float32"),
        ("q", case.q[:, :, :8].contiguous(), ValueError, "head_dim"),
        ("q", case.q[:, :4].contiguous(), ValueError, "multiple of the 3 kv heads"),
        ("q", case.q.transpose(0, 1), ValueError, "q must be contiguous"),
        ("kv_cache", case.cache[0], ValueError, "kv_cache must be 5-D"),
        ("kv_cache", case.cache.int(), TypeError, "kv_cache must be float32, bfloat16 or float16"),
        ("block_tables", bt.long(), TypeError, "block_tables must have dtype torch.int32, got torch.int64"),
        ("block_tables", bt[:1].contiguous(), ValueError, "block_tables must have one row per request"),
        ("block_tables", bt[:, :1].contiguous(), ValueError, "block_tables has 1 columns"),
        ("block_tables", out_of_range, ValueError, r"block_tables\[0, 0\] = \d+ is out of range"),
        ("block_tables", negative, ValueError, r"block_tables\[1, 1\] = -1 is out of range"),
        ("seq_lens", shrink, ValueError, r"seq_lens\[1\] = 2 is smaller than its query_len 5"),
        ("seq_lens", m.seq_lens.int(), TypeError, "seq_lens must have dtype torch.int64"),
        ("query_start_loc", m.query_start_loc[:-1].contiguous(), ValueError, r"query_start_loc must be \[B\+1\]"),
        ("query_start_loc", backwards, ValueError, "query_start_loc must be non-decreasing"),
        ("query_start_loc", m.query_start_loc + 1, ValueError, r"query_start_loc\[0\] = 1 must be 0"),
        ("scale", float("nan"), ValueError, "scale must be finite"),
        ("window", -1, ValueError, "window must be >= 0"),
    ]


def test_bad_input_is_rejected_naming_the_argument():
    case = make_case([40, 300], [1, 5], block_size=16, seed=10)
    for name, value, exc, match in _mutations(case):
        with pytest.raises(exc, match=match):
            ops.paged_attention(**_bad(case, name, value))
    a = case.args()
    with pytest.raises(ValueError, match="max_seq_len = 299"):
        ops.paged_attention(*a, max_query_len=5, max_seq_len=299)
    with pytest.raises(ValueError, match="max_query_len = 4"):
        ops.paged_attention(*a, max_query_len=4, max_seq_len=300)
    with pytest.raises(ValueError, match=r"query_start_loc\[2\] = 6 exceeds the 5 rows of q"):
        ops.paged_attention(case.q[:5].contiguous(), *a[1:])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.paged_attention(None, *a[1:])
    # the op still works afterwards
    assert (case.run() - case.reference()).abs().max().item() <= TOL


def test_opcheck():
    case = make_case([40, 300], [1, 5], block_size=16, window=50, dtype=torch.bfloat16, seed=11)
    q, cache, bt, seq, qsl, scale, window = case.args()
    torch.library.opcheck(torch.ops.specrt.paged_attention, (q, cache, bt, seq, qsl, scale, window, 5, 300, True))


# ----------------------------------------------------------------------------- in the model
def _tiny_model(window=None, seed=0) -> LlamaForCausalLM:
    raw = dict(architectures=["MistralForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-5, sliding_window=window, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_json(raw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("window", [None, 24])
def test_greedy_decoding_token_identical_to_sdpa_backend(window):
    """300-token prompt (two chunks, block size 16), then 40 greedy tokens and a K+1 verify step."""
    from _model_utils import Runner  # tests/ is on sys.path under pytest

    model = _tiny_model(window)
    prompt = torch.randint(3, 97, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    for backend in ("kernel", "sdpa"):
        model.set_attention_backend(backend)
        r = Runner(model, num_blocks=32, block_size=16)
        tokens = r.greedy(prompt, 40)
        verify = r.decode("g", tokens[-5:])  # K+1 = 5 positions over the decoded context
        runs[backend] = tokens, verify
    assert runs["kernel"][0] == runs["sdpa"][0]
    assert (runs["kernel"][1] - runs["sdpa"][1]).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="backend must be"):
        model.set_attention_backend("flash")


# ----------------------------------------------------------------------------- CUDA vs CPU
@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and ops.cuda_built()), reason="needs CUDA and the CUDA build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 37])
def test_cuda_matches_cpu_bit_for_bit(dtype, window):
    case = make_case(**RAGGED, head_dim=40, window=window, dtype=dtype, padding_rows=2, share_prefix=True, seed=12)
    want = case.run()
    q, cache, bt, seq, qsl, scale, w = (x.cuda() if isinstance(x, torch.Tensor) else x for x in case.args())
    got = ops.paged_attention(q, cache, bt, seq, qsl, scale, w, max_query_len=16, max_seq_len=700)
    assert torch.equal(got.cpu(), want)
    long = make_case([4100, 2049, 1], [5, 1, 1], dtype=dtype, window=window, seed=13)
    args = [x.cuda() if isinstance(x, torch.Tensor) else x for x in long.args()]
    assert torch.equal(ops.paged_attention(*args, max_query_len=5, max_seq_len=4100).cpu(), long.run())
    ops.set_debug_checks(True)
    try:
        bad = bt.clone()
        bad[0, 0] = cache.shape[1]
        with pytest.raises(ValueError, match="out of range"):
            ops.paged_attention(q, cache, bad, seq, qsl, scale, w, max_query_len=16, max_seq_len=700)
    finally:
        ops.set_debug_checks(False)
