"""The ``peer`` section: Hugging Face transformers greedy ``generate`` and assisted generation
(``assistant_model=draft``, ``num_assistant_tokens=K``, constant schedule) on the same weights
and prompt token ids as specrt, timed in the same alternating comparison."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from bench.models import model_dir
from bench.runner import compare, strip_ids
from bench.workloads import pick


@dataclass
class _Output:
    token_ids: list[int]


@dataclass
class _Device:
    """What the comparison asks of a mode's engine: where it runs, a metrics reset and a history reset."""

    device: torch.device

    def reset_metrics(self) -> None:
        pass

    def forget_outputs(self) -> None:
        pass


class HFGenerator:
    """A transformers model as a comparison mode (greedy, exactly max_new_tokens per prompt)."""

    def __init__(self, model, assistant, device, max_new_tokens: int):
        self.model, self.assistant, self.n = model, assistant, max_new_tokens
        self.engine = _Device(device)

    def generate(self, prompts, params=None) -> list[_Output]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p], device=self.engine.device)
            kw = dict(max_new_tokens=self.n, min_new_tokens=self.n, do_sample=False,
                      attention_mask=torch.ones_like(ids))
            if self.assistant is not None:
                kw["assistant_model"] = self.assistant
            with torch.no_grad():
                g = self.model.generate(ids, **kw)
            outs.append(_Output(g[0, len(p):].tolist()))
        return outs

    def stats(self) -> dict:
        return {"total": {}}


def _load_hf(ctx, dev, K: int):
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    major_minor = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    dkw = {"dtype": dtype} if major_minor >= (4, 56) else {"torch_dtype": dtype}
    hf_t = AutoModelForCausalLM.from_pretrained(str(model_dir(ctx.target, "target")), **dkw).to(dev).eval()
    hf_d = AutoModelForCausalLM.from_pretrained(str(model_dir(ctx.draft, "draft")), **dkw).to(dev).eval()
    for m in (hf_t, hf_d):
        m.generation_config.eos_token_id = None     # like ignore_eos: always max_tokens tokens
        m.generation_config.pad_token_id = 0
    hf_d.generation_config.num_assistant_tokens = K
    hf_d.generation_config.num_assistant_tokens_schedule = "constant"
    if hasattr(hf_d.generation_config, "assistant_confidence_threshold"):
        hf_d.generation_config.assistant_confidence_threshold = 0.0
    return hf_t, hf_d


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical sequences and the mean fraction of each sequence before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n / max(len(x), 1))
    return {"identical_sequences": same, "of": len(a),
            "mean_common_prefix_fraction": sum(prefix) / len(prefix) if prefix else float("nan")}


def section_peer(ctx) -> dict:
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError as e:
        return {"skipped": f"transformers is not installed ({e}); pip install 'transformers>=4.45'"}
    if not ctx.has_draft_model:
        return {"skipped": "the peer comparison needs a draft model folder"}
    K, dev = ctx.s.draft_length, ctx.torch_device
    hf_t, hf_d = _load_hf(ctx, dev, K)
    prompts = pick(ctx.pool(), ctx.s.peer_prompts)
    hf_greedy = HFGenerator(hf_t, None, dev, ctx.s.max_tokens)
    hf_assisted = HFGenerator(hf_t, hf_d, dev, ctx.s.max_tokens)
    hf_greedy.generate([prompts[0]])        # warm-up
    hf_assisted.generate([prompts[0]])
    modes = {"ar": (ctx.llm(None), ctx.params()),
             "spec": (ctx.llm(ctx.draft, max_draft_length=K), ctx.params()),
             "hf_greedy": (hf_greedy, None), "hf_assisted": (hf_assisted, None)}
    res = compare(modes, prompts, ctx.s.repeats)
    ids = {k: v["token_ids"] for k, v in res.items()}
    tps = {k: v["tokens_per_s"] for k, v in res.items()}
    return {"transformers_version": transformers.__version__, "draft_length": K, "modes": strip_ids(res),
            "ratio_spec_vs_hf_assisted": tps["spec"] / tps["hf_assisted"],
            "ratio_ar_vs_hf_greedy": tps["ar"] / tps["hf_greedy"],
            "hf_assisted_speedup_over_hf_greedy": tps["hf_assisted"] / tps["hf_greedy"],
            "identity": {"spec_vs_hf_assisted": agreement(ids["spec"], ids["hf_assisted"]),
                         "spec_vs_hf_greedy": agreement(ids["spec"], ids["hf_greedy"]),
                         "ar_vs_hf_greedy": agreement(ids["ar"], ids["hf_greedy"]),
                         "spec_vs_ar": agreement(ids["spec"], ids["ar"])}}
