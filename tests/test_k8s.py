"""Stage pods for dagster-k8s's PipesK8sClient (resources/k8s.py): the pod specs are validated by
dagster-k8s itself (build_pod_body -> the kubernetes client's V1Pod model, which refuses unknown
fields), and one stage runs through PipesK8sClient.run end to end against a stand-in cluster that
starts the pod's container command as a local process with the pod's environment."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from dagster import DagsterInstance, MaterializeResult, asset, materialize

pytest.importorskip("dagster_k8s", reason="the k8s extra (dagster-k8s) is not installed: bash scripts/setup.sh")
from dagster_k8s.pipes import build_pod_body  # noqa: E402

from resources.compute import ComputeResource  # noqa: E402
from resources.k8s import GPU_RESOURCE, K8sConfig, StagePod, check_paths, pod_spec, worker_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
H100 = {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def cluster(**kw) -> K8sConfig:
    stages = {"extract": StagePod(gpus=8, memory="1Ti", node_selector=H100, tolerations=[GPU_TAINT]),
              "train": StagePod(gpus=8, node_selector=H100, tolerations=[GPU_TAINT], image="eu.gcr.io/p/eagle3:1-train"),
              "regenerate": StagePod(gpus=0)}
    return K8sConfig(**{"image": "eu.gcr.io/p/eagle3:1", "shared_claim": "eagle3-shared", "service_account": "eagle3",
                        "env": {"EAGLE3_ENV": "gcp"}, "default": StagePod(cpu="4", memory="16Gi"), "stages": stages,
                        **kw})


def pod(cfg: K8sConfig, stage: str, nproc: int = 1):
    """What PipesK8sClient.run would create: dagster-k8s builds (and validates) the V1Pod."""
    spec = pod_spec(cfg, stage, nproc)
    return build_pod_body(pod_name=f"dagster-{stage}", image=spec["containers"][0]["image"],
                          command=worker_command(cfg.python, nproc), env_vars={"EAGLE3_ENV": "gcp"},
                          base_pod_meta={"labels": {"app.kubernetes.io/component": f"eagle3-{stage}"}},
                          base_pod_spec=spec)


def test_gpu_stage_pod_validates_and_carries_its_settings():
    body = pod(cluster(), "train", nproc=8)
    (c,) = body.spec.containers
    assert c.image == "eu.gcr.io/p/eagle3:1-train" and c.working_dir == "/app"
    assert c.command == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8",
                         "-m", "resources.pipes_worker"]
    assert c.resources.limits == {GPU_RESOURCE: "8", "cpu": "4", "memory": "16Gi"} == c.resources.requests
    assert body.spec.node_selector == H100 and body.spec.tolerations[0].key == "nvidia.com/gpu"
    assert body.spec.restart_policy == "Never" and body.spec.service_account_name == "eagle3"
    mounts = {m.name: m.mount_path for m in c.volume_mounts}
    assert mounts == {"eagle3-shared": "/shared", "dshm": "/dev/shm"}
    vols = {v.name: v for v in body.spec.volumes}
    assert vols["eagle3-shared"].persistent_volume_claim.claim_name == "eagle3-shared"
    assert vols["dshm"].empty_dir.medium == "Memory"
    assert body.metadata.labels["app.kubernetes.io/component"] == "eagle3-train"


def test_cpu_stages_take_the_default_pod():
    body = pod(cluster(), "filter")
    (c,) = body.spec.containers
    assert c.image == "eu.gcr.io/p/eagle3:1" and c.command == ["python", "-m", "resources.pipes_worker"]
    assert c.resources.limits == {"cpu": "4", "memory": "16Gi"}
    assert body.spec.node_selector is None and body.spec.tolerations is None
    assert GPU_RESOURCE not in pod(cluster(), "regenerate").spec.containers[0].resources.limits  # gpus=0 set


def test_dagster_k8s_refuses_a_malformed_pod():
    """The validation these tests rely on is real: a misspelt field fails in dagster-k8s."""
    spec = pod_spec(cluster(), "extract")
    spec["containers"][0]["volume_mount"] = spec["containers"][0].pop("volume_mounts")
    with pytest.raises(Exception, match="volume_mount"):
        build_pod_body("p", None, None, {}, None, spec)


@pytest.mark.parametrize("make,msg", [
    (lambda: pod_spec(cluster(stages={"training": StagePod(gpus=1)}), "train"), "not stages"),
    (lambda: pod_spec(cluster(), "train", nproc=16), "16 training ranks on a pod with 8 GPUs"),
    (lambda: check_paths({"stage": "extract", "request": {"target": "/home/me/.cache/t", "out": "/shared/x"}},
                         "/shared"), "/home/me/.cache/t"),
])
def test_refusals(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_paths_under_the_shared_mount_pass():
    check_paths({"stage": "train", "request": {"features": ["/shared/a", "/shared/b"], "target": "tiny-random",
                                               "endpoint": "http://10.0.0.2:30000", "out": "/shared/o"}},
                "/shared")
    with pytest.raises(ValueError):  # a sibling whose name starts like the mount is outside it
        check_paths({"stage": "train", "request": {"out": "/shared-other/o"}}, "/shared")


class StandInCluster:
    """The slice of DagsterKubernetesClient PipesK8sClient.run uses: create the pod (here: run its
    container's command with its env, in the project dir), wait for it, delete it."""

    def __init__(self):
        self.pods, self.core_api = {}, self

    def create_namespaced_pod(self, namespace, body):
        (c,) = body.spec.containers
        env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **{e.name: e.value for e in c.env}}
        self.pods[body.metadata.name] = (body, subprocess.Popen(c.command, cwd=ROOT, env=env))

    def wait_for_pod(self, pod_name, namespace, **_):
        proc = self.pods[pod_name][1]
        if proc.wait(timeout=300) != 0:
            raise RuntimeError(f"pod {pod_name} failed with exit code {proc.returncode}")

    def delete_namespaced_pod(self, pod_name, namespace):
        self.pods[pod_name][1].poll()


@pytest.mark.integration
def test_a_stage_runs_through_pipes_k8s_client(tmp_path, monkeypatch):
    import sys

    import dagster_k8s.pipes as dk
    from dagster import PipesTempFileMessageReader
    from dagster_k8s import PipesK8sClient

    from eagle3_platform.data.stages import SourcesRequest

    fake = StandInCluster()
    monkeypatch.setattr(dk.DagsterKubernetesClient, "production_client", staticmethod(lambda: fake))
    monkeypatch.setattr(PipesK8sClient, "_load_k8s_config", lambda self: None)
    # pod logs are the production message channel; the stand-in's pods share this machine's disk
    monkeypatch.setattr("resources.compute.k8s_client",
                        lambda: PipesK8sClient(message_reader=PipesTempFileMessageReader(), poll_interval=0.1))
    shared = tmp_path / "shared"
    cfg = K8sConfig(image="img", shared_claim="c", shared_dir=str(shared), python=sys.executable,
                    env={"EAGLE3_TEST_POD": "1"}, stages={"sources": StagePod(cpu="1")})
    out, summaries = shared / "chat.jsonl", []

    @asset
    def prompts(context, compute: ComputeResource):
        summaries.append(compute.run(context, SourcesRequest(workload="chat", out=str(out), preset="tiny", limit=3)))
        return MaterializeResult()

    with DagsterInstance.ephemeral() as inst:
        result = materialize([prompts], resources={"compute": ComputeResource(mode="k8s", k8s=cfg)}, instance=inst)
    assert result.success
    (name, (body, proc)), = fake.pods.items()
    assert proc.returncode == 0 and body.spec.containers[0].resources.limits == {"cpu": "1"}
    env = {e.name for e in body.spec.containers[0].env}
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES", "EAGLE3_TEST_POD"} <= env
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(r["workload"] == "chat" for r in rows)
    (summary,) = summaries  # the worker's summary, back through the Pipes message channel
    assert summary and json.dumps(summary)


def test_cluster_dagster_yaml_validates_against_dagster_k8s():
    """resources/dagster-k8s.yaml (the documented cluster instance): its run launcher config against
    K8sRunLauncher's own schema, the whole file against Dagster's instance schema."""
    import yaml
    from dagster._config import process_config, resolve_to_config_type, validate_config
    from dagster._core.instance.config import dagster_instance_config_schema
    from dagster_k8s import K8sRunLauncher

    cfg = yaml.safe_load((ROOT / "resources" / "dagster-k8s.yaml").read_text())
    assert (cfg["run_launcher"]["module"], cfg["run_launcher"]["class"]) == ("dagster_k8s", "K8sRunLauncher")
    schema = resolve_to_config_type(K8sRunLauncher.config_type())
    ok = process_config(schema, cfg["run_launcher"]["config"])
    assert ok.success, [e.message for e in ok.errors]
    assert not process_config(schema, {**cfg["run_launcher"]["config"], "job_namespce": "x"}).success
    assert validate_config(dagster_instance_config_schema(), cfg).success
    import dagster_postgres  # noqa: F401  (its storage: in the k8s extra)


def test_stage_pods_from_a_yaml_file(tmp_path, monkeypatch):
    from resources import build_resources

    f = tmp_path / "k8s.yaml"
    f.write_text("image: img:1\nshared_claim: eagle3-shared\nstages:\n  train: {gpus: 8, node_selector: "
                 "{pool: h100}}\n")
    monkeypatch.setenv("EAGLE3_K8S_CONFIG", str(f))
    monkeypatch.setenv("EAGLE3_COMPUTE", "k8s")
    monkeypatch.setenv("EAGLE3_TRAIN_PROCS", "8")
    compute = build_resources(env="local")["compute"]
    assert compute.mode == "k8s" and compute.train_procs == 8
    spec = pod_spec(compute.k8s, "train", compute.train_procs)
    assert spec["node_selector"] == {"pool": "h100"} and spec["containers"][0]["resources"]["limits"] == {
        GPU_RESOURCE: "8"}
