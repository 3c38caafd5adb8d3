"""`deployment` and `benchmark_report` in SGLang mode, through Dagster, against a stand-in
`sglang.launch_server` run by the configured SGLang interpreter: it parses SGLang's flags, records its
argv, and serves the fake engine over the project's own OpenAI-compatible app (streaming, /health,
/server_info). The two benchmark servers start one after the other, each held to the bench memory
fraction, and every `serving` field reaches the command line."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
from dagster import DagsterInstance, materialize

from dagster_helpers import GRAPH, meta
from resources import ComputeResource, PresetResource, ServingResource, StorageResource, TargetResource

STAND_IN = textwrap.dedent('''
    """Stand-in for `python -m sglang.launch_server` (tests): SGLang's flags in, the fake engine out."""
    import argparse, json, os, sys, time
    ap = argparse.ArgumentParser()
    for flag in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path", "--host",
                 "--api-key", "--dtype", "--chunked-prefill-size"):
        ap.add_argument(flag)
    for flag in ("--port", "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--tp-size", "--context-length"):
        ap.add_argument(flag, type=int)
    ap.add_argument("--mem-fraction-static", type=float)
    args = ap.parse_args()  # an unknown flag fails here, as SGLang's own parser would
    rec = {"argv": sys.argv[1:], "args": vars(args), "spec_v2": os.environ.get("SGLANG_ENABLE_SPEC_V2"),
           "started": time.time()}
    from eagle3_platform.model.target import tiny_tokenizer
    from eagle3_platform.serve.config import PRESETS
    from eagle3_platform.serve.server import bind_socket, build_app, run_server
    from eagle3_platform.testing.serve import FakeEngine, word_token_ids
    sock = bind_socket(args.host, args.port)
    tok = tiny_tokenizer()
    cfg = PRESETS["tiny"].with_(host=args.host, port=args.port)
    app = build_app(FakeEngine(word_token_ids(tok), chunk=2 if args.speculative_algorithm else 1), tok, cfg,
                    model_name="default", context_length=512, api_key=args.api_key,
                    info={"draft": bool(args.speculative_algorithm), "spec": "stand-in"})
    rec["ready"] = time.time()
    with open(os.environ["FAKE_SGLANG_RECORD"], "a") as f:
        f.write(json.dumps(rec) + "\\n")
    run_server(app, cfg, sock=sock)
''')
pytestmark = pytest.mark.integration


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkgs" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(STAND_IN)
    record = tmp_path / "launches.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fakepkgs"))
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    return record


def seeded_storage(root, tiny_target_dir) -> StorageResource:
    """What deployment and benchmark_report read: an export and held-out prompts."""
    from eagle3_platform.testing.serve import random_export

    random_export(tiny_target_dir, root / "draft" / "export")
    kept = root / "code" / "filtered_prompts" / "eval" / "kept.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text("".join(json.dumps({"id": f"p{i}", "workload": "code", "source": "t", "license": "mit",
                                        "messages": [{"role": "user", "content": f"Write a loop {i}."}]}) + "\n"
                            for i in range(4)))
    return StorageResource(root=str(root))


def test_sglang_deployment_and_benchmark_with_every_serving_field(tmp_path, tiny_target_dir, stand_in):
    serving = ServingResource(mode="sglang", sglang_python=sys.executable, api_key="k", tp_size=2,
                              mem_fraction_static=0.81, bench_mem_fraction_static=0.4, context_length=4096,
                              dtype="bfloat16", spec_v2=True, extra_args=["--chunked-prefill-size", "4096"],
                              num_steps=3, eagle_topk=1, num_draft_tokens=4, bench_duration_s=1,
                              startup_timeout_s=60)
    storage = seeded_storage(tmp_path / "data", tiny_target_dir)
    res = {"storage": storage, "preset": PresetResource(name="tiny"), "serving": serving, "compute": ComputeResource(),
           "target": TargetResource(model=str(tiny_target_dir), prepared_dir=str(tiny_target_dir))}
    with DagsterInstance.ephemeral() as inst:
        result = materialize(GRAPH, selection=["deployment", "benchmark_report"], instance=inst, resources=res)
    assert result.success
    launches = [json.loads(line) for line in stand_in.read_text().splitlines()]
    deploy, base, spec = launches
    # the deployment: every field on its command line, the api key too
    assert deploy["args"] | {"port": None} == {
        "model_path": str(tiny_target_dir), "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(storage.local_path("draft/export")), "host": "127.0.0.1",
        "port": None, "api_key": "k", "dtype": "bfloat16", "chunked_prefill_size": "4096",
        "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
        "tp_size": 2, "context_length": 4096, "mem_fraction_static": 0.81}
    assert deploy["spec_v2"] == "True"
    # the benchmark: baseline first and serving before the EAGLE-3 server starts; each at the bench fraction
    assert base["args"]["speculative_algorithm"] is None and base["spec_v2"] is None
    assert spec["args"]["speculative_algorithm"] == "EAGLE3" and spec["spec_v2"] == "True"
    assert base["ready"] <= spec["started"]
    for r in (base, spec):
        assert r["args"]["mem_fraction_static"] == 0.4 and r["args"]["tp_size"] == 2
        assert r["args"]["context_length"] == 4096 and r["args"]["dtype"] == "bfloat16"
    # the recorded command: the SGLang interpreter, the real flags, the key masked
    m = meta(result, "deployment")
    assert "launch_command" in m and "--api-key REDACTED" in m["launch_command"] and " k " not in m["launch_command"]
    desc = json.loads(storage.fetch("deployment/deployment.json").read_text())
    assert desc["launch_command"].startswith(f"SGLANG_ENABLE_SPEC_V2=True {sys.executable} -m sglang.launch_server")
    assert "--mem-fraction-static 0.81" in desc["launch_command"] and "--tp-size 2" in desc["launch_command"]
    bench = meta(result, "benchmark_report")
    assert "cells" in bench


def test_bench_memory_fraction_must_let_two_servers_fit():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="less than or equal"):
        ServingResource(mode="sglang", bench_mem_fraction_static=0.6)
    with pytest.raises(ValueError, match="topk=1"):  # spec v2 with tree drafting: refused before launch
        ServingResource(mode="sglang", spec_v2=True, num_steps=2, eagle_topk=4, num_draft_tokens=8
                        ).sglang_config("/t", "/d", "tiny", port=30000)


def test_missing_sglang_environment_is_named(tmp_path, tiny_target_dir):
    serving = ServingResource(mode="sglang", sglang_python=str(tmp_path / "nope" / "python"))
    with pytest.raises(FileNotFoundError, match="scripts/sglang_env.sh"):
        serving.launch(tiny_target_dir, None, preset="tiny", port=30000)
    assert serving.resolved_mode() == "sglang"
    assert ServingResource(mode="auto", sglang_python=str(tmp_path / "nope")).resolved_mode() == "embedded"
