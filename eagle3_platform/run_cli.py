"""`eagle3 run`: the whole graph through Dagster. Runs `python -m pipeline` (which lives beside the
Dagster definitions and materializes what is missing or stale) as a child process and streams its
output; this library module never imports Dagster itself."""
from __future__ import annotations

import sys
from pathlib import Path

from eagle3_platform.cli_args import output_dir
from eagle3_platform.summary import run_with_summary

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def add_commands(sub) -> None:
    p = sub.add_parser("run", help="run the whole graph (prompts → … → benchmark report) through Dagster")
    from eagle3_platform.config import DEFAULT_PRESET, PRESET_NAMES

    p.add_argument("--preset", default=DEFAULT_PRESET, choices=PRESET_NAMES)
    p.add_argument("--target", default=None, help="smollm2-135m-instruct | tiny-random | PATH")
    p.add_argument("--workloads", default=None, help="comma-separated partitions (default: all)")
    p.add_argument("--through", default=None, help="last asset to materialize (default: benchmark_report)")
    p.add_argument("--env", default=None, choices=["local", "gcp"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--dagster-home", default=None)
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32: overrides every stage's preset dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads of every stage (0 = every core)")
    p.add_argument("--regen-budget-min", type=float, default=None,
                   help="regeneration wall minutes per partition (default: the preset's, cpu: 14; 0 = no "
                        "limit); a new value continues the published responses: a larger one asks "
                        "what the smaller one deferred or cut short")
    p.add_argument("--prompts-per-workload", type=int, default=None,
                   help="train prompts per workload (default: the preset's, cpu: 400, long_context "
                        "keeping its share, 64); a larger set keeps the answers already made and "
                        "regenerates only the new prompts")
    p.add_argument("--force", action="store_true", help="rebuild what is neither missing nor stale")
    p.set_defaults(func=run)


def pipeline_command(a) -> list[str]:
    cmd = [sys.executable, "-m", "pipeline", "--preset", a.preset]
    for flag in ("target", "workloads", "through", "env", "data_dir", "dagster_home", "dtype", "threads",
                 "regen_budget_min", "prompts_per_workload"):
        if getattr(a, flag, None) is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    return cmd + (["--force"] if a.force else [])


def run(a) -> dict:
    output_dir(a.data_dir, "--data-dir")
    output_dir(a.dagster_home, "--dagster-home")
    if not (PROJECT_ROOT / "pipeline.py").exists():
        raise FileNotFoundError(f"pipeline.py not found beside the package at {PROJECT_ROOT}; "
                                "`eagle3 run` needs the project checkout (definitions + assets)")
    rc, summary = run_with_summary(pipeline_command(a), cwd=PROJECT_ROOT, echo=_forward)
    if not summary["ok"]:
        raise ValueError(f"pipeline failed (exit {rc}): {summary['error']}")
    summary.pop("ok", None)
    return summary


def _forward(line: str) -> None:
    """Progress goes to stderr (inherited); stdout lines are forwarded, except the pipeline's summary
    (the caller prints its own)."""
    if not line.lstrip().startswith("{"):
        print(line, end="", flush=True)
