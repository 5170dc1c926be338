"""specrt._C.SuffixIndex (csrc/suffix_index.cpp) against its reference, specrt/drafters/suffix_ref.py:
seeded fuzzing compares every answer exactly (probabilities with ==); hand-written cases pin the
tree, exclusion, eviction and argument checks; memory at 1M tokens; a per-request index growing
a few tokens at a time."""
import random
import time

import pytest

from specrt.drafters.suffix_ref import ReferenceSuffixIndex
from specrt.ops.library import suffix_index_class

SuffixIndex = suffix_index_class()
IMPLS = [pytest.param(SuffixIndex, id="cpp"), pytest.param(ReferenceSuffixIndex, id="ref")]


def same_state(cpp, ref, ids):
    assert len(cpp) == len(ref)
    assert cpp.num_tokens == ref.num_tokens
    for i in ids:
        assert (i in cpp) == (i in ref), i
        if i in ref:
            assert cpp.sequence(i) == ref.sequence(i), i


def same_draft(cpp, ref, *args):
    got, want = cpp.draft(*args), ref.draft(*args)
    assert got == want, (args, got, want)
    return got


def random_query(rng, span, vocab, seqs):
    """Draft arguments: a context that often ends like some sequence's prefix (long matches)."""
    max_depth = rng.randint(1, span - 1)
    max_match = rng.randint(1, span - max_depth)
    min_match = rng.randint(1, max_match)
    live = [s for s in seqs if s]
    if live and rng.random() < 0.7:
        s = rng.choice(live)
        end = rng.randint(0, len(s))
        ctx = s[max(0, end - rng.randint(0, span + 2)):end]
        if rng.random() < 0.2:
            ctx = ctx + [rng.randrange(vocab)]
    else:
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, span + 2))]
    max_nodes = rng.choice([0, 1, 2, 5, 16, 40, rng.randint(0, 60)])
    min_prob = rng.choice([0.0, 0.0, 0.05, 0.1, 0.25, 1 / 3, 0.5, 1.0, rng.random()])
    return ctx, max_match, min_match, max_nodes, max_depth, min_prob


def run_case(seed):
    rng = random.Random(seed)
    big = seed % 4 == 0  # enough tokens for segments, merges, sealed tails and purges
    vocab = rng.randint(2, 6)
    span = rng.choice([24, 32, 48, 64]) if big else rng.choice([2, 3, 4, 6, 8, 12, 16, 24])
    max_tokens = rng.choice([0, 0, rng.randint(5, 6000 if big else 200)])
    cpp, ref = SuffixIndex(span, max_tokens), ReferenceSuffixIndex(span, max_tokens)
    pool = list(range(50 if big else 6))
    motif = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]  # repeated, for long matches
    for _ in range(rng.randint(5, 120 if big else 30)):
        op = rng.random()
        if op < 0.55:
            sid = rng.choice(pool)
            n = rng.choice([0, 1, 2, 5, 20, 60, 150, 300] if big else [0, 1, 2, 3, 8, 20, 40])
            toks = [rng.randrange(vocab) if rng.random() < 0.3 else motif[i % len(motif)] for i in range(n)]
            cpp.append(sid, toks)
            ref.append(sid, toks)
        elif op < 0.62:
            sid = rng.choice(pool)
            assert cpp.remove(sid) == ref.remove(sid)
        else:
            seqs = [ref.sequence(i) for i in pool if i in ref]
            args = random_query(rng, span, vocab, seqs)
            exclude = rng.choice([-1, -1, rng.choice(pool)])
            same_draft(cpp, ref, *args, exclude)
        same_state(cpp, ref, pool)


@pytest.mark.parametrize("block", range(6))
def test_fuzz_matches_reference(block):
    for seed in range(block * 50, block * 50 + 50):
        run_case(seed)


def test_many_sequences_then_regrowth():
    """Like the global index: many finished sequences (the C++ index seals their last positions
    into its sorted segments), then old ones grow again, are removed, or are evicted."""
    rng = random.Random(17)
    cpp, ref = SuffixIndex(32, 7000), ReferenceSuffixIndex(32, 7000)
    motif = [rng.randrange(4) for _ in range(9)]

    def chunk(n):
        return [rng.randrange(4) if rng.random() < 0.25 else motif[i % 9] for i in range(n)]

    def check():
        seqs = [ref.sequence(i) for i in range(120) if i in ref]
        for _ in range(3):
            same_draft(cpp, ref, *random_query(rng, 32, 4, seqs), rng.choice([-1, rng.randrange(120)]))
        same_state(cpp, ref, range(120))

    for i in range(100):
        toks = chunk(rng.randint(30, 120))
        cpp.append(i, toks)
        ref.append(i, toks)
        if i % 10 == 9:
            check()
    for _ in range(60):
        i = rng.randrange(120)
        if rng.random() < 0.2:
            assert cpp.remove(i) == ref.remove(i)
        else:
            toks = chunk(rng.choice([1, 3, 40]))
            cpp.append(i, toks)
            ref.append(i, toks)
        check()


@pytest.mark.parametrize("impl", IMPLS)
def test_known_tree(impl):
    idx = impl(16)
    for i, s in enumerate([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]]):
        idx.append(i, s)
    assert idx.draft([9, 1, 2, 3], 8, 1, 8, 4, 0.0) == (3, [4, 5], [-1, -1], [2 / 3, 1 / 3], [2, 1])
    # the pattern [2, 3] (no [7, 2, 3] anywhere); a suffix with nothing after it is no occurrence
    assert idx.draft([7, 2, 3], 8, 1, 8, 4, 0.0)[0] == 2
    assert idx.draft([3, 4], 8, 1, 8, 4, 0.0) == (0, [], [], [], [])
    assert idx.draft([7, 2, 3], 8, 3, 8, 4, 0.0) == (0, [], [], [], [])  # min_match
    assert idx.draft([], 8, 1, 8, 4, 0.0) == (0, [], [], [], [])


@pytest.mark.parametrize("impl", IMPLS)
def test_order_and_cutoffs(impl):
    idx = impl(16)
    for i, s in enumerate([[1, 2, 3, 4, 7], [1, 2, 3, 4, 6], [1, 2, 3, 5]]):
        idx.append(i, s)
    # 4 (2/3); then 5, 6, 7 all at 1/3: the shallower first, then the smaller path
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.0) == (3, [4, 5, 6, 7], [-1, -1, 0, 0], [2 / 3, 1 / 3] + [1 / 3] * 2,
                                                     [2, 1, 1, 1])
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.5) == (3, [4], [-1], [2 / 3], [2])
    assert idx.draft([1, 2, 3], 3, 1, 2, 4, 0.0)[1] == [4, 5]  # max_nodes
    assert idx.draft([1, 2, 3], 3, 1, 8, 1, 0.0)[1] == [4, 5]  # max_depth
    assert idx.draft([1, 2, 3], 3, 1, 0, 4, 0.0) == (3, [], [], [], [])


@pytest.mark.parametrize("impl", IMPLS)
def test_exclude(impl):
    idx = impl(16)
    idx.append(1, [1, 2, 3, 4, 8])
    idx.append(2, [1, 2, 3, 5])
    idx.append(3, [0, 2, 3, 6])
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.0)[:2] == (3, [4, 5, 8])
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.0, 2) == (3, [4, 8], [-1, 0], [1.0, 1.0], [1, 1])
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.0, 1)[:2] == (3, [5])
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.0, 7)[:2] == (3, [4, 5, 8])  # unknown: nothing excluded
    idx.remove(2)
    # with sequence 1 excluded, [1, 2, 3] occurs nowhere else: the match falls back to [2, 3]
    assert idx.draft([1, 2, 3], 3, 1, 8, 4, 0.0, 1) == (2, [6], [-1], [1.0], [1])


@pytest.mark.parametrize("impl", IMPLS)
def test_eviction_order(impl):
    idx = impl(8, 10)
    idx.append(1, [1] * 4)
    idx.append(2, [2] * 4)
    idx.append(3, [3] * 4)  # 12 > 10: the oldest, 1, goes
    assert sorted(i for i in range(6) if i in idx) == [2, 3] and idx.num_tokens == 8
    idx.append(2, [2] * 4)  # 2 is the oldest but was just appended to: 3 goes
    assert sorted(i for i in range(6) if i in idx) == [2] and idx.num_tokens == 8
    idx.append(4, [4] * 2)  # 10: nothing goes
    idx.remove(2)
    idx.append(2, [2] * 3)  # re-created: now newer than 4
    idx.append(5, [5] * 6)  # 12 > 10: 4 goes, not 2
    assert sorted(i for i in range(6) if i in idx) == [2, 5]
    idx.append(5, [5] * 20)  # over the limit alone: kept
    assert sorted(i for i in range(6) if i in idx) == [5] and idx.num_tokens == 26 and len(idx) == 1
    assert idx.sequence(5) == [5] * 26
    with pytest.raises(KeyError):
        idx.sequence(2)
    assert idx.remove(5) and not idx.remove(5) and len(idx) == 0 and idx.num_tokens == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_argument_checks(impl):
    for kwargs, name in [(dict(max_span=1), "max_span"), (dict(max_span=4097), "max_span"),
                         (dict(max_tokens=-1), "max_tokens")]:
        with pytest.raises(ValueError, match=name):
            impl(**kwargs)
    idx = impl(16)
    assert idx.max_span == 16 and impl().max_span == 64 and impl().max_tokens == 0
    with pytest.raises(ValueError, match="tokens"):
        idx.append(0, [1, -1])
    with pytest.raises(ValueError, match="tokens"):
        idx.append(0, [2**31])
    with pytest.raises(ValueError, match="seq_id"):
        idx.append(-1, [1])
    assert len(idx) == 0 and idx.num_tokens == 0  # nothing appended by a rejected call
    idx.append(0, [1, 2, 1, 2])
    ok = dict(max_match=8, min_match=1, max_nodes=4, max_depth=8, min_prob=0.0)
    for bad, name in [(dict(min_match=0), "min_match"), (dict(max_match=0), "max_match"),
                      (dict(max_match=2, min_match=3), "max_match"), (dict(max_nodes=-1), "max_nodes"),
                      (dict(max_depth=0), "max_depth"), (dict(min_prob=-0.1), "min_prob"),
                      (dict(min_prob=1.5), "min_prob"), (dict(min_prob=float("nan")), "min_prob"),
                      (dict(max_match=9), "max_span")]:
        with pytest.raises(ValueError, match=name):
            idx.draft([1, 2], **{**ok, **bad})
    assert idx.draft([1, 2], **ok) == (2, [1, 2], [-1, 0], [1.0, 1.0], [1, 1])


def test_memory_at_1m_tokens():
    import torch

    rows = torch.randint(0, 49152, (1000, 1000), generator=torch.Generator().manual_seed(0)).tolist()
    idx = SuffixIndex(48)
    t0 = time.perf_counter()
    for i, row in enumerate(rows):
        idx.append(i, row)
    took = time.perf_counter() - t0
    mem = idx.memory_bytes()
    print(f"\nSuffixIndex: 1M tokens appended in {took:.2f} s ({took * 1e6 / idx.num_tokens:.2f} us/token), "
          f"memory_bytes {mem} ({mem / 1e6:.2f} bytes/token)")
    assert idx.num_tokens == 1_000_000 and len(idx) == 1000
    assert mem <= 100_000_000
    assert mem >= 12_000_000  # 4 bytes of text and 8 of suffix array per token, at least
    # a 16-token stretch of row 7 is found, with what followed it
    assert idx.draft(rows[7][500:516], 16, 1, 4, 4, 0.0)[:2] == (16, rows[7][516:520])
    assert idx.draft(rows[999][990:998], 16, 1, 4, 4, 0.0)[:2] == (8, rows[999][998:1000])


def test_per_request_growth():
    rng = random.Random(5)
    motifs = [[rng.randrange(50) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    text = []
    while len(text) < 3000:  # repeated motifs with noise, like generated text
        text += rng.choice(motifs) if rng.random() < 0.8 else [rng.randrange(50) for _ in range(5)]
    text = text[:3000]
    cpp, ref = SuffixIndex(32), ReferenceSuffixIndex(32)
    step, n = 0, 0
    while n < len(text):
        k = rng.randint(1, 4)
        cpp.append(0, text[n:n + k])
        ref.append(0, text[n:n + k])
        n += k
        got = cpp.draft(text[max(0, n - 16):n], 16, 1, 32, 16, 0.05)
        if step % 50 == 0:
            assert got == ref.draft(text[max(0, n - 16):n], 16, 1, 32, 16, 0.05)
        step += 1
    assert cpp.sequence(0) == text
