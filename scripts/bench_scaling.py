"""Data-scaling curve of the EAGLE-3 head: held-out τ and simulated acceptance vs regenerated tokens.

Reads a finished run's data dir (`eagle3 run --data-dir D`, e.g. the cpu preset's): the train feature
shards of every workload, the eval-split features and the held-out eval prompts. For each size (response
tokens) it writes a subset of the train samples, taken one sample per workload in turn so every size
mixes them alike (smaller sizes are prefixes of larger ones), trains a head with one preset (+ overrides;
epochs raised so every point trains >= --min-steps steps), exports it and measures
  - held-out simulated acceptance (eval-split features) and the train-side one,
  - τ by the engine on held-out prompts (MT-bench first turns + each workload's eval prompts), for the
    chain and the tree presets, in the compute dtype the server uses,
  - wall time: training, plus producing that much data at --regen-tok-s (the run's measured end-to-end
    data rate: filter + regenerate + PII scan + extract, response tokens per second).
--full-head adds the run's own head (trained by the pipeline on every train sample) as the all-data point.
Resumable: a point whose results exist is not redone, and training resumes from its checkpoint.
Writes results.json (after every point), scaling.md (table) and scaling.png.

    python scripts/bench_scaling.py --data-dir runs/cpu/data \
        --target ~/.cache/eagle3/prepared/smollm2-135m-instruct --sizes 10000,30000,100000 \
        --full-head runs/cpu/data/draft/checkpoint --preset cpu --out runs/scaling
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")

from safetensors import safe_open  # noqa: E402

from eagle3_platform.features.shards import IDS_KEY, ShardDataset, read_header, read_manifest, shard_name, \
    write_manifest, write_shard  # noqa: E402
from eagle3_platform.store.records import WORKLOADS, read_jsonl, write_json_atomic, write_jsonl_atomic  # noqa: E402


def sample_table(dirs: list[Path]) -> list[list[tuple[Path, int, int]]]:
    """Per train dir, its samples in order as (shard path, index in shard, response tokens); reads only
    the small offsets and loss_mask tensors."""
    out = []
    for d in dirs:
        rows = []
        for shard in read_manifest(d)["shard"].to_list():
            with safe_open(str(d / shard), framework="pt") as f:
                offsets, mask = f.get_tensor("offsets"), f.get_tensor("loss_mask")  # [S+1], [N]
            rows += [(d / shard, i, int(mask[a:b].sum()))
                     for i, (a, b) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))]
        out.append(rows)
    return out


def subset_counts(table: list[list[tuple]], size: int) -> list[int] | None:
    """Samples taken from each dir: round-robin one sample per dir until >= size response tokens
    (so every size mixes the workloads alike and smaller sizes are prefixes of larger ones)."""
    counts, total = [0] * len(table), 0
    while total < size:
        moved = False
        for j, rows in enumerate(table):
            if counts[j] < len(rows) and total < size:
                total += rows[counts[j]][2]
                counts[j] += 1
                moved = True
        if not moved:
            return None
    return counts


def subset_dir(dirs: list[Path], table: list[list[tuple]], size: int, root: Path,
               shard_samples: int = 128) -> tuple[list[Path], int, int] | None:
    """Write the round-robin subset of >= size response tokens as one feature dir (shards copied
    sample by sample with their headers, so training validates them like the run's own)."""
    counts = subset_counts(table, size)
    if counts is None:
        return None
    if counts == [len(rows) for rows in table]:  # every sample: train on the run's own dirs, no copy
        return dirs, sum(r[2] for rows in table for r in rows), sum(counts)
    out = root / f"features-{size}"
    if not (out / "manifest.parquet").exists():
        manifest = []
        for d, n in zip(dirs, counts):
            ds = ShardDataset(d, verify="lazy")
            header = {k: v for k, v in read_header(ds.shard_paths[0]).items() if k != IDS_KEY}
            for a in range(0, n, shard_samples):
                samples = [ds[i] for i in range(a, min(n, a + shard_samples))]
                manifest.append(write_shard(out / shard_name(len(manifest)), samples, header))
        write_manifest(out, manifest)
    chosen = [r for rows, n in zip(table, counts) for r in rows[:n]]
    return [out], sum(r[2] for r in chosen), len(chosen)


def heldout_prompts(data_dir: Path, out: Path, mtbench: int) -> Path:
    """MT-bench first turns + every workload's eval prompts, as one PromptRecord JSONL."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_decode import mtbench_prompts

    recs = [r.model_dump() for r in mtbench_prompts(mtbench)] if mtbench else []
    for w in WORKLOADS:
        path = data_dir / w / "filtered_prompts" / "eval" / "kept.jsonl"
        if path.exists():
            recs += list(read_jsonl(path))
    write_jsonl_atomic(out, recs)
    return out


def point_config(args, tokens: int):
    """The preset (+ overrides), with epochs raised so the point trains >= --min-steps optimizer steps
    (a small subset otherwise gets a handful of steps, and the curve would measure steps, not data)."""
    from eagle3_platform.draft.train import PRESETS

    cfg = replace(PRESETS[args.preset], **json.loads(args.overrides))
    per_epoch = max(1, -(-tokens // cfg.batch_tokens))  # packing is greedy: about this many batches
    return replace(cfg, epochs=max(cfg.epochs, -(-args.min_steps // per_epoch)))


def measure_tau(export: Path, args, prompts: Path, target) -> dict:
    from eagle3_platform.spec.config import PRESETS as SPEC
    from eagle3_platform.spec.eval import evaluate

    point = {}
    for spec in args.spec:
        ev = evaluate(args.target, export, prompts, SPEC[spec], max_new_tokens=args.max_new_tokens,
                      limit=args.limit, target=target)
        point[f"tau_{spec}"] = ev["acceptance_length"]
        point[f"tau_{spec}_by_workload"] = {w: s["acceptance_length"] for w, s in ev["workloads"].items()}
    return point


def run_point(size: int, feats: list[Path], tokens: int, args, eval_dirs: list[Path], prompts: Path,
              target) -> dict:
    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.train import train

    cfg = point_config(args, tokens)
    head, export = args.out / f"head-{size}", args.out / f"export-{size}"
    t0 = time.time()
    summary = train(args.target, feats, head, cfg, resume=True, eval_dirs=eval_dirs)
    train_s = time.time() - t0
    export_draft(head, export)
    return {**head_summary(summary, cfg.epochs), "train_s": train_s, "train_config": asdict(cfg),
            **measure_tau(export, args, prompts, target)}


def head_summary(summary: dict, epochs: int) -> dict:
    return {"steps": summary["steps"], "epochs": epochs,
            "heldout_simulated_acceptance": summary.get("eval_simulated_acceptance"),
            "train_simulated_acceptance": summary.get("train_simulated_acceptance"),
            "heldout_acc_k": (summary.get("eval") or {}).get("acc")}


def full_point(args, table, prompts: Path, target) -> dict:
    """The run's own head (trained on every train sample by the pipeline) as the largest point."""
    from eagle3_platform.draft.export import export_draft

    head = args.full_head
    summary = json.loads((head / "metrics.json").read_text())
    cfg = json.loads((head / "draft_config.json").read_text()).get("train", {})
    export = args.out / "export-full"
    export_draft(head, export)
    rows = [r for rows in table for r in rows]
    return {"size": "full", "response_tokens": sum(r[2] for r in rows), "samples": len(rows),
            **head_summary(summary, cfg.get("epochs")),
            "train_s": summary["train_tokens"] / summary["train_tokens_per_s"],
            **measure_tau(export, args, prompts, target)}


def write_report(results: list[dict], out: Path, specs: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["response tokens", "samples", "epochs", "steps", "sim. acceptance train / held-out",
            *[f"τ {s}" for s in specs], "train min", "data min (est.)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join([f"{r['response_tokens']:,}", str(r["samples"]), str(r["epochs"]),
                                        str(r["steps"]),
                                        f"{r['train_simulated_acceptance'] or float('nan'):.2f} / "
                                        f"{r['heldout_simulated_acceptance'] or float('nan'):.2f}",
                                        *[f"{r[f'tau_{s}']:.2f}" for s in specs],
                                        f"{r['train_s'] / 60:.1f}", f"{r['regen_s_est'] / 60:.1f}"]) + " |")
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["response_tokens"] for r in results]
    for s in specs:
        ax.plot(x, [r[f"tau_{s}"] for r in results], marker="o", label=f"τ {s} (engine, held-out)")
    ax.plot(x, [r["heldout_simulated_acceptance"] for r in results], marker="s", linestyle="--",
            label="simulated acceptance (held-out)")
    ax.set_xscale("log")
    ax.set_xlabel("regenerated response tokens")
    ax.set_ylabel("acceptance length")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="a finished run's --data-dir")
    ap.add_argument("--target", required=True, help="prepared target dir")
    ap.add_argument("--sizes", required=True, help="response-token sizes, comma-separated, ascending")
    ap.add_argument("--preset", default="cpu", help="training preset")
    ap.add_argument("--overrides", default="{}", help='TrainConfig overrides as JSON, e.g. \'{"lr": 3e-4}\'')
    ap.add_argument("--spec", nargs="+", default=["chain", "tree"])
    ap.add_argument("--mtbench", type=int, default=24, help="MT-bench first turns among the held-out prompts")
    ap.add_argument("--limit", type=int, default=None, help="held-out prompts measured (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--regen-tok-s", type=float, default=200.0, help="the run's end-to-end data rate (response tok/s)")
    ap.add_argument("--dtype", default="auto", help="engine dtype for τ (the server's)")
    ap.add_argument("--min-steps", type=int, default=100,
                    help="each point trains at least this many optimizer steps (epochs raised)")
    ap.add_argument("--full-head", type=Path, default=None,
                    help="the run's own head dir (draft/checkpoint), measured as the all-data point")
    ap.add_argument("--extra-features", type=Path, nargs="*", default=[],
                    help="feature dirs added to every point's training data (e.g. teacher-forced prompts); "
                         "not counted in the point's response tokens")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from eagle3_platform.model.compute import set_threads
    from eagle3_platform.model.target import load_target

    set_threads(0)
    args.out.mkdir(parents=True, exist_ok=True)
    train_dirs = [args.data_dir / w / "features" / "train" for w in WORKLOADS
                  if (args.data_dir / w / "features" / "train" / "manifest.parquet").exists()]
    eval_dirs = [args.data_dir / w / "features" / "eval" for w in WORKLOADS
                 if (args.data_dir / w / "features" / "eval" / "manifest.parquet").exists()]
    table = sample_table(train_dirs)
    prompts = heldout_prompts(args.data_dir, args.out / "heldout.jsonl", args.mtbench)
    target = load_target(args.target, dtype=args.dtype)
    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []

    def record(point: dict) -> None:
        point["regen_s_est"] = point["response_tokens"] / args.regen_tok_s
        results.append(point)
        write_json_atomic(results_path, results, indent=2)

    done = {r["size"] for r in results}
    if args.full_head and "full" not in done:  # first: cheap (no training), so a broken setup shows early
        print(f"[scaling] full: the run's head {args.full_head}", file=sys.stderr, flush=True)
        record(full_point(args, table, prompts, target))
    for size in sorted(int(s) for s in args.sizes.split(",")):
        if size in done:
            continue
        sub = subset_dir(train_dirs, table, size, args.out)
        if sub is None:
            print(f"[scaling] {size:,} response tokens: more than the run holds "
                  f"({sum(r[2] for rows in table for r in rows):,}); skipped", file=sys.stderr)
            continue
        feats, tokens, samples = sub
        feats = [*feats, *args.extra_features]
        print(f"[scaling] {size:,}: {tokens:,} response tokens in {samples} samples", file=sys.stderr, flush=True)
        all_tokens = sum(m["tokens"] for d in feats for m in read_manifest(d).to_dicts())
        record({"size": size, "response_tokens": tokens, "samples": samples,
                **run_point(size, feats, all_tokens, args, eval_dirs, prompts, target)})
    if results:
        write_report(sorted(results, key=lambda r: r["response_tokens"]), args.out, args.spec)
        print((args.out / "scaling.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
