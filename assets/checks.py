"""Asset checks. `draft_head_acceptance` is blocking: a head whose held-out simulated acceptance is
below the preset's bar is not deployed (downstream assets do not run). `deployment_answers` says
whether the recorded endpoint is up now; run it from the asset page at any time."""

import json
from dataclasses import dataclass

from dagster import (AssetCheckExecutionContext, AssetCheckResult, AssetCheckSeverity, AssetKey, MetadataValue,
                     asset_check)

from assets.deploy import deployment, is_up
from assets.draft import draft_head
from assets.partitions import Keys
from resources import PresetResource, ServingResource, StorageResource


@dataclass(frozen=True)
class AcceptanceGate:
    min_heldout_acceptance: float  # simulated acceptance = 1 + Σ_k Π_{i≤k} acc_i (≥ 1 by definition)


GATES: dict[str, AcceptanceGate] = {
    "tiny": AcceptanceGate(1.0),  # random tiny target: only asserts the metric exists and is sane
    "demo": AcceptanceGate(1.2),  # a few minutes of CPU training must beat "never accepted" (1.0)
    "cpu": AcceptanceGate(1.2),  # two hours of CPU training: at least the demo's bar
    "full": AcceptanceGate(2.0),
}


@asset_check(asset=draft_head, blocking=True,
             description="Held-out simulated acceptance of the trained head ≥ the preset's bar.")
def draft_head_acceptance(context: AssetCheckExecutionContext, preset: PresetResource) -> AssetCheckResult:
    ev = context.instance.get_latest_materialization_event(AssetKey("draft_head"))
    meta = ev.asset_materialization.metadata if ev else {}
    value = meta.get("heldout_simulated_acceptance")
    value = getattr(value, "value", value)
    gate = GATES[preset.name]
    if value is None:
        return AssetCheckResult(passed=False, description="no held-out acceptance recorded")
    return AssetCheckResult(passed=float(value) >= gate.min_heldout_acceptance,
                            metadata={"heldout_simulated_acceptance": float(value),
                                      "threshold": gate.min_heldout_acceptance, "preset": preset.name})


def endpoint_state(desc: dict | None, headers: dict) -> tuple[bool, str]:
    """(as recorded?, what serves now) for a deployment description: a persistent endpoint must
    answer /health now; a transient one was meant to stop with its step, so it passes as such."""
    if desc is None:
        return False, "no deployment recorded"
    if not desc.get("persistent"):
        return True, f"transient: {desc['url']} served its step's checks and stopped with it (as designed)"
    if is_up(desc["url"], headers):
        return True, f"persistent: {desc['url']} (pid {desc.get('pid')}) answers /health now"
    return False, f"persistent: {desc['url']} (pid {desc.get('pid')}) does not answer /health now"


@asset_check(asset=deployment, description="Whether the recorded endpoint is up now (a persistent one must "
             "answer /health; a transient one stopped with its step). Run it any time from the asset page.")
def deployment_answers(storage: StorageResource, serving: ServingResource) -> AssetCheckResult:
    raw = storage.storage().get_bytes(Keys.DEPLOYMENT) if storage.storage().exists(Keys.DEPLOYMENT) else None
    desc = json.loads(raw) if raw else None
    headers = {"Authorization": f"Bearer {serving.api_key}"} if serving.api_key else {}
    ok, state = endpoint_state(desc, headers)
    return AssetCheckResult(passed=ok, severity=AssetCheckSeverity.WARN, description=state,
                            metadata={"state": MetadataValue.text(state),
                                      **({"url": MetadataValue.text(desc["url"])} if desc else {})})
