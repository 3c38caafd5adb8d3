"""`deployment`: the exported head behind an OpenAI-compatible endpoint (SGLang on GPU, the embedded
CPU server otherwise). Materializing it starts the endpoint, proves it healthy with /health,
/server_info and one chat completion, and records the endpoint description."""

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


@asset(deps=[draft_head], group_name="serving", kinds={"fastapi"}, owners=OWNERS)
def deployment(context: AssetExecutionContext, storage: StorageResource, target: TargetResource,
               serving: ServingResource, preset: PresetResource) -> MaterializeResult:
    """The exported head behind an OpenAI-compatible endpoint, proven by /health, /server_info and one
    chat completion; `running` says whether the server outlives this run (keep_running)."""
    export = storage.fetch_dir(Keys.EXPORT)
    log = storage.local_path("deployment/server.log")
    handle = serving.launch(target.dir(), export, log_path=log, preset=preset.name,
                            compute=preset.compute())
    try:
        checks = smoke(handle.url, handle.headers())
    finally:
        if not serving.keep_running:
            handle.stop()
    command = handle.describe() if hasattr(handle, "describe") else None  # SGLang's argv (api key masked)
    desc = {"mode": serving.resolved_mode(), "url": handle.url, "launch_command": command,
            "running": serving.keep_running, "pid": handle.pid if serving.keep_running else None,
            "target_dir": str(target.dir()), "draft_export": storage.uri(Keys.EXPORT),
            "spec": serving.spec_name(preset.name), "preset": preset.name, **target.lineage(),
            "health": "ok", **{k: v for k, v in checks.items() if k != "server_info"}}
    storage.storage().put_bytes(Keys.DEPLOYMENT, json.dumps(desc, indent=2).encode())
    return MaterializeResult(metadata={
        "mode": desc["mode"], "url": MetadataValue.url(handle.url),
        "running": MetadataValue.bool(bool(desc["running"])),
        **({"launch_command": MetadataValue.md(f"```\n{command}\n```")} if command else {}),
        "smoke_latency_s": MetadataValue.float(checks["smoke_latency_s"]),
        "server_info": MetadataValue.json(checks["server_info"]),
        "deployment_uri": location(storage.uri(Keys.DEPLOYMENT)), **target.lineage()})
