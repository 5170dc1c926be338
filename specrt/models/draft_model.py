"""Draft models that borrow the target's embeddings and a reduced vocabulary head.

Two kinds share one class (``DraftModel``) and one folder format:

* ``"feature"`` — EAGLE-style (Li et al. 2024): at position p the draft reads
  ``fc(concat(embed(x_p), f_{p-1}))`` -> its decoder layer(s) -> final norm, where
  ``f_{p-1}`` is the FEATURE of position p-1: the target's final-normed hidden state,
  i.e. exactly the vector the target's lm_head multiplies at that position
  (``LlamaForCausalLM.forward(..., return_hidden=True)`` returns it). The draft's own
  output at p (also final-normed, the vector its head multiplies) is its prediction of
  f_p and is fed back at p+1 while it drafts ahead of the target. Position 0 reads a zero
  feature.
* ``"layers"`` — a standalone draft: a few target layers on the token embeddings.

The head covers only ``draft_vocab_size`` target tokens (FR-Spec, Zhao et al. 2025):
``draft_to_target[i]`` is the target id of draft logit i, so the draft proposes only those
ids and gives every other token probability zero (``expand_probs``). Its weights are the
target's tied embedding rows of those ids, taken from the target at load time, so a
draft folder stores only its own layers, fc, norm and the id map:

    config.json        architectures ["SpecrtDraftModel"], the layer config (the target's,
                       num_hidden_layers = the draft's depth) and "specrt_draft" (kind,
                       draft_vocab_size, target_* sizes for a compatibility check)
    model.safetensors  [fc.weight [H, 2H]], layers.{i}.*, norm.weight, draft_to_target [N] int64
    generation_config.json   bos / eos / pad ids copied from the target

Engine protocol for feature drafts (no extra target forward; specrt.drafters.feature):

* the target's verify forward returns its final-normed hidden states for every row it is
  fed (``all_hidden=True``: a prefill's prompt rows too, logits only where they are scored);
  after accepting ``a`` drafts, rows 0..a (positions L-1..L+a-1) are the true features of
  the accepted prefix;
* the draft's KV cache holds true-feature keys below ``draft_cached``; a proposal first
  catches up in ONE forward over positions draft_cached..L+a (the bonus token last), fed the
  features of positions draft_cached-1..L+a-1, with ``logits_indices`` = its last row, then
  runs K-1 one-token forwards on its own returned features. Keys its own-feature steps wrote
  are overwritten by the next catch-up (``draft_cached`` = the verified length);
* after a prefill the catch-up needs a feature for every prompt position (all_hidden); a
  position whose feature the request never saw (a shared prefix block) reads zeros.

Example (engine side: one draft step for every request at once)::

    draft = DraftModel.from_pretrained(folder, target)           # binds target embeddings
    logits, feats = draft(input_ids, positions, meta, kv, features=f)   # [L, N], [L, H]
    probs = draft.expand_probs(logits.softmax(-1))               # [L, V] zero off the map
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specrt.models.attention import AttentionMetadata
from specrt.models.config import ModelConfig
from specrt.models.linear import prepare_linear
from specrt.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specrt.models.rope import RMSNorm, RotaryEmbedding, rms_norm, rope_operands

ARCHITECTURE = "SpecrtDraftModel"
KINDS = ("feature", "layers")


@dataclass
class DraftConfig:
    kind: str                  # "feature" | "layers"
    layer_config: ModelConfig  # the decoder layers' config (num_layers = the draft's depth)
    draft_vocab_size: int      # N: rows of the reduced head
    target_vocab_size: int
    target_hidden_size: int
    extra: dict = field(default_factory=dict)  # provenance: init layers, training summary
    feature_layers: tuple[int, ...] | None = None  # EAGLE-3: target layers fused into the feature
                                                   # (num_layers = the final-normed state); None: that alone
    target_num_layers: int | None = None           # with feature_layers: the target's depth

    @property
    def feature_size(self) -> int:
        """Width of the target feature one position hands the draft."""
        return self.target_hidden_size * (1 if self.feature_layers is None else len(self.feature_layers))

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    def to_dict(self) -> dict:
        raw = dict(self.layer_config.extra)
        raw.update(architectures=[ARCHITECTURE], num_hidden_layers=self.layer_config.num_layers)
        raw["specrt_draft"] = {"kind": self.kind, "draft_vocab_size": self.draft_vocab_size,
                               "target_vocab_size": self.target_vocab_size,
                               "target_hidden_size": self.target_hidden_size,
                               "feature": "target final-normed hidden state at the previous position"
                               if self.feature_layers is None else
                               "the outputs of target layers feature_layers at the previous position, "
                               "concatenated (num_layers = the final-normed state), projected by fuse",
                               **self.extra}
        if self.feature_layers is not None:
            raw["specrt_draft"].update(feature_layers=list(self.feature_layers),
                                       target_num_layers=self.target_num_layers)
        return raw

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "DraftConfig":
        spec = raw.get("specrt_draft")
        if raw.get("architectures") != [ARCHITECTURE] or not isinstance(spec, dict):
            raise ValueError(f"{where}: not a specrt draft (architectures {raw.get('architectures')!r}, "
                             f"expected [{ARCHITECTURE!r}] with a 'specrt_draft' section)")
        if spec.get("kind") not in KINDS:
            raise ValueError(f"{where}: specrt_draft.kind {spec.get('kind')!r} not in {KINDS}")
        layer = ModelConfig.from_json({**raw, "architectures": ["LlamaForCausalLM"]})
        known = ("kind", "draft_vocab_size", "target_vocab_size", "target_hidden_size", "feature",
                 "feature_layers", "target_num_layers")
        fl, tl = spec.get("feature_layers"), spec.get("target_num_layers")
        if fl is not None and (spec["kind"] != "feature" or not isinstance(fl, list) or len(fl) < 2
                               or not isinstance(tl, int)
                               or not all(isinstance(i, int) and 0 <= i <= tl for i in fl)):
            raise ValueError(f"{where}: specrt_draft.feature_layers {fl!r} must be a list of >= 2 target "
                             f"layer indices in [0, target_num_layers={tl!r}] (feature drafts only)")
        return cls(kind=spec["kind"], layer_config=layer, draft_vocab_size=int(spec["draft_vocab_size"]),
                   target_vocab_size=int(spec["target_vocab_size"]),
                   target_hidden_size=int(spec["target_hidden_size"]),
                   extra={k: v for k, v in spec.items() if k not in known},
                   feature_layers=None if fl is None else tuple(fl),
                   target_num_layers=None if fl is None else tl)


def is_draft_folder(path) -> bool:
    """True when ``path`` is a folder holding a DraftModel (config.json names SpecrtDraftModel)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("architectures") == [ARCHITECTURE]
    except (json.JSONDecodeError, AttributeError):
        return False


class DraftModel(nn.Module):
    """A feature (EAGLE-style) or layer draft with a reduced-vocabulary head (module docstring)."""

    def __init__(self, config: DraftConfig, draft_to_target: torch.Tensor):
        super().__init__()
        H, lc = config.hidden_size, config.layer_config
        if draft_to_target.shape != (config.draft_vocab_size,):
            raise ValueError(f"draft_to_target {tuple(draft_to_target.shape)} != [{config.draft_vocab_size}]")
        self.config = config
        self.fc = nn.Linear(2 * H, H, bias=False) if config.kind == "feature" else None
        # EAGLE-3: the target's low / middle / high features [k * H_t] projected to H
        self.fuse = nn.Linear(config.feature_size, H, bias=False) if config.feature_layers is not None else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(lc, i) for i in range(lc.num_layers))
        self.norm = RMSNorm(H, lc.rms_norm_eps)
        self.register_buffer("draft_to_target", draft_to_target.to(torch.int64).clone())
        self.rotary = RotaryEmbedding(lc)
        self.embed: torch.Tensor | None = None  # [V, H] the target's embedding (bound, not saved)
        self.head: torch.Tensor | None = None   # [N, H] its rows at draft_to_target
        self.__dict__["_lm"] = None             # causal_lm(), built on first use
        self.__dict__["_mix"] = None            # _mix_calls(), built on first use

    # ------------------------------------------------------------------ binding and I/O
    def bind_target(self, embed_weight: torch.Tensor) -> "DraftModel":
        """Take the input embedding [V, H] and the reduced head (its rows at the id map) from the target."""
        cfg = self.config
        if tuple(embed_weight.shape) != (cfg.target_vocab_size, cfg.target_hidden_size):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} does not match the draft's target "
                             f"[{cfg.target_vocab_size}, {cfg.target_hidden_size}]")
        dtype, dev = self.norm.weight.dtype, self.norm.weight.device
        self.embed = embed_weight.detach().to(dev, dtype)
        self.head = self.embed.index_select(0, self.draft_to_target.to(dev)).contiguous()
        self.__dict__["_lm"] = None
        self.__dict__["_mix"] = None
        return self

    @property
    def lm_config(self) -> ModelConfig:
        """The decoder layers' config (what a paged KV cache for this draft is sized from)."""
        return self.config.layer_config

    def save_pretrained(self, folder, generation_config: dict | None = None, dtype=torch.bfloat16) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        state = {k: (v if k == "draft_to_target" else v.to(dtype)).detach().contiguous().clone()
                 for k, v in self.state_dict().items()}
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        raw = self.config.to_dict()
        raw["torch_dtype"] = str(dtype).replace("torch.", "")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(raw, f, indent=2, sort_keys=True)
        if generation_config is not None:
            with open(os.path.join(folder, "generation_config.json"), "w") as f:
                json.dump(generation_config, f, indent=2)

    @classmethod
    def from_pretrained(cls, folder, target=None, dtype=torch.float32, device="cpu") -> "DraftModel":
        """Load a draft folder; ``target`` (a LlamaForCausalLM or an embedding tensor [V, H]) binds
        the shared embeddings. ValueError for a folder that is not a draft or mismatches the target."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise ValueError(f"draft folder has no config.json: {folder}")
        config = DraftConfig.from_dict(json.loads((folder / "config.json").read_text()), str(folder))
        try:
            state = load_file(str(folder / "model.safetensors"))
        except Exception as e:  # noqa: BLE001 - missing / corrupt file
            raise ValueError(f"cannot read {folder / 'model.safetensors'}: {type(e).__name__}: {e}") from None
        model = cls(config, state["draft_to_target"])
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: draft weights do not match its config: missing {missing[:6]}, "
                             f"unexpected {unexpected[:6]}")
        model = model.to(device=device, dtype=dtype)
        model.draft_to_target = model.draft_to_target.long()
        if target is not None:
            emb = target if isinstance(target, torch.Tensor) else target.model.embed_tokens.weight
            model.bind_target(emb)
        return model.eval().requires_grad_(False)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.embed is not None:  # keep the bound target tensors on the draft's device / dtype
            self.bind_target(self.embed)
        return out

    # ------------------------------------------------------------------ vocabulary map
    def expand_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., N] draft probabilities -> [..., V] over the target vocabulary (zero off the map)."""
        out = probs.new_zeros(*probs.shape[:-1], self.config.target_vocab_size)
        return out.index_copy_(-1, self.draft_to_target, probs) if probs.dim() == 1 else \
            out.scatter_(-1, self.draft_to_target.expand_as(probs), probs)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary indices -> target token ids (same shape)."""
        return self.draft_to_target[draft_ids.long()]

    # ------------------------------------------------------------------ forward
    def embed_inputs(self, input_ids: torch.Tensor, features: torch.Tensor | None,
                     prepared: bool = False) -> torch.Tensor:
        """The residual stream entering layer 0: [..., H] (fc over [embedding, feature] for feature drafts)."""
        if self.embed is None:
            raise RuntimeError("DraftModel: call bind_target() (or from_pretrained(target=...)) first")
        x = F.embedding(input_ids, self.embed)
        if self.fc is None:
            return x
        widths = {x.shape[-1], self.config.feature_size}
        if features is None or features.shape[:-1] != x.shape[:-1] or features.shape[-1] not in widths:
            raise ValueError(f"a feature draft needs features of shape {tuple(x.shape[:-1])} + one of "
                             f"{sorted(widths)}, got {None if features is None else tuple(features.shape)}")
        return self.mix(x, features, prepared)

    def mix(self, x: torch.Tensor, features: torch.Tensor, prepared: bool = False) -> torch.Tensor:
        """fc(concat(x, f)) [..., H]: ``features`` are the target's (fused by ``fuse`` when the draft
        reads several layers, [..., feature_size]) or the draft's own states [..., H]. ``prepared``:
        fuse and fc on specrt's small-M kernel (the paged forward; no autograd)."""
        f = features.to(x.dtype)
        fuse, fc = self._mix_calls() if prepared else (self.fuse, self.fc)
        if self.fuse is not None and f.shape[-1] == self.fuse.in_features and f.shape[-1] != x.shape[-1]:
            f = fuse(self.normalize_layers(f))
        return fc(torch.cat([x, f], -1))

    def _mix_calls(self):
        """(fuse or None, fc) as prepared projections under the causal LM's kernel policy (specrt's
        small-M kernel, cheaper than torch's GEMV on these small matrices). Built once per binding."""
        calls = self.__dict__.get("_mix")
        if calls is None:
            policy = self.causal_lm().linear_policy
            calls = (prepare_linear(self.fuse, policy) if self.fuse is not None else None,
                     prepare_linear(self.fc, policy))
            self.__dict__["_mix"] = calls
        return calls

    def normalize_layers(self, f: torch.Tensor) -> torch.Tensor:
        """[..., k H_t]: each inner layer's block RMS-normalised (no weight: residual streams carry
        outliers of 10^4 at the first positions); the final-normed block as it is (scale 1)."""
        cfg = self.config
        blocks = f.unflatten(-1, (len(cfg.feature_layers), cfg.target_hidden_size))   # [..., k, H_t]
        scale = torch.rsqrt(blocks.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(f.dtype)
        final = [j for j, li in enumerate(cfg.feature_layers) if li == cfg.target_num_layers]
        if final:
            scale = scale.clone() if scale.requires_grad else scale   # rsqrt's backward reads its output
            scale[..., final, :] = 1
        return (blocks * scale).flatten(-2)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits [..., N] of final-normed states h [..., H]."""
        return F.linear(h, self.head)

    def causal_lm(self) -> LlamaForCausalLM:
        """The engine's view of this draft: a LlamaForCausalLM over the draft's own layers and norm,
        the bound target embedding (shared, not copied) and the reduced head as its lm_head [N, H],
        so a paged forward runs specrt's decode path (fused ops, small-M projections) and returns
        logits over the draft vocabulary. Built once per binding (``bind_target`` / ``.to()`` rebuild)."""
        lm = self.__dict__.get("_lm")  # kept out of the module tree: no second copy in state_dict
        if lm is not None:
            return lm
        if self.embed is None:
            raise RuntimeError("DraftModel: call bind_target() (or from_pretrained(target=...)) first")
        cfg = dataclasses.replace(self.config.layer_config, tie_word_embeddings=False)
        with torch.device("meta"):
            lm = LlamaForCausalLM(cfg)
            head = nn.Linear(self.config.hidden_size, self.config.draft_vocab_size, bias=False)
        lm.model.embed_tokens = nn.Embedding.from_pretrained(self.embed, freeze=True)
        lm.model.layers, lm.model.norm = self.layers, self.norm
        head.weight = nn.Parameter(self.head, requires_grad=False)
        lm.lm_head = head
        lm.rotary = self.rotary
        self.__dict__["_lm"] = lm.eval()
        return lm

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, features: torch.Tensor | None = None,
                logits_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over a mixed batch through the paged KV cache (``causal_lm``'s forward).

        input_ids [T] int64; positions [T] int64; features [T, H] (feature drafts: the feature of
        each row's PREVIOUS position, zeros at position 0); kv_cache [layers, 2, num_blocks,
        block_size, kv_heads, head_dim] written at meta.slot_mapping; logits_indices [L] rows to
        return (default all). Returns (logits [L, N] float32 over the draft vocabulary,
        features [L, H]: the draft's final-normed states, to feed back at the next position).
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [T]")
        lm = self.causal_lm()
        x = self.embed_inputs(input_ids, features, prepared=True) if self.fc is not None else None  # [T, H]
        return lm(input_ids, positions, meta, kv_cache, logits_indices=logits_indices, return_hidden=True,
                  inputs_embeds=x)

    def dense_layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    past: list[tuple[torch.Tensor, torch.Tensor]] = (), mask: torch.Tensor | None = None):
        """Layer i on a dense batch (training; no KV cache): x [B, T, H]; cos/sin [T, 1, D] from
        rope_operands; ``past`` earlier (k, v) [B, S, Hkv, D] prepended to this call's keys;
        mask [T, S + T] bool (None = causal over this call's T tokens). Returns (x, (k, v))."""
        layer = self.layers[i]
        a, lc = layer.self_attn, self.config.layer_config
        B, T, _ = x.shape
        H, Hkv, D = lc.num_heads, lc.num_kv_heads, lc.head_dim
        h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = a.q_proj(h).view(B, T, H, D), a.k_proj(h).view(B, T, Hkv, D), a.v_proj(h).view(B, T, Hkv, D)
        q = q * cos + torch.roll(q, D // 2, -1) * sin  # RoPE (sin's first half negated: rope_operands)
        k = k * cos + torch.roll(k, D // 2, -1) * sin
        keys = torch.cat([p[0] for p in past] + [k], 1) if past else k
        vals = torch.cat([p[1] for p in past] + [v], 1) if past else v
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
                                           vals.transpose(1, 2).to(q.dtype), attn_mask=mask,
                                           is_causal=mask is None, scale=a.scale, enable_gqa=H != Hkv)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, T, H * D))
        h2 = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        m = layer.mlp
        return x + m.down_proj(m.act(m.gate_proj(h2)) * m.up_proj(h2)), (k, v)

    def dense_rope(self, seq_len: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin [T, 1, D] for positions 0..seq_len-1 (dense_layer's operands)."""
        pos = torch.arange(seq_len, device=device)
        return rope_operands(*self.rotary.cos_sin(pos, dtype, seq_len))

    def forward_dense(self, input_ids: torch.Tensor, features: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced dense forward (training / offline evaluation): input_ids [B, T] from
        position 0, features [B, T, H] as in ``forward``. Returns (logits [B, T, N], states [B, T, H])."""
        x = self.embed_inputs(input_ids, features)
        cos, sin = self.dense_rope(x.shape[1], x.dtype, x.device)
        for i in range(len(self.layers)):
            x, _ = self.dense_layer(i, x, cos, sin)
        h = rms_norm(x, self.norm.weight, self.norm.eps)
        return self.logits(h), h


def check_draft_target(config: DraftConfig, draft_to_target: torch.Tensor, target_config: ModelConfig,
                       draft_generation: dict, target_generation: dict, where: str = "draft") -> None:
    """ValueError listing every way the draft does not fit the target: the embedding it binds
    ([target_vocab_size, target_hidden_size]), its id map (ascending, unique, inside the target's
    vocabulary) and the bos / eos ids both folders declare."""
    diffs = []
    if config.target_vocab_size != target_config.vocab_size:
        diffs.append(f"vocab size: the draft was made for {config.target_vocab_size}, the target has "
                     f"{target_config.vocab_size}")
    if config.target_hidden_size != target_config.hidden_size:
        diffs.append(f"hidden size: the draft was made for {config.target_hidden_size}, the target has "
                     f"{target_config.hidden_size}")
    ids = draft_to_target.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_config.vocab_size
                        or not bool((ids[1:] > ids[:-1]).all())):
        diffs.append(f"draft_to_target must be ascending unique ids in [0, {target_config.vocab_size})")
    for key in ("bos_token_id", "eos_token_id"):
        d, t = draft_generation.get(key), target_generation.get(key)
        as_set = lambda v: set(v) if isinstance(v, list) else {v}  # noqa: E731
        if d is not None and t is not None and as_set(d) != as_set(t):
            diffs.append(f"{key}: target {t} != draft {d}")
    if diffs:
        raise ValueError(f"{where} is incompatible with the target:\n  - " + "\n  - ".join(diffs))


def load_draft_for_target(folder, target, target_generation: dict, dtype=None, device="cpu",
                          quantize: str | None = None) -> DraftModel:
    """A draft folder ready for the engine: checked against ``target`` (a LlamaForCausalLM), bound
    to its embeddings, in ``dtype`` (None: the target's; "auto": the folder's torch_dtype) and,
    with ``quantize``, its projections and head weight-only quantized (specrt.models.quant)."""
    from specrt.models.loader import resolve_dtype
    from specrt.models.quant import quantize_model_

    folder = Path(folder)
    if not is_draft_folder(folder):
        raise ValueError(f"{folder} is not a specrt draft folder (config.json with architectures [{ARCHITECTURE!r}])")
    raw = json.loads((folder / "config.json").read_text())
    config = DraftConfig.from_dict(raw, str(folder))
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    dt = target.dtype if dtype is None else resolve_dtype(dtype, config.layer_config)
    draft = DraftModel.from_pretrained(folder, None, dtype=dt, device=device)
    check_draft_target(config, draft.draft_to_target, target.config, gen, target_generation, f"draft {folder}")
    draft.bind_target(target_embedding(target))
    if quantize is not None:
        quantize_model_(draft.causal_lm(), quantize, embeddings=False)
    return draft


def target_embedding(target) -> torch.Tensor:
    """The target's token embedding [V, H]: its weight, or a quantized table's rows dequantized."""
    emb = target.model.embed_tokens
    if isinstance(emb, nn.Embedding):
        return emb.weight
    ids = torch.arange(emb.num_embeddings, device=target.device)
    return emb(ids)  # QuantEmbedding: dequantized rows in the target's dtype
