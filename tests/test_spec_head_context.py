"""What the head drafts over is reported with the settings and in the benchmark report's header, so a
report's τ is known to be the τ the same head gives in SGLang (whose worker attends the whole prefix)."""
from __future__ import annotations

from eagle3_platform.bench.report import head_context, markdown
from eagle3_platform.spec.config import HEAD_CONTEXT, PRESETS

CFG = {"prompts": "prompts.jsonl", "n_prompts": 1, "workloads": ["chat"], "max_tokens": 8, "duration_s": 1,
       "concurrency": [1], "endpoints": {"eagle3": "u"}}


def _report(info: dict) -> str:
    return markdown({"servers": {"eagle3": info}, "config": CFG, "runs": []}, [])


def test_the_settings_say_the_head_attends_the_whole_prefix():
    assert HEAD_CONTEXT == "whole prefix"
    assert all(cfg.to_dict()["head_context"] == HEAD_CONTEXT for cfg in PRESETS.values())


def test_the_report_header_names_the_heads_context():
    embedded = {"draft": True, "spec": "chain_adaptive_lookup", "spec_config": PRESETS["chain"].to_dict()}
    md = _report(embedded)
    assert "Head context: whole prefix (as SGLang's EAGLE-3 worker" in md
    assert md.index("Head context") < md.index("## Headline")
    assert head_context({"servers": {"eagle3": {"draft": True, "speculative_algorithm": "EAGLE3"}}}) == "whole prefix"
    windowed = {**embedded, "spec_config": {**embedded["spec_config"], "head_context": "last 32 tokens"}}
    assert "Head context: last 32 tokens (SGLang's head attends the whole prefix" in _report(windowed)
    # no head (a baseline-only run), or a server that does not say: no claim
    assert "Head context" not in _report({"draft": False}) and "Head context" not in _report({"draft": True})
