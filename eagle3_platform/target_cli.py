"""`eagle3 prepare-target`."""
from __future__ import annotations

from eagle3_platform.cli_args import output_dir
from eagle3_platform.target import prepare_target


def add_commands(sub) -> None:
    p = sub.add_parser("prepare-target", help="convert/cache the target as a plain HF checkpoint")
    p.add_argument("--model", required=True, help="smollm2-135m-instruct | tiny-random | PATH")
    p.add_argument("--out", required=True)
    p.set_defaults(func=lambda a: output_dir(a.out) or {"out": a.out, **prepare_target(a.model, a.out)})
