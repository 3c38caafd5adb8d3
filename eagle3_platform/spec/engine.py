"""The speculative decoding engine: EAGLE-3 tree drafting + one-forward tree verification
(docs/ARCHITECTURE.md §5).

The engine holds what every request shares (target, head, settings); the decoding itself happens in a
`Batch` (batch.py): requests prefill, join, step together and leave. `stream`/`generate` serve one
request alone through the same code, so single-stream and batched output come from one implementation.

With a stateful Drafter object (tests) the engine serves one request at a time; with an Eagle3Draft
each request builds its own drafter state. `last_stats` belongs to the most recently finished stream.

Threads: `target_threads` runs the target's forwards (prefill chunks, verify steps) and the head's
catch-up over a prompt on more cores than the rest, `draft_threads` the head's drafting. On 2 cores
(SmolLM2, bf16, batch 1) a target forward is 1.3x faster on 2 threads, a prefill 1.85x; drafting, a
chain of small ops, gains or loses from a second thread depending on the CPU (serve/config.py). Both
switch the count only around their own work, in the engine's thread: the rest (sampling, bookkeeping, a
server's other threads) keeps the caller's count, since more threads there contend for the cores (a
baseline server whose every thread took both cores decoded 1.25x slower).

Device: the target's (load_target's `device`). The head, the answer table and every tensor a step
makes go there: Batch runs its work under `on_device` (torch's default-device context), so the
drafter's, the tree's and the ragged cache's allocations follow the model without a device argument
at each site. Thread counts and the head's CPU kernels (int8, int4 codes, oneDNN packing) are the
CPU's only: on a GPU the head keeps its trained weights ("native").
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch

from eagle3_platform.data.chat import eos_token_ids
from eagle3_platform.draft.answer_ngrams import AnswerNgrams
from eagle3_platform.draft.quant import int4_head, int8_head, packed_head
from eagle3_platform.features.capture import forward_capture
from eagle3_platform.model.attention import GROUPED_DECODE
from eagle3_platform.model.compute import int4_probe_rows, threads
from eagle3_platform.model.forward import mixed_forward, step_forward, supports
from eagle3_platform.model.target import on_device
from eagle3_platform.spec.batch import Batch
from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.drafter import EagleDrafter
from eagle3_platform.spec.lookup import LookupDrafter
from eagle3_platform.spec.policy import DraftSizePolicy, policy_step


class SpecEngine:
    def __init__(self, target, draft=None, cfg: SpecConfig = PRESETS["chain"],
                 target_threads: int | None = None, draft_threads: int | None = None,
                 answers: AnswerNgrams | None = None):
        """target_threads, draft_threads: torch threads of the target's forwards and of the head's
        drafting (0 = every core; None = the caller's). answers: the lookup branch's second source
        (draft/answer_ngrams.py; used where cfg.lookup_tokens and cfg.answer_tokens are > 0)."""
        self.target, self.model, self.cfg = target, target.model, cfg
        self.device = next(self.model.parameters()).device
        cpu = self.device.type == "cpu"
        self.target_threads, self.draft_threads = (target_threads, draft_threads) if cpu else (None, None)
        self.answers = answers if answers is None or cpu else answers_on(answers, self.device)
        self.dtype = next(self.model.parameters()).dtype
        cache_dtype = target.meta.get("kv_cache_dtype")  # the batch cache's (load_target decides)
        self.cache_dtype = getattr(torch, cache_dtype) if cache_dtype else self.dtype
        self.draft = draft if cfg.speculative else None
        if isinstance(self.draft, torch.nn.Module):  # the head computes in the target's dtype (bf16 on CPU)
            self.draft = self.draft.cast_parameters(self.dtype).to(self.device)
            self.head_weights = self.resolve_head_weights(cfg.head_weights)
            narrow = target.meta.get("rowmajor_rows", 0)  # row-major weights for few rows, as the target
            if self.head_weights == "int8":  # a copy: engines with other settings may share `draft`
                self.draft = int8_head(self.draft)
            elif self.head_weights == "int4":  # codes below the rows the target's, or the probe, take them
                self.draft = int4_head(self.draft, target.meta.get("int4_rows") or int4_probe_rows(), narrow)
            elif self.head_weights == "packed":
                self.draft = packed_head(self.draft, narrow)
        else:
            self.head_weights = None
        # the head reads the layers it was trained on (its config), else the target's capture layers
        head_layers = getattr(getattr(draft, "cfg", None), "aux_layer_ids", None)
        self.layer_ids = list(head_layers or target.meta["capture_layer_ids"])
        self.eos_ids = eos_token_ids(target.tokenizer, self.model)
        self.grouped_attention = getattr(self.model.config, "_attn_implementation", None) == GROUPED_DECODE
        self.use_step_forward = supports(self.model)  # steps skip transformers' plumbing (model/forward.py)
        self.last_stats: dict = {}

    # ---- public API -------------------------------------------------------------------------------
    def resolve_head_weights(self, setting: str) -> str:
        """'auto' -> 'int4' where the target decodes on its 4-bit codes (fp32 or bf16), else 'packed';
        off the CPU 'native' (the others are CPU kernels: asked for there, they are refused)."""
        if self.device.type != "cpu":
            if setting not in ("auto", "native"):
                raise ValueError(f"head_weights {setting!r} runs on CPU kernels only; on {self.device} "
                                 "use 'native' or 'auto'")
            return "native"
        if setting != "auto":
            return setting
        return "int4" if self.target.meta.get("int4_rows") else "packed"

    def on_device(self):
        """A context in which tensors made without a device go to the engine's (target.on_device)."""
        return on_device(self.device)

    def batch(self) -> Batch:
        return Batch(self)

    def generate(self, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 stop: Sequence[str] = (), seed: int | None = None,
                 max_draft_tokens: int | None = None,
                 policy: DraftSizePolicy | None = None) -> tuple[list[int], dict]:
        tokens: list[int] = []
        for chunk in self.stream(input_ids, max_new_tokens, temperature, stop, seed, max_draft_tokens,
                                 policy):
            tokens += chunk
        return tokens, self.last_stats

    def stream(self, input_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
               stop: Sequence[str] = (), seed: int | None = None,
               max_draft_tokens: int | None = None,
               policy: DraftSizePolicy | None = None) -> Iterator[list[int]]:
        """One request alone: yields chunks of accepted tokens (each verify step's accepted + bonus).
        max_draft_tokens: every step's draft cap, as a server's policy sets it (Batch.step; None =
        the config; 0 = plain decoding that still verifies a prompt-lookup match). policy: a
        DraftSizePolicy choosing each step's cap instead and learning from it, as a server's worker
        at batch 1 (policy.py)."""
        batch = self.batch()
        r = batch.open(input_ids, max_new_tokens, temperature, stop, seed)
        try:
            out = batch.prefill(r, max_tokens=None)
            while True:
                if out:
                    yield out
                if r.done:
                    break
                _, [(_, out)] = policy_step(policy, batch, max_draft_tokens)
        finally:
            self.last_stats = batch.close(r)

    # ---- shared by every request ----------------------------------------------------------------
    def make_drafter(self):
        if self.draft is None:
            return None
        if hasattr(self.draft, "propose"):
            return self.draft
        head = EagleDrafter(self.draft, self.cfg, self.cache_dtype)  # draft KV like the batch cache
        if self.cfg.lookup_tokens:
            return LookupDrafter(head, self.cfg.lookup_tokens, self.cfg.lookup_ngram, self.answers,
                                 self.cfg.answer_tokens)
        return head

    def forward(self, ids, mask, pos, cache, drafter, logits_to_keep: int = 0, row_groups=None):
        """-> (logits [B,T,V] (the last logits_to_keep positions' if > 0), aux [B,T,3H] | None);
        `cache` is updated in place. Features only when a draft consumes them. row_groups: a ragged
        cache's (start, stop, lo, hi) groups, for model/attention.py's grouped kernel (others ignore them).
        A step (positions and a mask given, or one row's one token) of a Llama-style target runs
        model/forward.py's loop; prefill chunks and other models run transformers' forward."""
        if self._in_step_loop(ids, mask, pos):
            layers = self.layer_ids if drafter is not None else ()
            with threads(self.target_threads):
                return step_forward(self.model, ids, pos, mask, cache, layers, logits_to_keep, row_groups)
        kw = dict(attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                  logits_to_keep=logits_to_keep)
        if row_groups is not None and self.grouped_attention:  # one group: attention's plain path
            kw["row_groups"] = row_groups
        with threads(self.target_threads):
            if drafter is None:
                return self.model(input_ids=ids, **kw).logits, None
            out = forward_capture(self.model, ids, self.layer_ids, **kw)
        return out.logits, out.aux_hidden

    def _in_step_loop(self, ids, mask, pos) -> bool:
        """A step (positions and a mask given, or one row's one token) of a Llama-style target: it
        runs model/forward.py's loop."""
        return self.use_step_forward and pos is not None and (mask is not None or ids.shape == (1, 1))

    def forward_with_prompts(self, ids, mask, pos, cache, drafter, row_groups, prompts):
        """A step (as forward) with prompt chunks [(ids [1,c], prompt cache, drafter)] in the same
        target forward (forward.mixed_forward) -> (logits, aux, [(last logits [1,1,V], aux | None)] per
        chunk). Features where the step's or the chunk's drafter consumes them. Where the step does not
        go through model/forward.py's loop, the chunks run apart first."""
        if not prompts or not self._in_step_loop(ids, mask, pos):
            chunks = [self.forward(c, None, None, c_cache, d, logits_to_keep=1) for c, c_cache, d in prompts]
            return (*self.forward(ids, mask, pos, cache, drafter, row_groups=row_groups), chunks)
        wants = drafter is not None or any(d is not None for _, _, d in prompts)
        with threads(self.target_threads):
            logits, aux, chunks = mixed_forward(self.model, ids, pos, mask, cache,
                                                self.layer_ids if wants else (), 0, row_groups,
                                                [(c, c_cache) for c, c_cache, _ in prompts])
        return logits, aux, chunks


def answers_on(answers: AnswerNgrams, device: torch.device) -> AnswerNgrams:
    """The answer n-gram table with its tensors on `device` (where the lookup branch compares them)."""
    return AnswerNgrams(answers.keys.to(device), answers.tokens.to(device), answers.shares.to(device),
                        answers.answer_tokens)
