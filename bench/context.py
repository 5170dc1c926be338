"""One benchmark run's shared state: the model pair, its prompts, the drafters compared, and the
engines built so far (one per configuration, all sharing the loaded weights)."""
from __future__ import annotations

import json

import torch

from bench.models import model_dir
from bench.runner import make_llm, shared_loader
from bench.workloads import CATEGORIES, Settings, build_prompts


class BenchContext:
    def __init__(self, target: str, draft: str, device, settings: Settings, log=print, note: str = ""):
        from specrt.drafters import parse_draft
        from specrt.models import load_config, load_tokenizer

        self.target, self.draft, self.device, self.s, self.log = target, draft, device, settings, log
        self.note = note
        self.llms: dict = {}         # (draft, misalign, spec) -> LLM, built on first use
        self.weights: dict = {}      # loaded models shared by every engine of this run
        self.tokenizer = load_tokenizer(model_dir(target, "target"))
        self.prompts = build_prompts(self.tokenizer, settings.prompts_per_category, settings.max_prompt_tokens)
        self.target_config = load_config(model_dir(target, "target"))   # a folder or a GGUF file
        self.self_layers = max(1, self.target_config.num_layers // 3)
        self.has_draft_model = parse_draft(draft).loads_model
        self.drafters = {}           # display name -> draft= argument; n-gram and self:N always run
        if self.has_draft_model:
            self.drafters["model"] = draft
        self.drafters["ngram"] = "ngram"
        self.drafters[f"self:{self.self_layers}"] = f"self:{self.self_layers}"
        self.main_drafter = "model" if self.has_draft_model else f"self:{self.self_layers}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def llm(self, draft, misalign: dict | None = None, **spec_kw):
        """The (cached) LLM for this drafter and SpecConfig, warmed up."""
        import specrt

        spec_kw.setdefault("max_batch_size", 32)
        # a KV cache sized for the benchmark, not for the model's full context (allocation time on CPU)
        longest = self.s.max_prompt_tokens + max(self.s.max_tokens, self.s.batch_max_tokens * 3 // 2 + 1) + 64
        spec_kw.setdefault("max_model_len", min(self.target_config.max_model_len, longest))
        if self.torch_device.type == "cuda" and "kv_cache_budget" not in spec_kw:
            # a byte budget sized for the benchmark: the default (a fraction of FREE memory) would
            # shrink with every engine this harness keeps alive
            spec_kw["kv_cache_budget"] = self._kv_bytes(draft, spec_kw["max_batch_size"], spec_kw["max_model_len"])
        key = (draft, json.dumps(misalign, sort_keys=True), json.dumps(spec_kw, sort_keys=True))
        if key not in self.llms:
            llm = make_llm(self.target, draft, specrt.SpecConfig(**spec_kw), self.device, misalign=misalign,
                           model_loader=shared_loader(self.weights))
            llm.warmup(2, 8)
            self.llms[key] = llm
        return self.llms[key]

    def _kv_bytes(self, draft, max_batch_size: int, max_model_len: int) -> int:
        from specrt.drafters import parse_draft
        from specrt.models.kv_cache import kv_bytes_per_block
        from specrt.models import load_config

        configs = [self.target_config]
        spec = parse_draft(draft)
        if spec.loads_model:          # the model's own name, without a "+suffix" / "+ngram" lookup
            configs.append(load_config(model_dir(spec.source, "draft")))
        blocks = max_batch_size * (max_model_len // 16 + 2) + 64
        return int(blocks * kv_bytes_per_block(configs, 16, torch.bfloat16) * 2)

    def params(self, temperature=0.0, max_tokens=None, seed=1234, **controls):
        """Sampling parameters of the benchmark's requests (fixed length and seed); ``controls``:
        further SamplingParams fields (penalties, min_p, logit_bias)."""
        import specrt

        return specrt.SamplingParams(temperature=temperature, max_tokens=max_tokens or self.s.max_tokens,
                                     ignore_eos=True, seed=seed, **controls)

    def pool(self) -> list[list[int]]:
        """Every prompt's token ids, category after category."""
        return [p.token_ids for cat in CATEGORIES for p in self.prompts[cat]]

    def sweep_prompts(self) -> list[list[int]]:
        n = self.s.sweep_prompts_per_category
        return [p.token_ids for cat in CATEGORIES for p in self.prompts[cat][:n]]
