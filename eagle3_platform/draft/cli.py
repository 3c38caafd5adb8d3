"""`eagle3 train`, `eagle3 export`, `eagle3 vocab`."""
from __future__ import annotations

from dataclasses import replace

from eagle3_platform.cli_args import output_dir, output_file, require_positive


def _dirs(s: str | None) -> list[str]:
    from eagle3_platform.features.shards import check_distinct

    return check_distinct([d for d in (s or "").split(",") if d])


def _train(args) -> dict:
    from eagle3_platform.draft.train import PRESETS, train

    output_dir(args.out)
    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: {sorted(PRESETS)}")
    require_positive(max_steps=args.max_steps, epochs=args.epochs, threads=args.threads,
                     ckpt_every=args.ckpt_every)
    cfg = PRESETS[args.preset]
    overrides = {k: v for k, v in {"max_steps": args.max_steps, "epochs": args.epochs, "seed": args.seed,
                                   "num_threads": args.threads, "ckpt_every": args.ckpt_every,
                                   "dtype": args.dtype}.items() if v is not None}
    cfg = replace(cfg, **overrides)
    out = train(args.target, _dirs(args.features), args.out, cfg, resume=args.resume,
                eval_dirs=_dirs(args.eval_features), vocab_path=args.vocab)
    return {k: v for k, v in out.items() if k != "history"}


def _export(args) -> dict:
    from eagle3_platform.draft.export import export_draft

    output_dir(args.out)
    return export_draft(args.draft, args.out, dtype=args.dtype)


def _vocab(args) -> dict:
    from eagle3_platform.draft.model import target_hf_config
    from eagle3_platform.draft.vocab import save_vocab, vocab_from_features

    require_positive(draft_vocab_size=args.draft_vocab_size)
    output_file(args.out)
    V = target_hf_config(args.target)["vocab_size"]
    d2t, t2d, stats = vocab_from_features(_dirs(args.features), V, args.draft_vocab_size)
    return save_vocab(args.out, d2t, t2d, stats)


def add_commands(sub) -> None:
    p = sub.add_parser("train", help="TTT-train an EAGLE-3 draft head on feature shards")
    p.add_argument("--target", required=True, help="prepared target dir")
    p.add_argument("--features", required=True, help="feature dir(s), comma-separated")
    p.add_argument("--out", required=True, help="draft dir (checkpoints + draft.safetensors)")
    p.add_argument("--preset", default="demo", help="tiny | demo | cpu | full")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--eval-features", default="", help="held-out feature dir(s), comma-separated")
    p.add_argument("--vocab", default=None, help="draft vocab file (default: built from --features)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--ckpt-every", type=int, default=None, help="optimizer steps between checkpoints")
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32 compute (default: the preset's)")
    p.set_defaults(func=_train)

    p = sub.add_parser("export", help="export a trained head in SGLang LlamaForCausalLMEagle3 format")
    p.add_argument("--draft", required=True, help="draft dir written by `eagle3 train`")
    p.add_argument("--out", required=True, help="export dir (config.json + model.safetensors)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    p.set_defaults(func=_export)

    p = sub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from feature shards")
    p.add_argument("--features", required=True, help="feature dir(s), comma-separated")
    p.add_argument("--target", required=True, help="prepared target dir")
    p.add_argument("--out", required=True, help="output .safetensors (+ .json stats beside it)")
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.set_defaults(func=_vocab)
