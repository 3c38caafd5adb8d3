"""Speculative decoding settings, named so they map 1:1 onto SGLang's flags (docs/ARCHITECTURE.md §6).

    --speculative-num-steps        = num_steps        (draft depth: draft forwards per verify)
    --speculative-eagle-topk       = eagle_topk       (children per expanded node; 1 = chain)
    --speculative-num-draft-tokens = num_draft_tokens (tree size verified per target forward,
                                                       root = last accepted token included)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

HEAD_WEIGHTS = ("auto", "int8", "int4", "packed", "native")
# What the head attends when it drafts: every earlier token, as SGLang's EAGLE-3 worker does, so the τ
# the embedded engine measures is the τ the same head gives in SGLang (docs/ARCHITECTURE.md §10).
# Reported with the settings (to_dict: /server_info, bench_decode, the benchmark report's header).
HEAD_CONTEXT = "whole prefix"


@dataclass(frozen=True)
class SpecConfig:
    num_steps: int = 4
    eagle_topk: int = 1
    num_draft_tokens: int = 5
    # Sampling safety: probabilities below this are treated as 0 when renormalising residuals.
    min_residual_mass: float = 1e-12
    # Adaptive draft size: a drafted node is verified only while the draft's cumulative probability
    # of its path stays >= this (0 = always the full tree, as SGLang does). Verifying a token the head
    # itself doubts costs a draft step and a wider verify for little expected gain; a step whose first
    # node is doubted verifies the root alone (plain decoding). Output is unchanged: verification is.
    min_draft_prob: float = 0.0
    # Prompt lookup beside the head (lookup.py; the embedded engine only, not an SGLang flag): up to
    # lookup_tokens tokens that followed the latest earlier occurrence of the last lookup_ngram (or
    # fewer) tokens join the tree as one more branch, at most 2^(n-1) of them for an n-token match
    # (a long match is mostly right; lookup.py). 0 = the head's tree alone.
    lookup_tokens: int = 0
    lookup_ngram: int = 4
    # The branch's second source (draft/answer_ngrams.py; the embedded engine only): in a plain step of a row
    # alone whose own text matches fewer than 2 tokens, up to answer_tokens tokens drafted from an
    # n-gram table of the target's training answers (exported beside the head). 0 = off, the default:
    # on a CPU where a 4-token verify costs well over a plain step it lifts the branch alone but not
    # the server's way. Where a verify costs about a decode step (bf16 on AMX, a GPU) longer chains
    # should pay; measure with bench_decode --answer-tokens.
    answer_tokens: int = 0
    # The head's weights in the embedded CPU engine (draft/quant.py; not an SGLang flag): "int8" reads
    # half the bytes per draft forward (a batch-1 draft step is bound by weight reads), "packed" keeps
    # the head's dtype on oneDNN's blocked layout (model/packed_linear.py), "int4" rounds the head to a
    # 4-bit grid and drafts a few rows on its codes (draft/quant.int4_head), "native" keeps it as trained.
    # Output is lossless in every case: only the drafted tokens may differ. "auto" (the default) is
    # "int4" where the target itself decodes on 4-bit codes (load_target's int4_rows), in fp32 or bf16:
    # a draft step then costs ~0.9x what it does with int8, acceptance unchanged. Else "packed": with
    # the target packed too, it drafts the fastest.
    head_weights: str = "auto"

    def __post_init__(self):
        if self.num_steps < 0 or self.eagle_topk < 0 or self.num_draft_tokens < 1:
            raise ValueError(f"invalid speculative settings: {self}")
        if self.speculative and (self.num_steps < 1 or self.eagle_topk < 1):
            raise ValueError("a draft tree needs num_steps >= 1 and eagle_topk >= 1")
        if self.lookup_tokens < 0 or self.lookup_ngram < 1 or self.answer_tokens < 0:
            raise ValueError(f"need lookup_tokens >= 0, lookup_ngram >= 1 and answer_tokens >= 0: {self}")
        if self.head_weights not in HEAD_WEIGHTS:
            raise ValueError(f"head_weights must be one of {HEAD_WEIGHTS}, not {self.head_weights!r}")
        if not 0.0 <= self.min_draft_prob < 1.0:
            raise ValueError(f"min_draft_prob must be in [0, 1), not {self.min_draft_prob}")
        if self.eagle_topk == 1 and self.num_draft_tokens > self.num_steps + 1:
            raise ValueError(f"a chain of {self.num_steps} steps holds at most "
                             f"{self.num_steps + 1} draft tokens, not {self.num_draft_tokens}")

    @property
    def speculative(self) -> bool:
        """num_draft_tokens == 1 means only the root is verified: plain decoding."""
        return self.num_draft_tokens > 1

    def to_dict(self) -> dict:
        return {**asdict(self), "head_context": HEAD_CONTEXT}


PRESETS: dict[str, SpecConfig] = {
    # No draft: one token per target forward (the baseline, same code path for stats).
    "baseline": SpecConfig(num_steps=0, eagle_topk=0, num_draft_tokens=1),
    # SpecForge/SGLang chain style: topk 1, each step drafts one token; root + depth nodes verified.
    "chain": SpecConfig(num_steps=4, eagle_topk=1, num_draft_tokens=5),
    # The CPU deployment's chain: draft tokens the head itself gives < 10% (path probability) are not
    # verified: a step costs ~15% less for a slightly lower tau (scripts/bench_decode.py). SGLang gets
    # the same three ints.
    "chain_adaptive": SpecConfig(num_steps=4, eagle_topk=1, num_draft_tokens=5, min_draft_prob=0.1),
    # chain_adaptive + a prompt-lookup branch of up to 8 tokens (spec/lookup.py): a small target often
    # continues what it or the prompt already said.
    "chain_adaptive_lookup": SpecConfig(num_steps=4, eagle_topk=1, num_draft_tokens=5, min_draft_prob=0.1,
                                        lookup_tokens=8),
    # EAGLE-2 style tree: top-4 per step, depth 4, keep the 11 best nodes by cumulative log-prob
    # (+ root = 12 tokens; a 12-16 token verify costs ~1.6x a 1-token forward on the 2-core CPU).
    "tree": SpecConfig(num_steps=4, eagle_topk=4, num_draft_tokens=12),
    # Tests: small and quick.
    "tiny": SpecConfig(num_steps=3, eagle_topk=2, num_draft_tokens=6),
}


def get_preset(name: str) -> SpecConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown spec preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]
