"""Dagster resources, and the ONE place that selects the environment.

EAGLE3_ENV=local (default): artifacts under the project data dir (EAGLE3_DATA_DIR overrides).
EAGLE3_ENV=gcp: artifacts in GCS (EAGLE3_GCS_BUCKET, EAGLE3_GCS_PREFIX, EAGLE3_GCP_PROJECT); set
STORAGE_EMULATOR_HOST to use a local emulator.
Other knobs: EAGLE3_PRESET (tiny|demo|cpu|full), EAGLE3_DTYPE (auto|bfloat16|float32) and
EAGLE3_TORCH_THREADS (0 = every core) overriding the preset's compute settings in every model-running
stage, EAGLE3_TARGET (model id or path), EAGLE3_COMPUTE (in_process|pipes), EAGLE3_SERVING (auto|embedded|sglang), EAGLE3_BENCH_DURATION_S (seconds per
load-test cell, overriding the bench preset: slow shared machines), EAGLE3_KEEP_SERVING=1 (the deployment
keeps serving after the run: `eagle3 run --keep-serving`; `eagle3 stop` stops it).
Production (docs/PRODUCTION.md): EAGLE3_TRAIN_PROCS (torchrun ranks of the training step),
EAGLE3_K8S_CONFIG (a YAML of the stage pods' settings, resources/k8s.py), EAGLE3_SGLANG_PYTHON (the
SGLang environment's interpreter), EAGLE3_SGLANG_TP (SGLang's tensor-parallel size),
EAGLE3_REGEN_ENDPOINT (regenerate through this OpenAI-compatible server of the target; a comma-separated
list spreads the conversations over several), EAGLE3_EXTRACT_DEVICE_MAP / EAGLE3_EXTRACT_MAX_MEMORY
(feature extraction loads the target sharded: `eagle3 extract --device-map` / `--max-memory`),
EAGLE3_EXTRACT_FROM_ENGINE (features imported from a vLLM hidden-state capture dir: `--from-engine`).
"""
from __future__ import annotations

import os

from eagle3_platform.config import DEFAULT_PRESET
from resources.compute import ComputeResource
from resources.k8s import k8s_from_env
from resources.preset import PresetResource
from resources.serving import ServingResource
from resources.storage import StorageResource, default_data_dir
from resources.target import TargetResource

ENVS = ("local", "gcp")

__all__ = ["ComputeResource", "PresetResource", "ServingResource", "StorageResource", "TargetResource",
           "build_resources", "ENVS"]


def storage_for_env(env: str) -> StorageResource:
    if env == "local":
        return StorageResource(root=default_data_dir())  # read now: EAGLE3_DATA_DIR may be set late
    if env == "gcp":
        bucket = os.environ.get("EAGLE3_GCS_BUCKET")
        if not bucket:
            raise ValueError("EAGLE3_ENV=gcp needs EAGLE3_GCS_BUCKET")
        prefix = os.environ.get("EAGLE3_GCS_PREFIX", "eagle3").strip("/")
        return StorageResource(root=f"gs://{bucket}/{prefix}", project=os.environ.get("EAGLE3_GCP_PROJECT"))
    raise ValueError(f"EAGLE3_ENV must be one of {ENVS}, got {env!r}")


def _int_env(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else None


def build_resources(env: str | None = None, preset: str | None = None, target: str | None = None,
                    storage: StorageResource | None = None, dtype: str | None = None,
                    torch_threads: int | None = None, regen_time_budget_s: float | None = None,
                    prompts_per_workload: int | None = None) -> dict:
    """All resources for one environment; arguments override the environment variables."""
    env = env or os.environ.get("EAGLE3_ENV", "local")
    threads = torch_threads if torch_threads is not None else _int_env("EAGLE3_TORCH_THREADS")
    return {
        "storage": storage or storage_for_env(env),
        "target": TargetResource(model=target or os.environ.get("EAGLE3_TARGET", "smollm2-135m-instruct"),
                                 endpoint=os.environ.get("EAGLE3_REGEN_ENDPOINT") or None,
                                 device_map=os.environ.get("EAGLE3_EXTRACT_DEVICE_MAP") or None,
                                 max_memory=os.environ.get("EAGLE3_EXTRACT_MAX_MEMORY") or None,
                                 engine_dir=os.environ.get("EAGLE3_EXTRACT_FROM_ENGINE") or None),
        "preset": PresetResource(name=preset or os.environ.get("EAGLE3_PRESET", DEFAULT_PRESET),
                                 dtype=dtype or os.environ.get("EAGLE3_DTYPE") or None, torch_threads=threads,
                                 regen_time_budget_s=regen_time_budget_s,
                                 prompts_per_workload=prompts_per_workload),
        "compute": ComputeResource(mode=os.environ.get("EAGLE3_COMPUTE", "in_process"),
                                   train_procs=_int_env("EAGLE3_TRAIN_PROCS") or 1, k8s=k8s_from_env()),
        "serving": ServingResource(mode=os.environ.get("EAGLE3_SERVING", "auto"),
                                   sglang_python=os.environ.get("EAGLE3_SGLANG_PYTHON") or None,
                                   tp_size=_int_env("EAGLE3_SGLANG_TP") or 1,
                                   bench_duration_s=_int_env("EAGLE3_BENCH_DURATION_S"),
                                   keep_running=os.environ.get("EAGLE3_KEEP_SERVING") == "1"),
    }
