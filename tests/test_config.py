"""SpecConfig and SamplingParams validate every field at construction, naming it (issue 14,
defects 1 and 9): a bad value is refused where it is given, not later by every request."""
from __future__ import annotations

import math

import pytest

from specrt.config import SamplingParams, SpecConfig

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field,value", [
    ("max_model_len", -5), ("max_model_len", 0), ("max_model_len", 1), ("max_model_len", 2 ** 31),
    ("max_model_len", 64.0), ("max_model_len", True),
    ("min_draft_length", -1), ("min_draft_length", 1.5), ("max_draft_length", 65), ("max_draft_length", "4"),
    ("confidence_threshold", NAN), ("confidence_threshold", 1.5), ("confidence_threshold", True),
    ("confidence_threshold", "0.3"),
    ("acceptance_window", 0), ("acceptance_window", 2 ** 40),
    ("adaptive_enabled", 1), ("adaptive_enabled", "yes"), ("overlap", None), ("prefix_sharing", 0),
    ("policy", "magic"), ("policy", None), ("acceptance", "greedy"),
    ("max_batch_size", 0), ("max_batch_size", 2 ** 31), ("block_size", 0), ("block_size", 2 ** 20),
    ("kv_cache_budget", 0), ("kv_cache_budget", -1), ("kv_cache_budget", NAN), ("kv_cache_budget", INF),
    ("kv_cache_budget", 1.5), ("kv_cache_budget", True), ("kv_cache_budget", 2 ** 63),
    ("lookup", "trie"), ("lookup", 3), ("threads", 0), ("threads", 1.5), ("adaptive_threads", "yes"),
])
def test_spec_config_rejects_bad_fields_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        SpecConfig(**{field: value})


def test_spec_config_valid_edges():
    assert SpecConfig(max_model_len=2).max_model_len == 2
    assert SpecConfig(max_model_len=None).max_model_len is None
    assert SpecConfig(min_draft_length=0, max_draft_length=0).max_draft_length == 0
    assert SpecConfig(max_draft_length=64, min_draft_length=64).min_draft_length == 64
    assert SpecConfig(confidence_threshold=0).confidence_threshold == 0
    assert SpecConfig(kv_cache_budget=1.0).kv_cache_budget == 1.0
    assert SpecConfig(kv_cache_budget=12345).kv_cache_budget == 12345
    with pytest.raises(ValueError, match="min_draft_length"):
        SpecConfig(min_draft_length=5, max_draft_length=4)


def test_sampling_params_message_names_range():
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[-1, 2147483647\]"):
        SamplingParams(top_k=2 ** 31)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-math.inf)
