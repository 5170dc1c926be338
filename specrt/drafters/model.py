"""A separate small draft model sharing the target's vocabulary (or a prefix of it).

Its KV cache shares the target's block tables (same token positions). The draft's KV may lag
behind the target's (it did not draft for a while, or reused a target-only prefix block): the
first draft forward of a step then feeds the whole uncached tail (its catch-up) together with
the pending token. Drafting runs on its own CUDA stream so it overlaps other work; the
verification waits for it with an event, not a host sync.

``ModelDrafterBase`` drafts chains and trees with a network; ``ModelDrafter`` adds pre-drafting
(specrt.drafters.predraft), which every network drafter has but the feature draft.
"""
from __future__ import annotations

import itertools
import time
from contextlib import nullcontext
from typing import Callable

import torch

from specrt import ops
from specrt.config import SamplingParams
from specrt.drafters.base import (DraftAsk, DraftCost, Drafter, DraftLimits, DraftProposal, DraftSettings, History,
                                  StopRule)
from specrt.drafters.lookup import PromptLookup, fill_lookup_rows, forced_drafts
from specrt.drafters.predraft import ModelPreDrafting
from specrt.drafters.size import module_bytes
from specrt.drafters.tree import draft_tree
from specrt.models.attention import AttentionMetadata
from specrt.sampling.transform import apply_controls, batch_controls, mask_eos, param_rows, probs_from_logits


class ModelDrafterBase(Drafter, History):
    """A draft network's chains and trees (``ModelDrafter`` below is the one with pre-drafting)."""

    name = "model"
    cache_name = "draft"      # which cache of the PagedKVCache it reads and writes
    grows_trees = True

    def __init__(self, model, settings: DraftSettings, accept_head=None, num_layers: int | None = None,
                 lookup: PromptLookup | None = None):
        """``lookup``: drafts first, rows it matches skip the model (draft="MODEL+ngram", SpecConfig.lookup)."""
        self.model = model
        self.settings = settings
        self.accept_head = accept_head        # policy="head": P(accept) from the draft's hidden state
        self.num_layers = num_layers          # run only the first N layers (None: all)
        # research hook (the misaligned-sampling study): the sampling parameters of a request's DRAFT
        # rows; None = the request's own (anything else lowers acceptance; the output stays exact)
        self.draft_params: Callable[[SamplingParams], SamplingParams] | None = None
        self.kv = None
        dev = settings.device
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        # one pair of timing events around each step's drafting, made once (read after the step's sync)
        self._events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        if self._stream is not None else None)
        self.attended = 0             # context positions the last draft forward attended (all rows)
        self.lookup = lookup
        self.name = f"{self.name}+{lookup.name}" if lookup is not None else self.name   # e.g. "self+ngram"

    # -- what the engine asks
    def cache_configs(self) -> dict:
        return {"draft": self.model.config}

    def size_bytes(self) -> int | None:
        """Bytes of the draft model's weights (its quantized storage where it is quantized)."""
        return module_bytes(self.model)

    def bind(self, kv) -> None:
        self.kv = kv

    def cached(self, r) -> int:
        """Positions whose KV this drafter can read for request r."""
        return r.draft_cached

    def step_model(self) -> tuple[torch.nn.Module, int | None]:
        return self.model, self.num_layers

    def limit(self, batch, max_ks: list[int]) -> DraftLimits:
        return DraftLimits(list(max_ks), catchup=self.catchup(batch))

    def catchup(self, batch) -> list[int]:
        """Tokens each request's draft must consume before it can draft: the KV lag (its prompt, the first time)."""
        return [max(r.context_len - 1 - r.draft_cached, 0) for r in batch]

    def propose(self, batch, ask: DraftAsk) -> DraftProposal:
        B, dev = len(batch), self.settings.device
        if ask.tree is not None:       # a dynamic tree per request (specrt.drafters.tree), on the draft stream
            self._take_earlier(batch, ask.ks, range(B))     # a tree never proposes drafts made earlier
            with self._on_stream():
                proposal = draft_tree(self, batch, ask.nodes, ask.ks, ask.tree)
            if self._stream is not None:   # verification waits for the drafts (an event, no host sync)
                torch.cuda.current_stream(dev).wait_stream(self._stream)
            return proposal
        ks = ask.ks
        K = max(ks) if ks else 0
        if K == 0:
            self._take_earlier(batch, ks, range(B))        # drafts made earlier are for this step only
            return DraftProposal(torch.full((B, 0), -1, dtype=torch.int32, device=dev), [0] * B, None,
                                 [r.draft_cached for r in batch])
        t0 = time.perf_counter()
        with self._on_stream():
            if self._events is not None:
                self._events[0].record()
            proposal = self._draft(batch, ks, K, ask.stop_rule)
            if self._events is not None:
                self._events[1].record()
        if self._stream is not None:   # verification waits for the drafts (an event, no host sync)
            torch.cuda.current_stream(dev).wait_stream(self._stream)
        proposal.cost.seconds = time.perf_counter() - t0   # host time; on CUDA the events give the device's
        proposal.cost.events = self._events
        return proposal

    def on_finish(self, request) -> None:
        if self.lookup is not None:
            self.lookup.finished(request)

    def forget_outputs(self) -> None:
        if self.lookup is not None:
            self.lookup.forget_outputs()

    def source_stats(self) -> dict | None:
        return self.lookup.source_stats() if self.lookup is not None else None

    def on_commit(self, request, row: int, proposal: DraftProposal) -> int | None:
        """The lookup in front learns what its drafts got accepted (every subclass: not overridden),
        then ``kept`` says how much of the draft KV stays valid."""
        if self.lookup is not None:
            self.lookup.committed(request, row, proposal)
        return self.kept(request, row, proposal)

    def kept(self, request, row: int, proposal: DraftProposal) -> int | None:
        """Draft KV positions still valid after the verify: only what the target accepted (a
        pre-draft's positions: specrt.drafters.predraft, settle)."""
        return min(proposal.draft_cached[row], request.target_cached)

    # -- vocabulary (a draft whose vocabulary differs maps here)
    def draft_input_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids [T] -> the draft model's input ids."""
        return token_ids

    def target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [rows, V_draft] over the target's vocabulary [rows, V]: a draft
        vocabulary padded to the target's gives the extra ids -inf."""
        V = self.settings.vocab_size
        if logits.shape[1] < V:
            pad = logits.new_full((logits.shape[0], V - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], 1)
        return logits

    # -- the drafting loop
    def _on_stream(self, after=None):
        """The draft stream, after everything enqueued on the main stream so far (or, ``after``,
        only after that event)."""
        if self._stream is None:
            return nullcontext()
        if after is None:
            self._stream.wait_stream(torch.cuda.current_stream(self.settings.device))
        else:
            self._stream.wait_event(after)
        return torch.cuda.stream(self._stream)

    def _take_earlier(self, batch, ks: list[int], skip) -> dict[int, tuple]:
        """Drafts made for this step in an earlier one, forgotten for every request (they are for
        this step only): {row: (n, draft_token_ids [n], draft_probs [n, V] or None)} for the rows
        not in ``skip`` that propose them. None here; a pre-drafting drafter keeps some
        (specrt.drafters.predraft)."""
        return {}

    def _step_features(self, reqs, starts: list[int] | None, prev_hidden, sel) -> torch.Tensor | None:
        """Extra inputs of a draft forward (feature drafts): [rows' tokens, H] or None. The first
        forward of a step (``starts``: each row's first fed position) or a later one (``prev_hidden``
        [previous rows, H] of the last forward, ``sel`` its rows of this one)."""
        return None

    def _run_model(self, input_ids, positions, meta, last, features):
        """The draft network over one batch: (logits [rows, V_draft] at ``last``, hidden or None)."""
        return self.model(self.draft_input_ids(input_ids), positions, meta, self.kv[self.cache_name],
                          num_layers=self.num_layers, logits_indices=last,
                          return_hidden=self.accept_head is not None)

    def _forward(self, reqs, input_ids: torch.Tensor, seq_lens: list[int], query_lens: list[int],
                 out_index: list[int], host_ids: list[int] | None = None, history: tuple | None = None,
                 write: bool = True, features: torch.Tensor | None = None, positions: list[int] | None = None,
                 tree_mask: list[int] | None = None, every_row: bool = False, raw: bool = False):
        """One batched draft forward; returns (q [rows, V] f32, logits [rows, V], hidden or None) at each
        row's last position. ``host_ids``: the rows' tokens when they may recompute blocks shared
        between requests (catch-up over a target-only prefix): each shared slot is then written once.
        ``history`` (BatchControls, rows' batch indices, rows' draft offsets, drafts [B, W]): the
        logit controls, each row seeing its request's drafts before it (None: no request has any).
        ``write`` False: the new tokens' K/V are not stored (their slots already hold them).
        ``features`` [T, H]: what ``_step_features`` gave (feature drafts). A tree level
        (specrt.drafters.tree): ``positions`` [T] of the rows (else the slots'), their ``tree_mask``
        [T], and ``every_row``: q / logits at every row (else at each request's last). ``raw``: no
        controls apply (``raw_logits_ok``): return (None, the network's logits [rows, V_draft], hidden),
        whose column i is target token ``draft_token_ids(i)``."""
        dev, kv = self.settings.device, self.kv
        if positions is None:
            positions = [p for s, q in zip(seq_lens, query_lens) for p in range(s - q, s)]
        positions = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        meta = AttentionMetadata.build(seq_lens, query_lens, [kv.block_table(r.request_id) for r in reqs],
                                       kv.block_size, dev, token_ids=host_ids, window=self.settings.kv_window,
                                       write=write, tree_mask=tree_mask)
        self.attended = sum(meta.seq_lens_host)
        if every_row:
            last = torch.arange(sum(query_lens), dtype=torch.int64, device=dev)
            reqs = [r for r, q in zip(reqs, query_lens) for _ in range(q)]
        else:
            last = torch.tensor(list(itertools.accumulate(query_lens)), dtype=torch.int64).to(dev, non_blocking=True) - 1
        logits, hidden = self._run_model(input_ids, positions, meta, last, features)
        if raw:
            return None, logits, hidden
        logits = self.target_logits(logits)
        params = [r.params for r in reqs]
        if history is not None:      # the same controls as the target's rows (the stop rule sees them too)
            apply_controls(logits, *history)
        mask_eos(logits, params, out_index, self.settings.eos_token_ids)
        if self.draft_params is not None:
            params = [self.draft_params(p) for p in params]
        return probs_from_logits(logits, param_rows(params, [1] * len(reqs), dev)), logits, hidden

    def raw_logits_ok(self, reqs, out_index: list[int], history) -> bool:
        """Whether a forward's draft-vocabulary logits may be used as they are: no logit control,
        no min_tokens EOS mask and no draft_params hook touches these rows."""
        return history is None and self.draft_params is None and \
            all(oi >= r.params.min_tokens for r, oi in zip(reqs, out_index))

    def draft_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft-vocabulary logit columns ``index`` (any shape, int64)."""
        return index

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft tokens [rows] int32 of greedy rows from raw draft logits [rows, V_draft]: the argmax
        (the first of equal maxima, as the sampling transform's one-hot picks it), as a target id."""
        return self.draft_token_ids(logits.argmax(-1)).to(torch.int32)

    def _sample(self, q: torch.Tensor, reqs, positions: list[int]) -> torch.Tensor:
        """Draft tokens [rows] int32: DRAFT noise (rejection) or the target's own TARGET noise (coupled)."""
        dev = self.settings.device
        seeds = torch.tensor([r.seed for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        return ops.sample_tokens(q, seeds, pos, purpose="target" if self.settings.coupled else "draft",
                                 check_values=False)

    def _draft(self, batch, ks: list[int], K: int, stop_rule: StopRule | None) -> DraftProposal:
        B, dev, V = len(batch), self.settings.device, self.settings.vocab_size
        need_probs = not self.settings.coupled and any(not r.params.greedy for r in batch)
        greedy = all(r.params.greedy for r in batch)
        draft_ids = torch.full((B, K), -1, dtype=torch.int32, device=dev)          # [B, K]
        draft_probs = torch.zeros(B, K, V, device=dev) if need_probs else None      # [B, K, V]
        n_draft = [0] * B
        # at least the pending last token is fed (positions past the context may hold drafts made earlier)
        cached = [min(self.cached(r), r.context_len - 1) for r in batch]
        fed_until = list(cached)
        stopped = [False] * B
        used = 0
        found = forced_drafts(batch, ks, stopped)    # what a grammar forces next: no forward
        if self.lookup is not None:        # requests whose context repeats earlier text: no forward, and
            found.update(self.lookup.propose(batch, ks, [s or b in found for b, s in enumerate(stopped)]))
        fill_lookup_rows(found, draft_ids, draft_probs)    # (drafts made earlier are not used there)
        for b, prop in found.items():
            n_draft[b], stopped[b] = len(prop), True
        for b, (n, ids, probs) in self._take_earlier(batch, ks, found).items():   # drafts made earlier
            used += 1
            draft_ids[b, :n] = ids
            if draft_probs is not None and probs is not None:
                draft_probs[b, :n] = probs
            n_draft[b], fed_until[b], stopped[b] = n, self.cached(batch[b]), True
        cost = DraftCost()
        ctl = batch_controls(batch, dev)
        prev, prev_rows = None, []      # the tokens [rows] sampled by the last draft step, and their rows
        hidden = None                   # the last draft step's hidden [rows, H] (when the model returns it)
        for j in range(K):
            rows = [b for b in range(B) if j < ks[b] and not stopped[b]]
            if not rows:
                break
            reqs = [batch[b] for b in rows]
            host_ids = None
            if j == 0:
                chunks = [batch[b].token_ids[cached[b]:] for b in rows]
                host_ids = [t for c in chunks for t in c]
                input_ids = torch.tensor(host_ids, dtype=torch.int64).to(dev, non_blocking=True)
                seq_lens, query_lens = [r.context_len for r in reqs], [len(c) for c in chunks]
                features = self._step_features(reqs, [cached[b] for b in rows], None, None)
            else:
                sel = torch.tensor([prev_rows.index(b) for b in rows], dtype=torch.int64).to(dev, non_blocking=True)
                input_ids = prev.index_select(0, sel).long()
                seq_lens, query_lens = [r.context_len + j for r in reqs], [1] * len(rows)
                features = self._step_features(reqs, None, hidden, sel)
            history = None if ctl is None else (ctl, rows, [j] * len(rows), draft_ids)   # draft j follows [:j]
            out_index = [r.num_generated + j for r in reqs]
            # greedy rows without controls: the argmax of the draft's own logits, no [rows, V] transform
            raw = greedy and stop_rule is None and self.raw_logits_ok(reqs, out_index, history)
            q, logits, hidden = self._forward(reqs, input_ids, seq_lens, query_lens, out_index, host_ids, history,
                                              features=features, raw=raw)  # [rows, V]
            cost.forwards += 1
            cost.tokens_fed += sum(query_lens)
            cost.attended += self.attended      # the context its forward attended (a KV window's view)
            x = self._greedy(logits) if raw else self._sample(q, reqs, [r.context_len + j for r in reqs])  # [rows]
            row_idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
            draft_ids[row_idx, j] = x
            if draft_probs is not None:
                draft_probs[row_idx, j] = q
            for b, s in zip(rows, seq_lens):
                n_draft[b], fed_until[b] = j + 1, s
            if stop_rule is not None:
                for i in self._stopping(stop_rule, reqs, j, logits, hidden, x):
                    stopped[rows[i]] = True
                    n_draft[rows[i]] = j          # the unconfident token is not proposed
            prev, prev_rows = x, rows
        return DraftProposal(draft_ids, n_draft, draft_probs, fed_until, cost, used, frozenset(found))

    def _stopping(self, stop_rule: StopRule, reqs, depth: int, logits, hidden, x) -> list[int]:
        """Rows whose drafting stops before token ``depth`` (one intentional sync per draft step:
        the confidence / head policies decide on the host). Confidence is the draft model's own
        softmax probability of its token (at T=1): the sampling transform makes greedy rows
        one-hot, which would say "certain" every time."""
        qx = torch.softmax(logits, -1).gather(1, x.long()[:, None])[:, 0]
        p_acc = None
        if self.accept_head is not None:
            p_acc = self.accept_head(hidden.float(), qx).float().cpu().tolist()
        qx = qx.cpu().tolist()
        return [i for i, r in enumerate(reqs) if stop_rule(r, depth, qx[i], None if p_acc is None else p_acc[i])]


class ModelDrafter(ModelPreDrafting, ModelDrafterBase):
    """A draft model's drafter: ModelDrafterBase with pre-drafting (overlap)."""
