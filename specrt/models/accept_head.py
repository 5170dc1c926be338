"""Acceptance-prediction head for the ``head`` draft-length policy.

A small MLP on the draft's final hidden state (the normed state that feeds the
draft's lm_head) plus the draft's own probability of its proposed token:

    head = AcceptanceHead.load("specrt/builtin/draft/accept_head")
    p_accept = head(hidden, draft_prob)   # hidden [N, H], draft_prob [N] -> [N] in (0, 1)

The policy keeps drafting while the running product of ``p_accept`` stays above
its threshold. Files: ``accept_head.safetensors`` + ``accept_head.json``
(hidden_size, mlp width, feature list, training metrics).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn

WEIGHTS = "accept_head.safetensors"
CONFIG = "accept_head.json"


class AcceptanceHead(nn.Module):
    """logit(P(draft token accepted)) = MLP([norm(hidden), q, log q])."""

    def __init__(self, hidden_size: int, width: int = 128, use_prob: bool = True,
                 metrics: dict | None = None):
        super().__init__()
        self.hidden_size, self.width, self.use_prob = hidden_size, width, use_prob
        self.metrics = dict(metrics or {})
        n_in = hidden_size + (2 if use_prob else 0)
        self.norm = nn.LayerNorm(n_in)
        self.mlp = nn.Sequential(nn.Linear(n_in, width), nn.SiLU(), nn.Linear(width, 1))

    def features(self, hidden: torch.Tensor, draft_prob: torch.Tensor | None) -> torch.Tensor:
        h = hidden.float()  # [N, H]
        if not self.use_prob:
            return h
        if draft_prob is None:
            raise ValueError("draft_prob [N] is required: this head was trained with it")
        q = draft_prob.float().reshape(-1, 1).clamp(1e-6, 1.0)  # [N, 1]
        return torch.cat([h, q, q.log()], dim=-1)  # [N, H+2]

    def logits(self, hidden: torch.Tensor, draft_prob: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H], draft_prob [N] -> logit [N] (float32)."""
        if hidden.dim() != 2 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must be [N, {self.hidden_size}], got {tuple(hidden.shape)}")
        x = self.features(hidden, draft_prob).to(self.mlp[0].weight.dtype)
        return self.mlp(self.norm(x)).squeeze(-1).float()

    def forward(self, hidden: torch.Tensor, draft_prob: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H], draft_prob [N] -> p_accept [N] in (0, 1)."""
        return torch.sigmoid(self.logits(hidden, draft_prob))

    def save(self, path_dir: str) -> None:
        from safetensors.torch import save_file
        os.makedirs(path_dir, exist_ok=True)
        sd = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        save_file(sd, os.path.join(path_dir, WEIGHTS))
        cfg = {"hidden_size": self.hidden_size, "width": self.width, "use_prob": self.use_prob,
               "features": ["hidden (draft final normed state)"] + (["q", "log q"] if self.use_prob else []),
               "output": "sigmoid -> P(draft token accepted)", "metrics": self.metrics}
        with open(os.path.join(path_dir, CONFIG), "w") as f:
            json.dump(cfg, f, indent=2)

    @classmethod
    def load(cls, path_dir: str, device: str | torch.device = "cpu") -> "AcceptanceHead":
        from safetensors.torch import load_file
        with open(os.path.join(path_dir, CONFIG)) as f:
            cfg = json.load(f)
        head = cls(cfg["hidden_size"], cfg["width"], cfg["use_prob"], cfg.get("metrics"))
        head.load_state_dict(load_file(os.path.join(path_dir, WEIGHTS)))
        return head.to(device).eval()
