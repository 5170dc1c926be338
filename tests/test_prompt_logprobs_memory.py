"""Hostile-run defect 4 (issue 39): prompt log-probabilities in bounded memory. A 4,000-token
prompt over a 32,768-token vocabulary would need a [T, V] float matrix of 0.5 GB (and its
log-softmax copies); the engine scores PROMPT_LOGPROB_ROWS rows at a time and keeps only the
top-N. Peak RSS is measured in a fresh process (the kernel's high-water mark VmHWM, reset just
before the request), against the same request with the chunking switched off, which must blow
the bound (the test has power)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BOUND_MB = 200

PROBE = r'''
import gc, json, sys
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from _engine_utils import _tokenizer
import specrt
import specrt.sampling.logprobs
from specrt import SamplingParams, SpecConfig
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)
tdir = Path(sys.argv[2]) / "target"
if not tdir.exists():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).eval().save_pretrained(str(tdir), safe_serialization=True)
    _tokenizer(tdir)
if len(sys.argv) > 3:
    specrt.sampling.logprobs.PROMPT_LOGPROB_ROWS = int(sys.argv[3])
llm = specrt.LLM(target=str(tdir), draft=None, spec=SpecConfig(max_batch_size=1), seed=0)
params = SamplingParams(max_tokens=1, prompt_logprobs=20)
llm.generate([[5] * 300], params)
gc.collect()

def status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

before = status_kb("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                        # VmHWM := VmRSS
out = llm.generate([list(range(3, 96)) * 43], params)[0]
peak = status_kb("VmHWM")
top = out.prompt_logprobs[-1].top
print(json.dumps({"rows": len(out.prompt_logprobs), "top": len(top), "peak_mb": (peak - before) // 1024}))
'''


def _peak(tmp: Path, *extra: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, str(HERE), str(tmp), *extra], capture_output=True, text=True,
                       timeout=600, cwd=tmp)       # (the installed specrt, not a checkout's source tree)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resetting VmHWM is Linux's")
def test_prompt_logprobs_of_a_long_prompt_stay_within_a_bounded_peak(tmp_path):
    got = _peak(tmp_path)
    assert got["rows"] == 3999 and got["top"] >= 20
    assert got["peak_mb"] < BOUND_MB, got
    whole = _peak(tmp_path, str(10 ** 9))          # every prompt row's logits at once
    assert whole["peak_mb"] > 2 * BOUND_MB, whole
