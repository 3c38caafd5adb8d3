"""Flags and checks every stage command spells the same way (torch-free, tiny).

The checks on output paths are the stages' own (eagle3_platform.store.checks); what stays here is
the command line's: counts given as flags, the preset and compute flags.
"""
from __future__ import annotations


def require_positive(**counts) -> None:
    """Counts from the command line (flag name -> value; None = not given) must be >= 1."""
    for name, v in counts.items():
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {v}")


def add_preset_arg(p) -> None:
    from eagle3_platform.config import DEFAULT_PRESET, PRESET_NAMES

    p.add_argument("--preset", default=DEFAULT_PRESET, help=f"{' | '.join(PRESET_NAMES)} (default: %(default)s)")


def add_compute_args(p) -> None:
    """The compute overrides of a model-running stage (eagle3_platform.stage.ComputeRequest)."""
    p.add_argument("--dtype", default=None, help="auto | bfloat16 | float32 compute (default: the preset's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, 0 = every core (default: the preset's)")
