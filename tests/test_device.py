"""Where the target, the head, the KV cache and the decode path's tensors live: device resolution
(auto | cpu | cuda | cuda:N, an absent device refused at startup), the load plan (CPU-only kernels
off on a GPU), the engine's and local regeneration's allocations following the model's device, and
the device + dtype recorded in /server_info and in regeneration's summary."""
from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from starlette.testclient import TestClient

from eagle3_platform.model.target import load_plan, load_target, pick_device

PROMPT = [{"role": "user", "content": "What does a mutex protect against? Explain briefly."}]


@pytest.fixture()
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture()
def fake_cuda(monkeypatch):
    """torch sees one bf16-capable GPU (nothing is loaded on it: only decisions are tested)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


@contextlib.contextmanager
def default_device(device: str):
    """Tensors made without a device go to `device` in this thread (meta: no data, so any decode
    tensor made there instead of on the model's device fails the run)."""
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def chat_ids(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=False)


# ---- resolution ---------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_a_gpu(no_cuda):
    assert pick_device("auto") == "cpu"
    assert pick_device("cpu") == "cpu"


@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_asked_for_without_one_is_refused(no_cuda, name):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        pick_device(name)


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "gpu", ""])
def test_unknown_devices_are_refused(name):
    with pytest.raises(ValueError, match="expected auto"):
        pick_device(name)


def test_auto_picks_cuda_where_torch_sees_one(fake_cuda):
    assert pick_device("auto") == "cuda"
    assert pick_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match="sees 1 CUDA GPU"):
        pick_device("cuda:1")


def test_the_gpu_plan_switches_the_cpu_kernels_off(fake_cuda):
    gpu = load_plan("auto", "cuda", pack=True, grouped=True)
    assert (gpu.device, gpu.dtype, gpu.kv_cache_dtype) == ("cuda", "bfloat16", "bfloat16")
    assert not gpu.pack and not gpu.grouped_decode
    assert gpu.int4_rows == gpu.rowmajor_rows == gpu.wide_fp32_rows == 0
    assert load_plan("float32", "cuda:0", pack=True, grouped=True).dtype == "float32"  # explicit stays


def test_the_cpu_plan_keeps_its_kernels():
    cpu = load_plan("float32", "cpu", pack=True, grouped=True)
    assert (cpu.device, cpu.dtype, cpu.kv_cache_dtype) == ("cpu", "float32", "float32")
    assert cpu.pack and cpu.grouped_decode
    assert not load_plan("float32", "cpu", pack=False, grouped=False).pack


def test_head_weights_off_the_cpu_are_native():
    from eagle3_platform.spec.engine import SpecEngine

    gpu = SimpleNamespace(device=torch.device("cuda"), target=SimpleNamespace(meta={"int4_rows": 5}))
    assert SpecEngine.resolve_head_weights(gpu, "auto") == "native"
    assert SpecEngine.resolve_head_weights(gpu, "native") == "native"
    with pytest.raises(ValueError, match="CPU kernels only"):
        SpecEngine.resolve_head_weights(gpu, "int8")


def test_load_target_refuses_an_absent_device_and_records_the_one_used(tiny_target_dir, no_cuda):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        load_target(tiny_target_dir, device="cuda")
    t = load_target(tiny_target_dir, device="auto")
    assert t.meta["device"] == "cpu" and next(t.model.parameters()).device.type == "cpu"


# ---- allocations follow the model's device --------------------------------------------------------
def test_engine_allocates_on_the_models_device(tiny_target_dir, random_head_export):
    """With the thread's default device meta, the engine's decode (drafting, verify, caches, sampling)
    still runs exactly on the CPU model: every tensor it makes without a device goes to the model's.
    Without that scope the same run fails (meta tensors hold no data)."""
    from eagle3_platform.serve.server import build_engine

    engine, target, _ = build_engine(tiny_target_dir, random_head_export, "chain", dtype="float32", device="cpu")
    ids = chat_ids(target.tokenizer)
    greedy, sampled = engine.generate(ids, 6)[0], engine.generate(ids, 6, temperature=0.8, seed=3)[0]
    with default_device("meta"):
        assert engine.generate(ids, 6)[0] == greedy
        assert engine.generate(ids, 6, temperature=0.8, seed=3)[0] == sampled
        engine.on_device = contextlib.nullcontext  # the scope off: the same decode cannot run
        with pytest.raises(Exception):
            engine.generate(ids, 6)


def test_local_decoding_allocates_on_the_models_device(tiny_target):
    from eagle3_platform.data.local_gen import Sampling, generate_batch

    tok = tiny_target.tokenizer
    prompts = [tok.encode("hello there " * k) for k in (1, 3, 7)]
    for s in (Sampling(), Sampling(True, 0.9, 0.9)):
        def run():
            return [g.tokens for g in generate_batch(tiny_target.model, prompts, [5] * 3, {tok.eos_token_id},
                                                     tok.pad_token_id, s, seeds=[1, 2, 3])]
        expected = run()
        with default_device("meta"):
            assert run() == expected


# ---- recorded ----------------------------------------------------------------------------------
def test_server_info_carries_device_and_dtype(tiny_target_dir, no_cuda):
    from eagle3_platform.serve.config import ServeConfig
    from eagle3_platform.serve.server import build_app, build_engine

    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        build_engine(tiny_target_dir, None, "chain", dtype="float32", device="cuda")
    engine, target, info = build_engine(tiny_target_dir, None, "chain", dtype="float32", device="auto")
    app = build_app(engine, target.tokenizer, ServeConfig(allowed_hosts=("testserver",)), model_name="m",
                    context_length=2048, info=info)
    with TestClient(app) as c:
        got = c.get("/server_info").json()
    assert (got["device"], got["dtype"]) == ("cpu", "float32")


def test_serve_and_regenerate_take_a_device_flag():
    from eagle3_platform.cli import build_parser
    from eagle3_platform.cli.serve import serve_config
    from eagle3_platform.data.stages import RegenerateRequest, regen_config

    parser = build_parser()
    assert serve_config(parser.parse_args(["serve", "--target", "t"])).device == "auto"
    assert serve_config(parser.parse_args(["serve", "--target", "t", "--device", "cuda:1"])).device == "cuda:1"
    a = parser.parse_args(["regenerate", "--target", "t", "--in", "i", "--out", "o", "--device", "cpu"])
    assert a.device == "cpu"
    req = RegenerateRequest(target="t", in_path="i", out="o", preset="tiny", device="cuda")
    assert regen_config(req).device == "cuda"
    assert regen_config(RegenerateRequest(target="t", in_path="i", out="o", preset="tiny")).device == "auto"


def test_the_cli_refuses_an_absent_device_in_one_line(tiny_target_dir, tmp_path, capsys, no_cuda):
    from eagle3_platform.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text("")
    for argv in (["serve", "--target", tiny_target_dir, "--port", "0", "--device", "cuda"],
                 ["regenerate", "--target", tiny_target_dir, "--in", inp, "--out", tmp_path / "o.jsonl",
                  "--device", "cuda:0"]):
        assert main([str(a) for a in argv]) == 2
        out, err = capsys.readouterr()
        assert "sees no CUDA GPU" in err and "Traceback" not in err
        assert json.loads(out.strip().splitlines()[-1])["ok"] is False


def test_regeneration_records_device_and_dtype(tiny_target_dir, tmp_path, no_cuda):
    from eagle3_platform.data.regenerate import PRESETS, regenerate_file

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "r0", "workload": "chat", "source": "test", "license": "mit",
                               "messages": PROMPT, "n_chars": 50}) + "\n")
    cfg = replace(PRESETS["tiny"], max_new_tokens=4, progress_every_s=60.0)
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        regenerate_file(tiny_target_dir, inp, tmp_path / "gpu.jsonl", replace(cfg, device="cuda"), scanner=False)
    assert not (tmp_path / "gpu.jsonl").exists()  # refused before any output
    s = regenerate_file(tiny_target_dir, inp, tmp_path / "out.jsonl", replace(cfg, device="cpu"), scanner=False)
    assert (s["device"], s["dtype"], s["written"]) == ("cpu", "float32", 1)
    key = json.loads((tmp_path / "out.jsonl.key.json").read_text())
    assert "device" not in key  # the CPU's outputs keep the key they had


def test_the_serving_resource_passes_the_device_to_the_embedded_server(monkeypatch):
    import eagle3_platform.serve.launch as launch
    from resources.serving import ServingResource

    seen = []
    monkeypatch.setattr(launch, "start_embedded_server", lambda *a, **kw: seen.append(kw["extra_args"]))
    ServingResource(mode="embedded", device="cuda:1").launch("t", preset="tiny")
    ServingResource(mode="embedded").launch("t", preset="tiny")
    assert seen[0][-2:] == ["--device", "cuda:1"] and "--device" not in seen[1]  # None: the serve preset's
