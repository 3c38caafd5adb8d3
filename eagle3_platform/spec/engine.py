"""The speculative decoding engine: EAGLE-3 tree drafting + one-forward tree verification (DESIGN §5).

State between verify steps (batch 1):
  target KV cache  = tokens 0..n-1 (committed);  pending = x_n, the last emitted token, not cached yet;
  drafter          = entries 0..n-1 + h_last predicting x_{n+1} (see drafter.py).
A verify step drafts a tree rooted at x_n, runs the target ONCE over all its nodes (tree mask,
per-node positions), accepts a root path + a bonus token, keeps only that path in both caches and
emits accepted tokens + bonus. Without a draft the tree is the root alone: plain KV-cached decoding
through the same code (the baseline), so stats are comparable.

Not re-entrant per stream when given a stateful Drafter object (tests); with an Eagle3Draft each
stream builds its own drafter state. `last_stats` belongs to the most recently finished stream.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Iterator, Sequence

import torch

from eagle3_platform.data.chat import eos_token_ids
from eagle3_platform.draft.metrics import acceptance_length
from eagle3_platform.features.capture import forward_capture
from eagle3_platform.kv_cache import GrowingCache
from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.drafter import EagleDrafter
from eagle3_platform.spec.sampling import greedy, target_probs, verify_greedy, verify_sampling
from eagle3_platform.spec.stops import Finisher
from eagle3_platform.spec.tree import (Tree, keep_path_in_cache, root_only, tree_attention_mask,
                                       tree_positions)


class _Seq:
    """Per-stream target state."""

    def __init__(self, drafter, temperature: float, gen: torch.Generator | None):
        self.drafter, self.temperature, self.gen = drafter, temperature, gen
        self.cache = None  # kv_cache.GrowingCache over tokens 0..n-1
        self.n = 0
        self.pending = -1  # x_n


class SpecEngine:
    def __init__(self, target, draft=None, cfg: SpecConfig = PRESETS["chain"]):
        self.target, self.model, self.cfg = target, target.model, cfg
        self.dtype = next(self.model.parameters()).dtype
        self.draft = draft if cfg.speculative else None
        if isinstance(self.draft, torch.nn.Module):  # the head computes in the target's dtype (bf16 on CPU)
            self.draft = self.draft.cast_parameters(self.dtype)
        # the head reads the layers it was trained on (its config), else the target's capture layers
        head_layers = getattr(getattr(draft, "cfg", None), "aux_layer_ids", None)
        self.layer_ids = list(head_layers or target.meta["capture_layer_ids"])
        self.eos_ids = eos_token_ids(target.tokenizer, self.model)
        self.last_stats: dict = {}

    # ---- public API -------------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 stop: Sequence[str] = (), seed: int | None = None) -> tuple[list[int], dict]:
        tokens: list[int] = []
        for chunk in self.stream(input_ids, max_new_tokens, temperature, stop, seed):
            tokens += chunk
        return tokens, self.last_stats

    def stream(self, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
               stop: Sequence[str] = (), seed: int | None = None) -> Iterator[list[int]]:
        """Yields chunks of accepted tokens (each verify step's accepted tokens + bonus)."""
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids must not be empty")
        if max_new_tokens < 1 or temperature < 0:
            raise ValueError("need max_new_tokens >= 1 and temperature >= 0")
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        seq = _Seq(self._make_drafter(), temperature, gen)
        fin = Finisher(self.target.tokenizer, self.eos_ids, max_new_tokens, stop)
        steps, hist, t0 = 0, Counter(), time.perf_counter()
        chunk = self._prefill(seq, ids)
        t_prefill = time.perf_counter() - t0
        while True:
            out = fin.push(chunk)
            if out:
                yield out
            if fin.done:
                break
            chunk = self._verify_step(seq)
            steps += 1
            hist[len(chunk)] += 1
        self.last_stats = _stats(fin, steps, hist, t_prefill, time.perf_counter() - t0, len(ids))

    # ---- steps -----------------------------------------------------------------------------------
    def _make_drafter(self):
        if self.draft is None:
            return None
        return self.draft if hasattr(self.draft, "propose") else EagleDrafter(self.draft, self.cfg)

    @torch.no_grad()
    def _prefill(self, seq: _Seq, ids: list[int]) -> list[int]:
        """Target forward over the prompt (capturing g); the first token comes from its last row."""
        logits, aux, seq.cache = self._forward(torch.tensor([ids]), None, None, GrowingCache(), seq.drafter)
        first = self._pick(logits[0, -1], seq)
        if seq.drafter is not None:  # entry t = (g_t, x_{t+1}): the prompt shifted by one + first
            seq.drafter.prefill(aux, torch.tensor(ids[1:] + [first]))
        seq.n, seq.pending = len(ids), first
        return [first]

    @torch.no_grad()
    def _verify_step(self, seq: _Seq) -> list[int]:
        tree = seq.drafter.propose(seq.pending) if seq.drafter is not None else root_only(seq.pending)
        n = seq.n
        mask = tree_attention_mask(tree.parents, n, self.dtype) if len(tree) > 1 else None  # [1,1,N,n+N]
        pos = tree_positions(tree.parents, n)  # [1,N]
        logits, aux, seq.cache = self._forward(tree.tokens[None], mask, pos, seq.cache, seq.drafter)
        path, bonus = self._accept(tree, logits[0], seq)
        keep_path_in_cache(seq.cache, n, path)  # target cache: tokens 0..n-1, root, accepted nodes
        new = tree.tokens[path[1:]].tolist() + [bonus]  # accepted draft tokens + bonus
        if seq.drafter is not None:  # entries n..n+m = (g of root/accepted nodes, next token)
            seq.drafter.commit(aux[:, path], torch.tensor(new))
        seq.n, seq.pending = n + len(path), bonus
        return new

    def _accept(self, tree: Tree, logits: torch.Tensor, seq: _Seq) -> tuple[list[int], int]:
        # Greedy invariant: output equals target greedy decoding token for token (verify_greedy).
        # T > 0 invariant: every token is an exact draw from the target's p (verify_sampling).
        if seq.temperature == 0:
            return verify_greedy(tree, logits)
        return verify_sampling(tree, logits, seq.temperature, seq.gen, self.cfg.min_residual_mass)

    def _pick(self, logits: torch.Tensor, seq: _Seq) -> int:
        if seq.temperature == 0:
            return int(greedy(logits))
        return int(torch.multinomial(target_probs(logits, seq.temperature), 1, generator=seq.gen))

    def _forward(self, ids, mask, pos, cache, drafter):
        """-> (logits [1,T,V], aux [1,T,3H] | None, cache). Features only when a draft consumes them."""
        kw = dict(attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        if drafter is None:
            out = self.model(input_ids=ids, **kw)
            return out.logits, None, out.past_key_values
        out = forward_capture(self.model, ids, self.layer_ids, **kw)
        return out.logits, out.aux_hidden, out.past_key_values


def _stats(fin: Finisher, steps: int, hist: Counter, t_prefill: float, t_total: float,
           prompt_tokens: int) -> dict:
    """τ counts verify steps only: the prefill's first token is not a speculative step (SGLang)."""
    generated = len(fin.tokens)
    decoded = max(0, generated - 1)
    t_decode = max(t_total - t_prefill, 1e-9)
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "verify_steps": steps,
        "acceptance_length": acceptance_length(decoded, steps) if steps else 1.0,
        "accept_hist": {int(k): int(v) for k, v in sorted(hist.items())},
        "tokens_per_s": generated / max(t_total, 1e-9),
        "decode_tokens_per_s": decoded / t_decode,
        "prefill_s": t_prefill,
        "total_s": t_total,
        "finish_reason": fin.reason,
    }
