"""Training throughput of the EAGLE-3 head at SmolLM2-135M size (H=576, V=49152) on this CPU.

Synthetic features (random g / last_hidden), random weights: throughput does not depend on values.
Prints tokens/s (median of --reps after --warmup) for
  - fwd+bwd of the TTT loss at K=7 (the single-pass attention) — the headline figure,
  - the whole optimizer step (teacher from the frozen full-vocab lm_head + fwd+bwd + clip + AdamW),
and, measured in the same run, ratios against baselines: K=1 (no TTT) and the naive attention.

    python scripts/bench_train.py --draft-vocab 8192 --tokens 2048 --seq-len 512
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
from eagle3_platform.draft.ttt import (TTTLoss, naive_ttt_attention, step_masks, teacher,  # noqa: E402
                                       ttt_attention)

# SmolLM2-135M-Instruct geometry (DESIGN §7); the head's shapes follow the target's.
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
           "vocab_size": 49152, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}


def median_time(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per batch")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core box, 2 threads thrash under contention)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(SMOLLM2, args.draft_vocab, [1, 14, 26])
    draft = Eagle3Draft(cfg)
    H, V, B, T = cfg.hidden_size, cfg.vocab_size, args.tokens // args.seq_len, args.seq_len
    target_lm_head = torch.randn(V, H) * 0.05
    ids = torch.randint(0, V, (B, T))
    aux, last = torch.randn(B, T, 3 * H), torch.randn(B, T, H)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[:, T // 3:] = True
    d2t_ids = torch.randperm(V)[:args.draft_vocab].sort().values
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def targets(K):
        tlogp, in_vocab = teacher(last, target_lm_head, d2t_ids)
        in_vocab = torch.ones_like(in_vocab)   # supervise everything: worst case for the loss
        masks = step_masks(loss_mask, in_vocab, K)
        return tlogp, masks, torch.stack([m.sum() for m in masks])

    fixed = {K: targets(K) for K in {1, args.K}}

    def fwd_bwd(K, attention=ttt_attention):
        tlogp, masks, denom = fixed[K]
        loss, _, _ = TTTLoss(draft, K, attention)(aux, ids, tlogp, masks, denom)
        loss.backward()
        draft.zero_grad(set_to_none=True)

    def full_step():
        tlogp, masks, denom = targets(args.K)
        loss, _, _ = TTTLoss(draft, args.K)(aux, ids, tlogp, masks, denom)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    n_tok = B * T
    t_k = median_time(lambda: fwd_bwd(args.K), args.warmup, args.reps)
    t_1 = median_time(lambda: fwd_bwd(1), args.warmup, args.reps)
    t_naive = median_time(lambda: fwd_bwd(args.K, naive_ttt_attention), args.warmup, args.reps)
    t_teacher = median_time(lambda: targets(args.K), args.warmup, args.reps)
    t_step = median_time(full_step, args.warmup, args.reps)
    res = {
        "config": {"H": H, "V": V, "Vd": args.draft_vocab, "K": args.K, "batch": [B, T],
                   "threads": torch.get_num_threads(), "head_params": sum(p.numel() for p in params)},
        f"fwd_bwd_K{args.K}_tok_per_s": n_tok / t_k,
        "fwd_bwd_K1_tok_per_s": n_tok / t_1,
        f"cost_ratio_K{args.K}_vs_K1": t_k / t_1,
        "naive_vs_single_pass_ratio": t_naive / t_k,
        "teacher_tok_per_s": n_tok / t_teacher,
        f"full_step_K{args.K}_tok_per_s": n_tok / t_step,
        "seconds": {"fwd_bwd_K": t_k, "fwd_bwd_K1": t_1, "naive": t_naive, "teacher": t_teacher,
                    "full_step": t_step},
    }
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
