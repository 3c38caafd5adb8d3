"""`eagle3 train`, `eagle3 export`, `eagle3 vocab`: argv → the stage's request (eagle3_platform.draft.stages)."""
from __future__ import annotations

from eagle3_platform.cli.args import add_compute_args, add_preset_arg


def _dirs(s: str | None) -> list[str]:
    return [d for d in (s or "").split(",") if d]


def _train(args) -> dict:
    from eagle3_platform.draft.stages import TrainRequest
    from eagle3_platform.stage import run

    out = run(TrainRequest(target=args.target, features=_dirs(args.features), out=args.out, preset=args.preset,
                           eval_features=_dirs(args.eval_features), vocab=args.vocab, resume=args.resume,
                           init_from=args.init_from,
                           max_steps=args.max_steps, epochs=args.epochs, seed=args.seed,
                           ckpt_every=args.ckpt_every, dtype=args.dtype, torch_threads=args.threads))
    return {k: v for k, v in out.items() if k != "history"}  # the curve is in OUT/metrics.json


def _export(args) -> dict:
    from eagle3_platform.draft.stages import ExportRequest
    from eagle3_platform.stage import run

    return run(ExportRequest(draft=args.draft, out=args.out, weights_dtype=args.dtype))


def _vocab(args) -> dict:
    from eagle3_platform.draft.stages import VocabRequest
    from eagle3_platform.stage import run

    return run(VocabRequest(features=_dirs(args.features), target=args.target, out=args.out,
                            draft_vocab_size=args.draft_vocab_size, preset=args.preset))


def add_commands(sub) -> None:
    p = sub.add_parser("train", help="TTT-train an EAGLE-3 draft head on feature shards")
    p.add_argument("--target", required=True, help="prepared target dir")
    p.add_argument("--features", required=True, help="feature dir(s), comma-separated")
    p.add_argument("--out", required=True, help="draft dir (checkpoints + draft.safetensors)")
    add_preset_arg(p)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--init-from", default=None,
                   help="a draft dir written by `eagle3 train` to start from (warm start: same target and "
                        "head geometry; lm_head rows follow their tokens into this run's vocab)")
    p.add_argument("--eval-features", default="", help="held-out feature dir(s), comma-separated")
    p.add_argument("--vocab", default=None, help="draft vocab file (default: built from --features)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ckpt-every", type=int, default=None, help="optimizer steps between checkpoints")
    add_compute_args(p)
    p.set_defaults(func=_train)

    p = sub.add_parser("export", help="export a trained head in SGLang LlamaForCausalLMEagle3 format")
    p.add_argument("--draft", required=True, help="draft dir written by `eagle3 train`")
    p.add_argument("--out", required=True, help="export dir (config.json + model.safetensors)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    p.set_defaults(func=_export)

    p = sub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from feature shards")
    p.add_argument("--features", required=True, help="feature dir(s), comma-separated")
    p.add_argument("--target", required=True, help="prepared target dir (its identity is checked in every shard)")
    p.add_argument("--out", required=True, help="output .safetensors (+ .json stats beside it)")
    p.add_argument("--draft-vocab-size", type=int, required=True)
    add_preset_arg(p)
    p.set_defaults(func=_vocab)
