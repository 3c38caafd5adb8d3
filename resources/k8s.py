"""Heavy stages as Kubernetes pods through Dagster Pipes (`dagster_k8s.PipesK8sClient`).

The compute resource in mode "k8s" runs each stage's Pipes worker (`python -m resources.pipes_worker`,
under torchrun for a multi-GPU training) in a pod built here: the stage's image, GPU request, CPU and
memory, node selector and tolerations come from `K8sConfig.stages[<stage>]`, else its `default`.
Stage requests carry file paths (the storage resource fetches inputs to local disk, a step writes
local outputs that it then publishes), so the Dagster run's pod and every stage pod mount one shared
claim at `shared_dir`, and every absolute path of a request must lie under it (refused otherwise: the
pod would not see that file). Point EAGLE3_CACHE (prepared targets, GCS working copies) and
EAGLE3_DATA_DIR (local storage) there. docs/PRODUCTION.md has a cluster's settings.
"""
from __future__ import annotations

from dagster import Config
from pydantic import Field

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_VOLUME = "eagle3-shared"
SHM_VOLUME = "dshm"  # torch DataLoader workers and NCCL use /dev/shm; a pod's default is 64 MiB


class StagePod(Config):
    """One stage's pod: what it runs on. None/empty fields take the `default` StagePod's."""

    image: str | None = None
    gpus: int | None = Field(default=None, ge=0)        # nvidia.com/gpu, requested = limit
    cpu: str | None = None                              # e.g. "8"; requested = limit
    memory: str | None = None                           # e.g. "64Gi"
    node_selector: dict[str, str] = {}                  # e.g. {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    # e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    tolerations: list[dict[str, str]] = []


class K8sConfig(Config):
    """Where the stage pods run and what they share."""

    image: str                                          # the project's image (this tree + its venv)
    namespace: str | None = None                        # None: the current namespace, else "default"
    service_account: str | None = None                  # e.g. one bound to a GCS writer (Workload Identity)
    shared_claim: str                                   # a ReadWriteMany PersistentVolumeClaim
    shared_dir: str = "/shared"                         # where every pod mounts it
    project_dir: str = "/app"                           # the project root inside the image (working dir)
    python: str = "python"                              # the image's interpreter with the project installed
    shm_size: str = "16Gi"
    env: dict[str, str] = {}                            # e.g. EAGLE3_ENV, EAGLE3_GCS_BUCKET, EAGLE3_CACHE
    default: StagePod = StagePod()
    stages: dict[str, StagePod] = {}                    # by stage: sources filter regenerate extract vocab train export


def stage_pod(cfg: K8sConfig, stage: str) -> StagePod:
    """The stage's pod settings merged over the default's."""
    from eagle3_platform.stage import runners

    known = {t.stage for t in runners()}
    unknown = set(cfg.stages) - known
    if unknown:
        raise ValueError(f"k8s stages {sorted(unknown)} are not stages; expected some of {', '.join(sorted(known))}")
    mine, base = cfg.stages.get(stage, StagePod()), cfg.default
    pick = lambda name: getattr(mine, name) or getattr(base, name)  # noqa: E731
    return StagePod(image=pick("image") or cfg.image, gpus=mine.gpus if mine.gpus is not None else base.gpus,
                    cpu=pick("cpu"), memory=pick("memory"), node_selector=pick("node_selector"),
                    tolerations=pick("tolerations"))


def worker_command(python: str, nproc: int = 1) -> list[str]:
    """The Pipes worker's argv; nproc > 1: torchrun starts that many ranks (rank 0 talks to Dagster)."""
    if nproc <= 1:
        return [python, "-m", "resources.pipes_worker"]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "resources.pipes_worker"]


def pod_spec(cfg: K8sConfig, stage: str, nproc: int = 1) -> dict:
    """The `base_pod_spec` handed to PipesK8sClient.run (a V1PodSpec as a dict; dagster-k8s fills in
    the image, command and the Pipes env). nproc: training ranks, at most the pod's GPUs when it has any."""
    pod = stage_pod(cfg, stage)
    gpus = pod.gpus or 0
    if gpus and nproc > gpus:
        raise ValueError(f"{stage}: {nproc} training ranks on a pod with {gpus} GPUs (one GPU per rank)")
    limits = {k: v for k, v in (("cpu", pod.cpu), ("memory", pod.memory)) if v}
    limits.update({GPU_RESOURCE: str(gpus)} if gpus else {})
    container = {"name": "eagle3", "image": pod.image, "working_dir": cfg.project_dir,
                 "resources": {"requests": dict(limits), "limits": dict(limits)},
                 "volume_mounts": [{"name": SHARED_VOLUME, "mount_path": cfg.shared_dir},
                                   {"name": SHM_VOLUME, "mount_path": "/dev/shm"}]}
    spec = {"containers": [container], "restart_policy": "Never",
            "volumes": [{"name": SHARED_VOLUME, "persistent_volume_claim": {"claim_name": cfg.shared_claim}},
                        {"name": SHM_VOLUME, "empty_dir": {"medium": "Memory", "size_limit": cfg.shm_size}}]}
    if pod.node_selector:
        spec["node_selector"] = dict(pod.node_selector)
    if pod.tolerations:
        spec["tolerations"] = [dict(t) for t in pod.tolerations]
    if cfg.service_account:
        spec["service_account_name"] = cfg.service_account
    return spec


def check_paths(payload: dict, shared_dir: str) -> None:
    """Every absolute path in a stage request must lie under the shared mount (a pod sees nothing else)."""
    root = shared_dir.rstrip("/") + "/"
    outside = sorted({v for v in _strings(payload.get("request") or {}) if v.startswith("/") and
                      not (v + "/").startswith(root)})
    if outside:
        raise ValueError(f"{payload.get('stage')}: paths outside the pods' shared mount {shared_dir}: "
                         f"{', '.join(outside)} (put EAGLE3_CACHE and EAGLE3_DATA_DIR under it)")


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def k8s_from_env() -> K8sConfig | None:
    """EAGLE3_K8S_CONFIG: a YAML file of K8sConfig's fields (docs/PRODUCTION.md), else None."""
    import os

    import yaml

    path = os.environ.get("EAGLE3_K8S_CONFIG")
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return K8sConfig(**(yaml.safe_load(f) or {}))
