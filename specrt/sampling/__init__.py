"""How a row's next token is drawn, draft and target rows alike, bottom first:

- ``controls``: a request's logit controls on the host (penalty histories, bans, its grammar's
  state) and the order and definitions of the whole transform and of the log-probabilities;
- ``transform``: the transform of a call's rows (controls, EOS mask, temperature / top-k / top-p /
  min-p) and each row's top-N log-probabilities;
- ``logprobs``: the log-probabilities a step reports, on the device until its one host copy.
"""
