"""The `compute` resource: where a heavy stage runs. Assets build the stage's request once
(eagle3_platform.stage) and hand it here.

- mode "in_process" (default): `eagle3_platform.stage.run(request)` in the run's process.
- mode "pipes": a child process through Dagster Pipes (`PipesSubprocessClient`): the request travels
  as JSON in the Pipes context's extras, `resources/pipes_worker.py` calls the same `run` and sends the
  summary back as a Pipes message.
- mode "k8s": the same worker in a Kubernetes pod (`dagster_k8s.PipesK8sClient`), one pod per stage
  built by resources/k8s.py from `k8s` (image, GPUs, node selector per stage).
`train_procs` > 1 runs the training stage under `torchrun --nproc_per_node N` (DDP: NCCL with one GPU
per rank, gloo on the CPU) in a Pipes worker, in every mode ("in_process" cannot start ranks); the
checkpoint dir is the same as with one process, so a killed run resumes with either. The library never
imports Dagster.
"""
from __future__ import annotations

import sys
from typing import Literal

from dagster import ConfigurableResource, PipesSubprocessClient
from pydantic import Field

from eagle3_platform import progress, stage
from resources.k8s import K8sConfig, check_paths, pod_spec, worker_command
from resources.storage import PROJECT_ROOT

TRAIN_STAGE = "train"


class ComputeResource(ConfigurableResource):
    mode: Literal["in_process", "pipes", "k8s"] = "in_process"
    train_procs: int = Field(default=1, ge=1)  # torchrun ranks of the training stage (GPUs of a node)
    k8s: K8sConfig | None = None               # mode "k8s": the cluster's settings

    def run(self, context, request: stage.StageRequest) -> dict:
        """Run one stage here, in a Pipes worker or in a pod; returns its summary."""
        nproc = self.train_procs if request.stage == TRAIN_STAGE else 1
        mode = "pipes" if self.mode == "in_process" and nproc > 1 else self.mode
        context.log.info(f"{request.stage} ({mode}{f', {nproc} ranks' if nproc > 1 else ''}): {request!r}")
        if mode == "in_process":  # the step's log shows the progress lines (resources/dagster.yaml)
            with progress.echo_off():
                return stage.run(request)
        payload = stage.to_payload(request)
        if mode == "pipes":
            done = PipesSubprocessClient(cwd=str(PROJECT_ROOT)).run(
                context=context, command=worker_command(sys.executable, nproc), extras=payload)
        else:
            done = self._run_pod(context, request.stage, payload, nproc)
        messages = done.get_custom_messages()
        if not messages:
            raise RuntimeError(f"{request.stage} reported no summary")
        return messages[-1]

    def _run_pod(self, context, name: str, payload: dict, nproc: int):
        if self.k8s is None:
            raise ValueError("compute mode k8s needs the resource's k8s settings (image, shared claim)")
        check_paths(payload, self.k8s.shared_dir)
        spec = pod_spec(self.k8s, name, nproc)
        return k8s_client().run(context=context, extras=payload, image=spec["containers"][0]["image"],
                                command=worker_command(self.k8s.python, nproc), namespace=self.k8s.namespace,
                                env=dict(self.k8s.env), base_pod_spec=spec,
                                base_pod_meta={"labels": {"app.kubernetes.io/component": f"eagle3-{name}"}})


def k8s_client():
    """dagster-k8s's Pipes client (in-cluster config in a pod, else the kubeconfig); the k8s extra."""
    from dagster_k8s import PipesK8sClient

    return PipesK8sClient()
