"""specrt's benchmarks (a source-checkout package, not part of the installed runtime).

End to end (``python -m bench`` / ``specrt bench``):
  workloads  settings and prompts (held-out stdlib modules, free text)
  models     the model pair (or a random one), random-weight Llama shapes
  runner     engines through specrt's public hooks, timed generation, paired comparisons
  costs      single-forward step costs and the speedup they predict
  context    one run's shared state (prompts, drafters, engines)
  sections   one function per section, and run_all
  peer       the transformers comparison
  report     results.json, report.md, the headline; plots: the PNGs
  cost_curve random-weight Llama-shaped cost curves
  cli        argument parsing
Standalone scripts: kernels.py (kernel ops, with an ``attention`` section from attention.py),
attention.py, serve.py (the HTTP server under load), gpu_check.sh (the one GPU script).
"""
