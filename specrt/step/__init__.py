"""One speculative step, its parts bottom first (docs/architecture.md, sections 1 and 4):

- ``threads``: the kernels' thread count and the governor that times steps;
- ``calibration``, ``warmup``: measured steps that seed the cost model, warm-up requests;
- ``scheduler``: continuous batching, admission, KV reservation, per-request state (no tensors);
- ``verify``: the verify batch and the accept step; ``prefill``: long prompts a chunk per step;
- ``intake``: request validation; ``overlap``: pre-drafting the next round during the verify;
- ``commit``: keep the accepted tokens, roll back the rest, emit; ``accounting``: a step's costs;
- ``engine``: ``LLMEngine``, which wires them; ``distributed``: the same step over N ranks.
"""
