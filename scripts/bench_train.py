"""Training throughput of the EAGLE-3 head at SmolLM2-135M size (H=576, V=49152) on this CPU.

Synthetic features (random g / last_hidden), random weights: throughput does not depend on values.
For each draft vocab size (--draft-vocab, comma-separated) it times
  - fwd_bwd_K:  forward+backward of the TTT loss at K steps (single-pass attention) — the headline,
  - fwd_bwd_K1: the same at K=1 (no TTT): baseline for the cost of TTT,
  - naive:      fwd+bwd at K with the reference attention (all steps' keys + explicit mask),
  - full_step:  a whole optimizer step (teacher from the frozen full-vocab lm_head on the rows that can
                be supervised + fwd+bwd + clip + AdamW).
  - full_step_fp32_1thread vs full_step_<dtype>_<n>threads: a whole step on the turn-1 path (fp32, one
                thread) and on the training path (`--dtype`, bf16 autocast where native, `--path-threads`).
All variants are interleaved within each repeat (so load changes on a shared box hit them alike),
after --warmup rounds; medians over --reps; ratios are taken from the same run. Two thirds of the
positions are "response" and all of them supervised (worst case for the lm_head).

    python scripts/bench_train.py --draft-vocab 8192,32000 --tokens 1024 --seq-len 512
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_platform.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3_platform.draft.ttt import (TTTLoss, naive_ttt_attention, shift_left, step_masks,  # noqa: E402
                                       teacher, ttt_attention)
from eagle3_platform.model.compute import autocast, resolve_dtype, resolve_threads  # noqa: E402

# SmolLM2-135M-Instruct geometry (docs/ARCHITECTURE.md §7); the head's shapes follow the target's.
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
           "vocab_size": 49152, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
PROMPT_FRACTION = 3  # the first T // 3 positions are prompt


class Case:
    """One draft vocab size: a head, synthetic batch, and the timed variants."""

    def __init__(self, vd: int, B: int, T: int, K: int):
        torch.manual_seed(0)
        self.cfg = DraftConfig.from_target(SMOLLM2, vd, [1, 14, 26])
        self.draft, self.K = Eagle3Draft(self.cfg), K
        H, V = self.cfg.hidden_size, self.cfg.vocab_size
        self.lm_head = torch.randn(V, H) * 0.05
        self.ids = torch.randint(0, V, (B, T))
        self.aux, self.last = torch.randn(B, T, 3 * H), torch.randn(B, T, H)
        self.loss_mask = torch.zeros(B, T, dtype=torch.bool)
        self.loss_mask[:, T // PROMPT_FRACTION:] = True
        self.d2t_ids = torch.randperm(V)[:vd].sort().values
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.fixed = {k: self.targets(k) for k in {1, K}}

    def targets(self, K):
        need = shift_left(self.loss_mask, 1, fill=False)
        tprobs, in_vocab = teacher(self.last, self.lm_head, self.d2t_ids, need)
        masks = step_masks(self.loss_mask, need, K)  # every response prediction supervised
        return tprobs, masks, torch.stack([m.sum() for m in masks])

    def fwd_bwd(self, K, attention=ttt_attention):
        tprobs, masks, denom = self.fixed[K]
        loss, _, _ = TTTLoss(self.draft, K, attention)(self.aux, self.ids, tprobs, masks, denom)
        loss.backward()
        self.draft.zero_grad(set_to_none=True)

    def full_step(self, dtype: str = "float32"):
        with autocast(dtype):  # as draft/train.py: teacher and head forward under autocast
            tprobs, masks, denom = self.targets(self.K)
            loss, _, _ = TTTLoss(self.draft, self.K)(self.aux, self.ids, tprobs, masks, denom)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        self.opt.step()

    def variants(self, threads: int, path_threads: int, dtype: str):
        def on(n, fn):
            def run():
                torch.set_num_threads(n)
                fn()
            return run
        return {"fwd_bwd_K": on(threads, lambda: self.fwd_bwd(self.K)),
                "fwd_bwd_K1": on(threads, lambda: self.fwd_bwd(1)),
                "naive": on(threads, lambda: self.fwd_bwd(self.K, naive_ttt_attention)),
                "full_step": on(threads, self.full_step),
                "full_step_fp32_1thread": on(1, self.full_step),
                f"full_step_{dtype}_{path_threads}threads": on(path_threads, lambda: self.full_step(dtype))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-vocab", default="8192,32000", help="comma-separated Vd values")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per batch")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="training path's compute dtype (compute.resolve_dtype)")
    ap.add_argument("--path-threads", type=int, default=0, help="training path's threads (0 = all cores)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core box, 2 threads thrash under contention)")
    args = ap.parse_args()
    dtype, path_threads = resolve_dtype(args.dtype, work="dense"), resolve_threads(args.path_threads)
    B, T = args.tokens // args.seq_len, args.seq_len
    cases = {int(v): Case(int(v), B, T, args.K) for v in args.draft_vocab.split(",")}
    times: dict[tuple[int, str], list[float]] = {}
    for rep in range(args.warmup + args.reps):
        for vd, case in cases.items():
            for name, fn in case.variants(args.threads, path_threads, dtype).items():
                t0 = time.perf_counter()
                fn()
                if rep >= args.warmup:
                    times.setdefault((vd, name), []).append(time.perf_counter() - t0)
    n_tok, K = B * T, args.K
    out = {"config": {"H": 576, "V": 49152, "K": K, "batch": [B, T], "threads": args.threads,
                      "path": {"dtype": dtype, "threads": path_threads},
                      "reps": args.reps}, "results": {}}
    for vd, case in cases.items():
        names = case.variants(args.threads, path_threads, dtype)
        med = {name: statistics.median(times[(vd, name)]) for name in names}
        out["results"][f"Vd={vd}"] = {
            "head_params": sum(p.numel() for p in case.params),
            f"fwd_bwd_K{K}_tok_per_s": n_tok / med["fwd_bwd_K"],
            "fwd_bwd_K1_tok_per_s": n_tok / med["fwd_bwd_K1"],
            f"full_step_K{K}_tok_per_s": n_tok / med["full_step"],
            f"cost_ratio_K{K}_vs_K1": med["fwd_bwd_K"] / med["fwd_bwd_K1"],
            "naive_over_single_pass_time": med["naive"] / med["fwd_bwd_K"],
            f"full_step_{dtype}_{path_threads}threads_tok_per_s": n_tok / med[f"full_step_{dtype}_{path_threads}threads"],
            "full_step_fp32_1thread_tok_per_s": n_tok / med["full_step_fp32_1thread"],
            "training_path_speedup_vs_fp32_1thread": med["full_step_fp32_1thread"]
            / med[f"full_step_{dtype}_{path_threads}threads"],
            "median_seconds": med}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
