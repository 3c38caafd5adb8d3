"""Dagster assets: thin wrappers that read config/partition, call one library step, and report
metadata. Everything heavy lives in `eagle3_platform` (which never imports Dagster). Beside them: the
checks, the named jobs and the sensor, and `assets.launch` (what `eagle3 run` runs)."""
from assets.bench import benchmark_report
from assets.checks import deployment_answers, draft_head_acceptance
from assets.deploy import deployment
from assets.draft import draft_head, draft_vocab
from assets.features import feature_shards
from assets.jobs import draft_job, observe_job, serve_job, workload_job
from assets.prompts import filtered_prompts
from assets.responses import target_responses
from assets.sensors import draft_retrain_sensor
from assets.sources import workload_sources

ALL_ASSETS = [workload_sources, filtered_prompts, target_responses, feature_shards, draft_vocab,
              draft_head, deployment, benchmark_report]
ALL_CHECKS = [draft_head_acceptance, deployment_answers]
ALL_JOBS = [observe_job, workload_job, draft_job, serve_job]
ALL_SENSORS = [draft_retrain_sensor]
