"""Asset checks. `draft_head_acceptance` is blocking: a head whose held-out simulated acceptance is
below the preset's bar is not deployed (downstream assets do not run)."""

from dataclasses import dataclass

from dagster import AssetCheckExecutionContext, AssetCheckResult, AssetKey, asset_check

from assets.draft import draft_head
from resources import PresetResource


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
