"""A running batch of speculative-decoding requests: chunked prefill, one batched verify step.

State of a running request r between steps (docs/ARCHITECTURE.md §5, per row of the batch):
  target KV cache row = tokens 0..n-1 (committed);  pending = x_n, the last emitted token, not cached;
  drafter             = entries 0..n-1 + h_last predicting x_{n+1} (see drafter.py).
A step drafts a tree rooted at every row's x_n, runs the target ONCE over all rows' trees (padded to
the widest, per-row tree masks and positions over the ragged cache), accepts a root path + a bonus
token per row, keeps only that path in both caches and emits the accepted tokens + bonus. A row
without a draft verifies its root alone: plain KV-cached decoding through the same code (the
baseline), so stats are comparable.

Invariants: greedy output of a request equals target greedy decoding, and at T > 0 every token is an
exact draw from the target, whatever else is in the batch (rows only see their own slots).
"""
from __future__ import annotations

import functools
import time
from collections import Counter
from typing import Sequence

import torch

from eagle3_platform.draft.metrics import acceptance_length
from eagle3_platform.model.compute import threads
from eagle3_platform.model.kv_cache import GrowingCache
from eagle3_platform.model.families import attention_layout
from eagle3_platform.model.ragged import RaggedCache
from eagle3_platform.model.sampling import greedy, target_probs
from eagle3_platform.spec.drafter import propose_all
from eagle3_platform.spec.lookup import PLAIN_LOOKUP_ROWS
from eagle3_platform.spec.stops import Finisher
from eagle3_platform.spec.tree import Tree, ancestor_matrix, depths, root_only
from eagle3_platform.spec.verify import verify_greedy, verify_sampling

PREFILL_CHUNK = 256  # prompt tokens per prefill forward (a long prompt is split across steps)
# Below this temperature a request decodes greedily (the T -> 0 limit of sampling): logits / 1e-40
# overflow fp32 to inf, softmax turns them into NaN and the draw fails
MIN_SAMPLING_TEMPERATURE = 1e-5


class Request:
    """One stream's state: prompt progress, then its row in the batch."""

    def __init__(self, ids: list[int], finisher: Finisher, drafter, temperature: float,
                 gen: torch.Generator | None):
        self.ids, self.fin, self.drafter = ids, finisher, drafter
        self.temperature, self.gen = temperature, gen
        self.prefilled = 0  # prompt tokens through the target so far
        self.prompt_cache: GrowingCache | None = GrowingCache()  # until the prompt is done
        self.prompt_aux: list[torch.Tensor] = []  # [1,c,3H] per chunk, for the drafter's prefill
        self.n = 0  # committed tokens (in the batch cache)
        self.pending = -1  # x_n
        self.steps, self.hist = 0, Counter()
        self.last_accepted = 0  # draft tokens accepted in the last step
        self.last_drafted = 0  # depth of the last step's draft (0: the root alone)
        self.has_drafted = False  # its drafter has drafted before (its prompt is in the draft KV)
        self.t0, self.t_prefill = time.perf_counter(), 0.0

    @property
    def running(self) -> bool:
        return self.prompt_cache is None

    @property
    def done(self) -> bool:
        return self.fin.done

    def stats(self) -> dict:
        """τ counts verify steps only: the prefill's first token is not a speculative step (SGLang)."""
        generated, t_total = len(self.fin.tokens), time.perf_counter() - self.t0
        t_decode = max(t_total - self.t_prefill, 1e-9)
        return {
            "prompt_tokens": len(self.ids),
            "generated_tokens": generated,
            "verify_steps": self.steps,
            "acceptance_length": acceptance_length(max(0, generated - 1), self.steps) if self.steps else 1.0,
            "accept_hist": {int(k): int(v) for k, v in sorted(self.hist.items())},
            "tokens_per_s": generated / max(t_total, 1e-9),
            "decode_tokens_per_s": max(0, generated - 1) / t_decode,
            "prefill_s": self.t_prefill,
            "total_s": t_total,
            "finish_reason": self.fin.reason,
        }


def on_engine_device(method):
    """Runs a Batch method under its engine's on_device: the tensors it makes without a device (the
    cache's, the drafters', the trees') go to the model's."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.engine.on_device():
            return method(self, *args, **kwargs)
    return run


class Batch:
    """Requests of one engine decoded together. Not thread-safe: one thread drives a batch."""

    def __init__(self, engine):
        self.engine = engine
        with engine.on_device():  # per-layer masks, lengths: on the model's device
            self.cache = RaggedCache(engine.cache_dtype, attention_layout(engine.model.config))
        self.rows: list[Request] = []  # rows[b] owns cache row b (the cache keeps them longest first)
        self.catch_up_s = 0.0  # of the last step: drafter backlogs appended before drafting
        self.resume_catch_up_s = 0.0  # the part for rows that had drafted before: steps decoded plainly
        self.step_s = 0.0  # of the last step, without catch_up_s: what its draft size cost
        self.failed_prompts: list[Request] = []  # of the last step: riding prompts its forward lost
        self.prompt_error: Exception | None = None

    @on_engine_device
    def open(self, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             stop: Sequence[str] = (), seed: int | None = None) -> Request:
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids must not be empty")
        if max_new_tokens < 1 or temperature < 0:
            raise ValueError("need max_new_tokens >= 1 and temperature >= 0")
        e = self.engine
        if temperature < MIN_SAMPLING_TEMPERATURE:
            temperature = 0.0
        gen = torch.Generator(e.device).manual_seed(seed) if seed is not None else None  # draws where p is
        fin = Finisher(e.target.tokenizer, e.eos_ids, max_new_tokens, stop)
        return Request(ids, fin, e.make_drafter(), temperature, gen)

    @on_engine_device
    @torch.no_grad()
    def prefill(self, r: Request, max_tokens: int | None = PREFILL_CHUNK) -> list[int] | None:
        """Runs the next chunk of r's prompt. None while prompt tokens remain; at the last chunk r
        joins the batch and the tokens it may emit (the first token, unless held back) come back."""
        e, (start, end) = self.engine, self._chunk(r, max_tokens)
        t0 = time.perf_counter()
        # only the last position's logits are read (the first token): the lm_head over a whole chunk
        # is ~12% of a SmolLM2 prefill (1 thread, bf16)
        logits, aux = e.forward(torch.tensor([r.ids[start:end]]), None, None, r.prompt_cache, r.drafter,
                                logits_to_keep=1)
        first = self._prefilled(r, end, logits, aux, time.perf_counter() - t0)
        return None if first is None else self._join(r, first)

    def _chunk(self, r: Request, max_tokens: int | None) -> tuple[int, int]:
        start = r.prefilled
        return start, len(r.ids) if max_tokens is None else min(len(r.ids), start + max_tokens)

    def _prefilled(self, r: Request, end: int, logits, aux, seconds: float) -> int | None:
        """r's prompt is through the target up to `end` (the chunk's last logits [1,1,V], features)
        -> its first token once the prompt is done (the drafter has its prompt then), else None."""
        r.prefilled = end
        if aux is not None and r.drafter is not None:
            r.prompt_aux.append(aux)
        if end < len(r.ids):
            r.t_prefill += seconds
            return None
        first = self._pick(logits[0, -1], r)
        if r.drafter is not None:  # entry t = (g_t, x_{t+1}): the prompt shifted by one + first
            r.drafter.prefill(torch.cat(r.prompt_aux, dim=1), torch.tensor(r.ids[1:] + [first]))
        return first

    def _join(self, r: Request, first: int) -> list[int]:
        """r's prompt is done: it takes its row (the next step decodes it) -> tokens it may emit."""
        self.rows.insert(self.cache.add_row(r.prompt_cache, len(r.ids)), r)
        r.prompt_cache, r.prompt_aux = None, []
        r.n, r.pending = len(r.ids), first
        r.t_prefill = time.perf_counter() - r.t0
        return r.fin.push([first])

    @on_engine_device
    @torch.no_grad()
    def step(self, max_draft_tokens: int | None = None,
             prompts: Sequence[tuple[Request, int]] = ()) -> list[tuple[Request, list[int]]]:
        """One verify step over every running row -> (request, tokens it may emit now) per row.
        max_draft_tokens caps each row's draft (0 = plain decoding this step, but for the
        prompt-lookup matches of one or two rows, lookup.py; None = the config).
        prompts: (request, up to n tokens) chunks of waiting prompts, run in the same target forward
        (as prefill() would, but sharing the step's weight reads); a prompt done here joins the batch
        after the step and comes back too, with its first token (as from prefill). If that forward
        fails, the rows step alone and the prompts are given up (their caches may hold part of the
        chunk); a prompt whose own part after it fails (its first token, its drafter's prefill) is
        given up alone: `failed_prompts` and `prompt_error` say so. A failure of the rows' own step
        raises.
        Drafting leaves the drafters committed and a failed forward commits nothing in the batch
        cache, so the rows' retry starts from the same state."""
        if not self.rows:
            raise ValueError("a step needs running rows (prefill() runs a prompt alone)")
        t0, rows, e = time.perf_counter(), list(self.rows), self.engine
        trees = self._propose(rows, max_draft_tokens)
        q = max(len(t) for t in trees)
        tokens, depth, anc = _pad_trees(trees, q)  # [B,q], [B,q], [B,q,q]
        pos = self.cache.lengths[:, None] + depth  # [B,q]
        self.cache.begin(q)
        mask = self.cache.mask(anc) if len(rows) > 1 or q > 1 else None  # [B,1,q,S]
        any_drafter = any(r.drafter is not None for r in rows)
        spans = [self._chunk(r, n) for r, n in prompts]
        chunks = [(torch.tensor([r.ids[a:z]]), r.prompt_cache, r.drafter) for (r, _), (a, z) in zip(prompts, spans)]
        self.failed_prompts, self.prompt_error = [], None
        try:
            logits, aux, chunk_out = e.forward_with_prompts(tokens, mask, pos, self.cache,
                                                            e.draft if any_drafter else None, self.cache.groups, chunks)
        except Exception as err:
            if not prompts:
                raise
            self.failed_prompts, self.prompt_error = [r for r, _ in prompts], err
            prompts = spans = chunk_out = ()
            logits, aux = e.forward(tokens, mask, pos, self.cache, e.draft if any_drafter else None,
                                    row_groups=self.cache.groups)
        out = []
        for b, (r, tree) in enumerate(zip(rows, trees)):
            path, bonus = self._accept(tree, logits[b, :len(tree)], r)
            self.cache.keep(b, path)  # row b: tokens 0..n-1, root, accepted nodes
            new = tree.tokens[path[1:]].tolist() + [bonus]  # accepted draft tokens + bonus
            if r.drafter is not None:  # entries n..n+m = (g of root/accepted nodes, next token)
                r.drafter.commit(aux[b:b + 1, path], torch.tensor(new))
            r.n, r.pending = r.n + len(path), bonus
            r.steps, r.last_accepted = r.steps + 1, len(path) - 1
            r.last_drafted = int(depth[b, :len(tree)].max())
            r.hist[len(new)] += 1
            out.append((r, r.fin.push(new)))
        seconds = time.perf_counter() - t0
        for (r, _), (_, z), (c_logits, c_aux) in zip(prompts, spans, chunk_out):  # after the rows' keep
            try:  # a prompt's own first token and drafter prefill: its failure is its own
                first = self._prefilled(r, z, c_logits, c_aux, seconds)
            except Exception as err:
                self.failed_prompts.append(r)
                self.prompt_error = err
                continue
            if first is not None:
                out.append((r, self._join(r, first)))
        self.step_s = time.perf_counter() - t0 - self.catch_up_s
        return out

    @on_engine_device
    def close(self, r: Request) -> dict:
        """Take r out of the batch (finished or abandoned); -> its stats."""
        if r.running and r in self.rows:
            b = self.rows.index(r)
            self.cache.drop_row(b)
            self.rows.pop(b)
        r.prompt_cache = r.prompt_aux = None
        return r.stats()

    # ---- per row -------------------------------------------------------------------------------
    def _propose(self, rows: list[Request], max_draft_tokens: int | None) -> list[Tree]:
        """Every row's draft tree (its pending root alone where there is no draft this step)."""
        trees = [root_only(r.pending) for r in rows]
        drafting = [b for b, r in enumerate(rows) if r.drafter is not None and max_draft_tokens != 0]
        # an Eagle head's backlog first, timed apart (test drafters have none); prefill-like, so on the
        # target's threads (a 1000-token prompt through the demo head: 84 ms on 1 thread, 45 on 2)
        # A row's first backlog holds its prompt, a cost of drafting for it at all; a later one holds
        # only the steps decoded without a draft, the cost of returning to drafts (reported: policy.py)
        catching = [rows[b] for b in drafting if hasattr(rows[b].drafter, "catch_up")]
        self.catch_up_s = self.resume_catch_up_s = 0.0
        with threads(self.engine.target_threads if catching else None):
            for r in catching:
                t0 = time.perf_counter()
                r.drafter.catch_up()
                seconds = time.perf_counter() - t0
                self.catch_up_s += seconds
                self.resume_catch_up_s += seconds if r.has_drafted else 0.0
                r.has_drafted = True
        with threads(self.engine.draft_threads if drafting else None):
            proposed = propose_all([rows[b].drafter for b in drafting], [rows[b].pending for b in drafting],
                                   max_draft_tokens)
        for b, tree in zip(drafting, proposed):
            trees[b] = tree
        if max_draft_tokens == 0 and len(rows) <= PLAIN_LOOKUP_ROWS:
            # a plain step of one or two rows still verifies their prompt-lookup matches (lookup.py): no
            # head forward, and there the wider verify is cheap; in a larger batch it would widen every row's
            for b, r in enumerate(rows):
                if hasattr(r.drafter, "plain_step"):
                    trees[b] = r.drafter.plain_step(trees[b], len(rows))
        return trees

    def _accept(self, tree: Tree, logits: torch.Tensor, r: Request) -> tuple[list[int], int]:
        # Greedy invariant: output equals target greedy decoding token for token (verify_greedy).
        # T > 0 invariant: every token is an exact draw from the target's p (verify_sampling).
        if r.temperature == 0:
            return verify_greedy(tree, logits)
        return verify_sampling(tree, logits, r.temperature, r.gen, self.engine.cfg.min_residual_mass)

    def _pick(self, logits: torch.Tensor, r: Request) -> int:
        if r.temperature == 0:
            return int(greedy(logits))
        return int(torch.multinomial(target_probs(logits, r.temperature), 1, generator=r.gen))


def _pad_trees(trees: list[Tree], q: int):
    """Trees of up to q nodes -> tokens [B,q], depths [B,q], ancestors bool [B,q,q].
    A padding node repeats the root token, sees only itself and is never accepted."""
    B = len(trees)
    tokens = torch.zeros(B, q, dtype=torch.long)
    depth = torch.arange(q).repeat(B, 1)
    anc = torch.eye(q, dtype=torch.bool).repeat(B, 1, 1)
    for b, t in enumerate(trees):
        n = len(t)
        tokens[b, :n], tokens[b, n:] = t.tokens, t.tokens[0]
        if n > 1:
            depth[b, :n] = depths(t.parents)
            anc[b, :n, :n] = ancestor_matrix(t.parents)
    return tokens, depth, anc
