"""`deployment`: the exported head behind an OpenAI-compatible endpoint (SGLang on GPU, the embedded
CPU server otherwise). Materializing it starts the endpoint, proves it healthy with /health,
/server_info and one chat completion, and records the endpoint description: transient (stopped with
the step) or persistent (serving after the run, its pid recorded for `eagle3 stop`)."""

import json
import time

from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets.draft import draft_head
from assets.metadata import OWNERS, location
from assets.partitions import Keys
from resources import PresetResource, ServingResource, StorageResource, TargetResource

SMOKE_MAX_TOKENS = 8


def smoke(url: str, headers: dict) -> dict:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120.0, json={
        "model": "default", "max_tokens": SMOKE_MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
    r.raise_for_status()
    info = httpx.get(f"{url}/server_info", headers=headers, timeout=10.0).json()
    return {"smoke_latency_s": round(time.perf_counter() - t0, 3),
            "smoke_completion_tokens": r.json().get("usage", {}).get("completion_tokens", 0),
            "server_info": info}


ROLE = "deployment"  # the registry's name for the deployment's server (the benchmark's are others)


def servers(storage: StorageResource):
    """The servers recorded for this storage's local data dir (serve.launch.ServerRegistry): every
    server a step starts there, so the next start stops what a killed run left, and `eagle3 stop`
    the persistent deployment."""
    from eagle3_platform.serve.launch import REGISTRY_DIR, ServerRegistry

    return ServerRegistry(storage.local_path(REGISTRY_DIR))


def is_up(url: str, headers: dict) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


@asset(deps=[draft_head], group_name="serving", kinds={"fastapi"}, owners=OWNERS)
def deployment(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
               serving: ServingResource, preset: PresetResource) -> MaterializeResult:
    """The exported head behind an OpenAI-compatible endpoint, proven by /health, /server_info and one
    chat completion. Transient by default: the server answers this step's checks and stops with it (the
    benchmark starts its own). Persistent (the serving resource's keep_running, `eagle3 run
    --keep-serving`): it keeps serving after the run, until `eagle3 stop`. `running` says whether it was
    up when the step ended; a new deployment first stops the one recorded before it."""
    export = storage.fetch_dir(Keys.EXPORT)
    log = storage.local_path("deployment/server.log")
    registry, persistent = servers(storage), serving.keep_running
    replaced = registry.stop(role=ROLE)
    handle = serving.launch(target.dir(), export, log_path=log, preset=preset.name, compute=preset.compute(),
                            registry=registry, persistent=persistent, role=ROLE)
    try:
        checks = smoke(handle.url, handle.headers())
    except BaseException:
        handle.stop()  # a persistent endpoint that failed its checks is not left serving
        raise
    if not persistent:
        handle.stop()
    up = is_up(handle.url, handle.headers())
    if persistent and not up:
        raise RuntimeError(f"the persistent endpoint {handle.url} (pid {handle.pid}) stopped answering "
                           f"/health right after its checks; log: {log}")
    server = (f"persistent: serving at {handle.url} (pid {handle.pid}) after this run; "
              f"`eagle3 stop --data-dir {registry.dir.parent}` stops it" if persistent else
              f"transient: served this step's checks at {handle.url} (pid {handle.pid}) and stopped with "
              "it; the benchmark starts its own servers (keep_running / `eagle3 run --keep-serving` "
              "keeps one up)")
    command = handle.describe() if hasattr(handle, "describe") else None  # SGLang's argv (api key masked)
    desc = {"mode": serving.resolved_mode(), "url": handle.url, "launch_command": command,
            "persistent": persistent, "running": up, "pid": handle.pid, "server": server,
            "pid_file": str(registry.dir / f"{handle.pid}.json") if up else None,
            "replaced_pids": replaced, "reaped_pids": list(getattr(handle, "reaped", [])),
            "target_dir": str(target.dir()), "draft_export": storage.uri(Keys.EXPORT),
            "spec": serving.spec_name(preset.name), "preset": preset.name, **target.lineage(),
            "health_at_deploy": "ok", **{k: v for k, v in checks.items() if k != "server_info"}}
    storage.storage().put_bytes(Keys.DEPLOYMENT, json.dumps(desc, indent=2, sort_keys=True).encode())
    context.log.info(f"deployment: {server}")
    return MaterializeResult(metadata={
        "mode": desc["mode"], "server": MetadataValue.text(server),
        "url": MetadataValue.url(handle.url) if up else MetadataValue.text(f"{handle.url} (stopped)"),
        "running": MetadataValue.bool(up), "persistent": MetadataValue.bool(persistent),
        "pid": MetadataValue.int(handle.pid),
        **({"launch_command": MetadataValue.md(f"```\n{command}\n```")} if command else {}),
        "smoke_latency_s": MetadataValue.float(checks["smoke_latency_s"]),
        "server_info": MetadataValue.json(checks["server_info"]),
        "deployment_uri": location(storage.uri(Keys.DEPLOYMENT)), **target.lineage()})


def not_serving(resources: dict, key) -> str | None:
    """Why `eagle3 run` must redeploy although Dagster reports `deployment` fresh: the persistent mode
    is asked for (keep_running) and no recorded deployment answers now. None otherwise."""
    if key.to_user_string() != "deployment" or not resources["serving"].keep_running:
        return None
    live = [r for r in servers(resources["storage"]).entries() if r["role"] == ROLE and r["persistent"]]
    if any(r["url"] and is_up(r["url"], _auth(resources["serving"])) for r in live):
        return None
    return "not serving now (--keep-serving)"


def _auth(serving: ServingResource) -> dict:
    return {"Authorization": f"Bearer {serving.api_key}"} if serving.api_key else {}
