"""The named jobs: what the sensors, the UI and `eagle3 run` launch.

`eagle3 run` launches these same jobs with `asset_selection` narrowed to what is missing or stale, so
its runs carry the job's name and can be re-executed and backfilled from the UI.
"""

from dagster import AssetSelection, define_asset_job, in_process_executor

PARTITIONED = ("filtered_prompts", "target_responses", "feature_shards")
DRAFT = ("draft_vocab", "draft_head")
SERVE = ("deployment", "benchmark_report")

# A job's steps run one after another (each reads what the last published), so one process runs them
# all: no process start per step, and the loaded target is shared.
SEQUENTIAL = {"executor_def": in_process_executor}

# Observing the sources records a data version per workload (what automation and `eagle3 run` compare).
observe_job = define_asset_job("observe_workload_sources", selection=AssetSelection.assets("workload_sources"),
                               **SEQUENTIAL, description="Observe the workload sources (content hash per workload).")
# One workload partition from prompts to features (what a source change invalidates).
workload_job = define_asset_job("workload_refresh", selection=AssetSelection.assets(*PARTITIONED), **SEQUENTIAL,
                                description="Re-materialize one workload partition: prompts → features.")
# Vocab + head (+ its blocking checks) from all available feature partitions.
draft_job = define_asset_job("draft_retrain", selection=AssetSelection.assets(*DRAFT), **SEQUENTIAL,
                             description="Rebuild the draft vocabulary and retrain/export the head.")
serve_job = define_asset_job("deploy_and_benchmark", selection=AssetSelection.assets(*SERVE), **SEQUENTIAL,
                             description="Deploy the exported head and run the Locust benchmark.")

# asset -> the job whose run (re)builds it
JOB_OF = {**dict.fromkeys(PARTITIONED, workload_job.name), **dict.fromkeys(DRAFT, draft_job.name),
          **dict.fromkeys(SERVE, serve_job.name)}
