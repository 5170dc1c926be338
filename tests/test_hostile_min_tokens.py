"""min_tokens that the context cannot hold is refused when the request is made (issue 39, 10)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _engine_utils import pair_for_tests  # noqa: E402

import specrt  # noqa: E402
from specrt import SamplingParams, SpecConfig  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return pair_for_tests(tmp_path_factory)


def test_min_tokens_beyond_the_context_is_refused_by_name(pair):
    """A min_tokens the context cannot hold would end unmet at the context's end: refused up front."""
    tdir, _ = pair
    llm = specrt.LLM(target=str(tdir), draft=None, spec=SpecConfig(max_model_len=64), seed=0)
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate([[5] * 40], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30))
    out = llm.generate([[5] * 40], SamplingParams(temperature=0.0, max_tokens=30, min_tokens=24, ignore_eos=True))
    assert len(out[0].token_ids) >= 23
