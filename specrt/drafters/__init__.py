"""Drafters propose K tokens per request for the target to verify.

- ``model``: a separate small model sharing the target's vocabulary (its own KV cache,
  same block tables as the target).
- ``ngram``: prompt lookup in the request's own context; no model.
- ``self:N``: the target's first N layers plus its final norm and head, reading and
  writing the target's own KV cache for those layers (nothing duplicated).

The drafting loop itself lives in specrt.engine (it shares the engine's batch state);
this package holds what is specific to each kind.
"""
from specrt.drafters.ngram import NgramProposer

__all__ = ["NgramProposer"]
