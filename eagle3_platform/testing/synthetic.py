"""Feature dirs for tests and benchmarks, written through the real shard writer (features/shards.py).

`target_features`: random prompts + the target's own greedy-free "responses" (random ids), run through
the real target with forward_capture, so teacher/feature relations are those of a real target.
`random_features`: random hidden states of any width (throughput benchmarks; no target forward).
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3_platform.features.shards import shard_name, write_manifest, write_shard


def _meta(target_meta: dict, max_length: int) -> dict:
    return {"target_id": target_meta["target_id"], "weights_hash": target_meta["weights_hash"],
            "capture_layer_ids": target_meta["capture_layer_ids"], "template_hash": "synthetic",
            "tokenizer_hash": "synthetic", "max_length": max_length, "dtype": "bfloat16",
            "compute_dtype": "float32"}


def _write(out_dir: Path, samples: list[dict], meta: dict, per_shard: int) -> Path:
    rows = [write_shard(out_dir / shard_name(i // per_shard), samples[i:i + per_shard], meta)
            for i in range(0, len(samples), per_shard)]
    write_manifest(out_dir, rows)
    return out_dir


def _ids_and_mask(g: torch.Generator, vocab: int, n: int, lo: int, hi: int, prompt_frac: float):
    T = int(torch.randint(lo, hi + 1, (1,), generator=g))
    ids = torch.randint(0, vocab, (T,), generator=g)
    mask = torch.zeros(T, dtype=torch.uint8)
    mask[max(1, int(T * prompt_frac)):] = 1     # prompt then response (incl. its last token)
    return ids, mask


@torch.no_grad()
def target_features(target_dir, out_dir, n_samples: int = 12, min_len: int = 12, max_len: int = 40,
                    seed: int = 0, per_shard: int = 5, prompt_frac: float = 0.4) -> Path:
    """Features of the real (tiny) target on random sequences; response ids repeat a short motif so a
    head can learn something within a few steps."""
    from eagle3_platform.features.capture import forward_capture
    from eagle3_platform.model.target import load_target

    target = load_target(target_dir)
    meta = target.meta
    V = target.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    samples = []
    for s in range(n_samples):
        ids, mask = _ids_and_mask(g, V, s, min_len, max_len, prompt_frac)
        motif = torch.randint(0, min(V, 32), (4,), generator=g)
        resp = mask.bool()
        ids[resp] = motif.repeat(int(resp.sum()) // 4 + 1)[: int(resp.sum())]
        out = forward_capture(target.model, ids[None], meta["capture_layer_ids"], compute_logits=False)
        samples.append({"id": f"syn-{seed}-{s}", "input_ids": ids, "loss_mask": mask,
                        "aux_hidden": out.aux_hidden[0], "last_hidden": out.last_hidden[0]})
    return _write(Path(out_dir), samples, _meta(meta, max_len), per_shard)


def random_features(out_dir, target_meta: dict, vocab_size: int, hidden_size: int, n_samples: int,
                    seq_len: int, seed: int = 0, per_shard: int = 8) -> Path:
    """Random features of width H (benchmarks): hidden states ~ N(0,1), ids uniform."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for s in range(n_samples):
        ids, mask = _ids_and_mask(g, vocab_size, s, seq_len, seq_len, 0.3)
        samples.append({"id": f"rand-{seed}-{s}", "input_ids": ids, "loss_mask": mask,
                        "aux_hidden": torch.randn(seq_len, 3 * hidden_size, generator=g),
                        "last_hidden": torch.randn(seq_len, hidden_size, generator=g)})
    return _write(Path(out_dir), samples, _meta(target_meta, seq_len), per_shard)
