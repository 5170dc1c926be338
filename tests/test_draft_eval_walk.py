"""draft_eval's decoding walk: chains start where greedy decoding would start them."""
from specrt.training.draft_eval import decoding_walk


def test_walk_advances_by_accepted_plus_bonus():
    # k=2, n=8; ok[j][q]: draft j right at index q
    ok = [[True, False, True, True, False, False, True, False],
          [False, False, False, True, False, False, False, False]]
    counts, chains = decoding_walk(ok, 0, 8)
    # start 0: draft 0 right, draft 1 (index 1) wrong -> next start 2: right, index 3 right -> start 5:
    # wrong -> start 6: right, index 7 wrong -> start 8 > n - k: stop
    assert chains == 4
    assert counts == [3, 1]


def test_walk_samples_hard_stretches_more_than_every_start():
    ok = [[True] * 6 + [False] * 6]          # k=1: an easy first half, a hard second half
    counts, chains = decoding_walk(ok, 0, 12)
    # every start: 6 of 12 right; the walk passes the easy half in 3 chains, the hard one in 6
    assert (counts, chains) == ([3], 9)
    assert counts[0] / chains < 0.5


def test_walk_starts_at_the_prompt_end_and_needs_room():
    assert decoding_walk([[True, True, True]], 2, 3) == ([1], 1)
    assert decoding_walk([[True, True, True], [True, True, True]], 2, 3) == ([0, 0], 0)
