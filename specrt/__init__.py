"""specrt: a speculative-decoding runtime.

A small draft (a model, an n-gram table, or the target's own first layers)
proposes K tokens; the target scores all K+1 positions in one forward pass;
fused kernels keep the longest valid prefix with exact accept/reject sampling.

    >>> import specrt
    >>> llm = specrt.LLM(target="builtin", draft="builtin")
    >>> out = llm.generate(["def fib(n):"], specrt.SamplingParams(max_tokens=32))
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "specrt.llm",
    "SpecConfig": "specrt.config",
    "SamplingParams": "specrt.config",
    "RequestOutput": "specrt.step.scheduler",
    "LLMEngine": "specrt.step.engine",
}


def __getattr__(name: str):
    # Lazy so that `import specrt` (and specrt.ops in the tests) stays light.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specrt' has no attribute {name!r}")
