"""The regeneration config for a preset + target (shared by filtered_prompts' length bound and
target_responses)."""
from resources import PresetResource, TargetResource
from resources.preset import with_overrides


def regen_config(preset: PresetResource, target: TargetResource):
    return with_overrides(preset.area("regen"), max_length=target.max_length)
