"""A request's output does not depend on its batch neighbours or on which of its prompt blocks
came from the prefix cache: on the CPU every row runs the same linear kernel and the same attention
kernel, whatever the step holds (docs/architecture.md, "Randomness")."""
from pathlib import Path

import pytest
import torch

import specrt
from specrt import SamplingParams, SpecConfig

BUILTIN = Path(specrt.__file__).parent / "builtin"
pytestmark = pytest.mark.skipif(not (BUILTIN / "target" / "config.json").is_file(), reason="built-in model not present")


def _prompts() -> list[list[int]]:
    """Ten prompts of 68-149 tokens that share their first three blocks (48 tokens)."""
    shared = list(range(300, 348))
    return [shared + [(7 * i + 13 * j) % 900 + 20 for j in range(20 + 9 * i)] for i in range(10)]


def _run(llm, prompts, params, together: bool):
    if together:
        return llm.generate(prompts, params)
    return [llm.generate([p], params)[0] for p in prompts]


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_outputs_do_not_depend_on_neighbours_or_the_prefix_cache(draft):
    """Alone, one after another (from the second prompt on, the shared blocks come from the cache and
    the rest is a chunk after a cached prefix) against all at once (steps of up to 512 prompt rows from
    several fresh prompts): the same tokens and the same log-probabilities, bit for bit. Before every
    CPU row took the same kernels, all 10 prompts differed in their log-probabilities (a step
    past 128 rows ran torch's GEMM; fresh prefills and cached-prefix chunks ran two different SDPAs)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    outs = []
    for together in (False, True):
        llm = specrt.LLM(target="builtin", draft=draft, dtype=torch.bfloat16, seed=0,
                         spec=SpecConfig(max_batch_size=16 if together else 1))
        outs.append(_run(llm, prompts, params, together))
    alone, batched = outs
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert a.token_ids == b.token_ids, i
        assert [t.logprob for t in a.logprobs] == [t.logprob for t in b.logprobs], i
        assert [t.top for t in a.logprobs] == [t.top for t in b.logprobs], i


def test_a_cached_prefix_gives_the_rows_a_fresh_prefill_gives():
    """A 260-token prompt whose first 160 tokens (10 blocks) an earlier request cached, against the
    same prompt in an engine with prefix sharing off: the same log-probabilities, bit for bit (before,
    the 100 rows after the cached prefix ran the kernel projections and a masked SDPA over gathered
    blocks, the fresh 260 torch's GEMM and a causal SDPA, and they differed)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompt = [(11 * j + 5) % 3000 + 20 for j in range(260)]
    shared = specrt.LLM(target="builtin", draft=None, dtype=torch.bfloat16, seed=0,
                        spec=SpecConfig(max_batch_size=1))
    shared.generate([prompt[:160] + [5, 6, 7, 8] * 5], params)  # caches the first 10 blocks
    cached = shared.generate([prompt], params)[0]
    fresh = specrt.LLM(target="builtin", draft=None, dtype=torch.bfloat16, seed=0,
                       spec=SpecConfig(max_batch_size=1, prefix_sharing=False)).generate([prompt], params)[0]
    assert cached.token_ids == fresh.token_ids
    assert [t.logprob for t in cached.logprobs] == [t.logprob for t in fresh.logprobs]
    assert [t.top for t in cached.logprobs] == [t.top for t in fresh.logprobs]
