"""The engine with a reduced-vocabulary draft (specrt.drafters.reduced) on a tiny random target.

- greedy: speculative output == autoregressive output (batches, K, overlap);
- rejection sampling stays exact although the draft gives half the vocabulary probability 0:
  the first drafted position's tokens follow the target's exact conditional distribution
  (chi-square per first token), and the test rejects a drafter that drops its probabilities;
- a folder that does not fit the target is refused with an error naming the difference;
- "smollm2-135m-draft" resolves to the shipped folder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import EOS, VOCAB, exact_tables, make_pair, tokens  # noqa: E402
from _stats import P_FAIL, P_PASS, chisquare_conditional  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10] * 3, [11, 12, 13], [20] * 10, [30, 31], [40, 41, 42, 43, 44, 45, 46], [70]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# the draft covers the even ids (and EOS): the target's odd tokens reach the output only through
# the residual max(p - q, 0)
DRAFT_IDS = sorted(set(range(0, VOCAB, 2)) | {EOS})


def save_reduced_draft(target_dir: Path, out: Path, ids=DRAFT_IDS, layers=(0, 1), kind="layers",
                       feature_scale: float = 0.0) -> Path:
    """A DraftModel of the target's layers ``layers`` with a head over ``ids`` (untrained: it
    agrees with the target often, as a layer-init draft does). A feature draft's fc is
    [I, feature_scale * I]: with a scale > 0 the target's features change its proposals."""
    from specrt.models import load_model
    from specrt.training.draft_train import init_draft
    from specrt.training.vocab import ReducedVocab

    target = load_model(target_dir)
    vocab = ReducedVocab.from_map(torch.tensor(ids), VOCAB)
    draft = init_draft(target, kind, list(layers), vocab)
    if kind == "feature":
        H = target.config.hidden_size
        with torch.no_grad():
            draft.fc.weight.copy_(torch.cat([torch.eye(H), feature_scale * torch.eye(H)], 1))
    draft.save_pretrained(out, generation_config={"bos_token_id": 1, "eos_token_id": EOS}, dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reduced")
    tdir, _ = make_pair(root)
    return tdir, save_reduced_draft(tdir, root / "reduced")


_cache: dict = {}


def llm(pair, draft, **spec):
    key = (draft, tuple(sorted(spec.items())))
    if key not in _cache:
        tdir, ddir = pair
        d = {"reduced": str(ddir), "none": None}[draft]
        _cache[key] = specrt.LLM(target=str(tdir), draft=d, spec=SpecConfig(**spec), seed=0)
    return _cache[key]


def test_reduced_draft_loads_as_its_own_drafter(pair):
    from specrt.drafters.reduced import ReducedDrafter

    eng = llm(pair, "reduced").engine
    assert isinstance(eng.drafter, ReducedDrafter)
    assert eng.drafter.model.lm_head.weight.shape == (len(DRAFT_IDS), 64)
    # the embeddings are the target's own tensor, not a copy
    assert eng.drafter.draft.embed.data_ptr() == eng.target.model.embed_tokens.weight.data_ptr()
    logits = torch.randn(3, len(DRAFT_IDS))
    full = eng.drafter.target_logits(logits)  # [3, V]
    assert torch.equal(full[:, DRAFT_IDS], logits)
    odd = [i for i in range(VOCAB) if i not in DRAFT_IDS]
    assert torch.isneginf(full[:, odd]).all()


@pytest.mark.parametrize("k,overlap", [(1, False), (3, False), (4, True)])
def test_greedy_equals_autoregressive(pair, k, overlap):
    ar = tokens(llm(pair, "none").generate(PROMPTS, GREEDY))
    eng = llm(pair, "reduced", max_draft_length=k, overlap=overlap)
    eng.engine.reset_metrics()
    assert tokens(eng.generate(PROMPTS, GREEDY)) == ar
    total = eng.stats()["total"]
    assert total["drafted_tokens"] > 0 and total["accepted_tokens"] > 0   # speculation really ran
    # alone and reversed: the same tokens
    assert tokens(eng.generate(PROMPTS[2:3], GREEDY)) == ar[2:3]
    assert tokens(eng.generate(PROMPTS[::-1], GREEDY)) == ar[::-1]


def _pairs(eng, n: int, seed0: int, wrap=None) -> np.ndarray:
    """[n, 2] the first two generated tokens of PROMPTS[1] at T=1, top-k 8 (token 2 is drafted: the
    prefill samples token 1 without drafts, the next step drafts one token; a third leaves room for it)."""
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=3, ignore_eos=True, seed=seed0 + i)
              for i in range(n)]
    return np.array([o.token_ids[:2] for o in eng.generate([PROMPTS[1]] * n, params)])


def _off_map_share_p(got: np.ndarray, first: np.ndarray, second: np.ndarray) -> float:
    """Binomial test: the share of x1 the draft cannot propose equals its exact probability."""
    from scipy.stats import binomtest

    off = np.ones(VOCAB, dtype=bool)
    off[DRAFT_IDS] = False
    expected = float(first @ second[:, off].sum(1))
    return binomtest(int(off[got[:, 1]].sum()), len(got), expected).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["layers", "feature"])
def test_rejection_sampling_with_a_reduced_draft_is_exact(pair, tmp_path, kind):
    """x1 (drafted, then accepted or resampled) follows the target's exact conditional given x0
    (chi-square), and the tokens the draft cannot propose come out exactly as often as the target
    says (binomial). A drafter whose probabilities lose the id map (draft index i reported as
    target id i, tokens sampled correctly) fails the binomial test. The draft here is all the
    target's layers on the even ids: q is p restricted to them ("layers"); the feature draft
    (specrt.drafters.feature) also reads the target's features of the prompt it catches up over."""
    tdir, _ = pair
    ddir = save_reduced_draft(tdir, tmp_path / "full", layers=(0, 1, 2), kind=kind, feature_scale=0.05)
    first, second = exact_tables(tdir, PROMPTS[1])
    n = 4000
    spec = SpecConfig(max_draft_length=2, max_batch_size=256, tree="chain")
    eng = specrt.LLM(target=str(tdir), draft=str(ddir), seed=0, spec=spec)
    got = _pairs(eng, n, seed0=1000)
    rate = eng.stats()["total"]["first_token_acceptance_rate"]
    assert 0.15 < rate < 0.95, rate        # both the accept and the residual paths are exercised
    joint = np.zeros((VOCAB, VOCAB))
    np.add.at(joint, (got[:, 0], got[:, 1]), 1)
    assert chisquare_conditional(joint, second)[1] > P_PASS
    assert _off_map_share_p(got, first, second) > P_PASS

    def lose_map(drafter):
        propose = drafter.propose

        def wrapped(*a, **kw):
            p = propose(*a, **kw)
            if p.draft_probs is not None:
                q = torch.zeros_like(p.draft_probs)
                q[..., :len(DRAFT_IDS)] = p.draft_probs[..., DRAFT_IDS]
                p.draft_probs = q
            return p
        drafter.propose = wrapped
        return drafter

    bad = specrt.LLM(target=str(tdir), draft=str(ddir), seed=0, wrap_drafter=lose_map, spec=spec)
    assert _off_map_share_p(_pairs(bad, n, seed0=1000), first, second) < P_FAIL


def test_mismatched_or_broken_folders_are_refused(pair, tmp_path):
    tdir, ddir = pair
    # made for another vocabulary / hidden size
    other = tmp_path / "other"
    other.mkdir()
    raw = json.loads((ddir / "config.json").read_text())
    raw["specrt_draft"] = {**raw["specrt_draft"], "target_vocab_size": VOCAB + 8, "target_hidden_size": 32}
    (other / "config.json").write_text(json.dumps(raw))
    (other / "model.safetensors").write_bytes((ddir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"incompatible[\s\S]*vocab size[\s\S]*hidden size"):
        specrt.LLM(target=str(tdir), draft=str(other))
    # another end-of-sequence id
    eos = tmp_path / "eos"
    eos.mkdir()
    for f in ("config.json", "model.safetensors"):
        (eos / f).write_bytes((ddir / f).read_bytes())
    (eos / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 7}))
    with pytest.raises(ValueError, match="eos_token_id"):
        specrt.LLM(target=str(tdir), draft=str(eos))
    # no weights
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((ddir / "config.json").read_bytes())
    with pytest.raises(ValueError, match="cannot read"):
        specrt.LLM(target=str(tdir), draft=str(empty))
    # a feature draft is the FeatureDrafter's (tests/test_feature_drafter.py), never the ReducedDrafter's
    from specrt.drafters import FeatureDrafter, ReducedDrafter

    feat = save_reduced_draft(tdir, tmp_path / "feat", layers=(2,), kind="feature")
    fd = specrt.LLM(target=str(tdir), draft=str(feat)).engine.drafter
    assert isinstance(fd, FeatureDrafter)
    with pytest.raises(ValueError, match="feature"):
        ReducedDrafter(fd.draft, fd.settings)
    # no acceptance head for policy="head"
    with pytest.raises(ValueError, match="acceptance head"):
        specrt.LLM(target=str(tdir), draft=str(ddir), spec=SpecConfig(policy="head"))


def test_draft_dtype_applies_to_a_reduced_draft(pair):
    tdir, ddir = pair
    eng = specrt.LLM(target=str(tdir), draft=str(ddir), draft_dtype="bfloat16", seed=0)
    assert eng.engine.drafter.model.dtype == torch.bfloat16
    assert tokens(eng.generate(PROMPTS[:2], GREEDY)) == tokens(llm(pair, "none").generate(PROMPTS[:2], GREEDY))


def test_a_quantized_target_lends_its_dequantized_embeddings(pair):
    """target_quantize quantizes the target's embedding table: the draft binds its dequantized rows;
    draft_quantize quantizes the draft's own projections and head."""
    tdir, ddir = pair
    ar = specrt.LLM(target=str(tdir), target_quantize="int8", seed=0)
    sp = specrt.LLM(target=str(tdir), draft=str(ddir), target_quantize="int8", draft_quantize="int8", seed=0,
                    spec=SpecConfig(max_draft_length=3))
    from specrt.models.linear import QuantLinear

    assert isinstance(sp.engine.drafter.model.lm_head, QuantLinear)
    assert tokens(sp.generate(PROMPTS, GREEDY)) == tokens(ar.generate(PROMPTS, GREEDY))
    assert sp.stats()["total"]["accepted_tokens"] > 0


def test_the_shipped_draft_resolves_by_name(monkeypatch, tmp_path):
    from specrt.models import registry

    path = registry.resolve_model("smollm2-135m-draft", "draft")
    assert path == registry.BUILTIN_DIR / "smollm2-draft"
    monkeypatch.setitem(registry.BUILTIN_NAMES, "smollm2-135m-draft", "no-such-folder")
    with pytest.raises(ValueError, match="smollm2-135m-draft.*missing"):
        registry.resolve_model("smollm2-135m-draft", "draft")
