"""Asset jobs the sensors and the UI launch."""

from dagster import AssetSelection, define_asset_job

PARTITIONED = ("filtered_prompts", "target_responses", "feature_shards")
DRAFT = ("draft_vocab", "draft_head")
SERVE = ("deployment", "benchmark_report")

# Observing the sources records a data version per workload (what automation and `eagle3 run` compare).
observe_job = define_asset_job("observe_workload_sources", selection=AssetSelection.assets("workload_sources"),
                               description="Observe the workload sources (content hash per workload).")
# One workload partition from prompts to features (what a source change invalidates).
workload_job = define_asset_job("workload_refresh", selection=AssetSelection.assets(*PARTITIONED),
                                description="Re-materialize one workload partition: prompts → features.")
# Vocab + head (+ its blocking checks) from all available feature partitions.
draft_job = define_asset_job("draft_retrain", selection=AssetSelection.assets(*DRAFT),
                             description="Rebuild the draft vocabulary and retrain/export the head.")
serve_job = define_asset_job("deploy_and_benchmark", selection=AssetSelection.assets(*SERVE),
                             description="Deploy the exported head and run the Locust benchmark.")
