"""Training: CLI smoke, resume after SIGKILL == uninterrupted (within float tolerance), DDP 2 gloo procs == 1 proc."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_platform.draft import train as train_mod
from eagle3_platform.draft.train import (PRESETS, TrainConfig, batch_plan, epoch_batches, lr_at, noisy_features,
                                        train, trainable_lengths)
from eagle3_platform.testing.synthetic import target_features

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def features(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_feats")
    return (target_features(tiny_target_dir, root / "train", n_samples=12, seed=0),
            target_features(tiny_target_dir, root / "eval", n_samples=4, seed=1))


def _cli(*args, wait=True, preset="tiny"):
    cmd = [sys.executable, "-m", "eagle3_platform.cli", "train", "--preset", preset, "--threads", "1", *args]
    p = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_plan_and_schedule_are_pure_functions():
    cfg = PRESETS["tiny"]
    lengths = [30, 12, 50, 7, 100, 64, 9, 40]
    assert batch_plan(lengths, cfg) == batch_plan(lengths, cfg)
    plan = batch_plan(lengths, cfg)
    for epoch in range(cfg.epochs):                                                  # each epoch = all samples
        assert sorted(i for b in epoch_batches(lengths, cfg, epoch) for i in b) == list(range(8))
    assert plan == [b for e in range(cfg.epochs) for b in epoch_batches(lengths, cfg, e)]
    assert all(sum(min(lengths[i], cfg.max_len) for i in b) <= cfg.batch_tokens or len(b) == 1 for b in plan)
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert max(lrs) == pytest.approx(cfg.lr) and lrs[0] < lrs[10] and lrs[-1] < 0.01 * cfg.lr


def test_batches_group_similar_lengths():
    """Padding to the longest sample of a batch wastes little once windows are sorted by length."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randint(100, 300, (400,), generator=g).tolist()
               + torch.randint(900, 1500, (100,), generator=g).tolist())   # chat-like + long-context-like
    cfg = replace(PRESETS["cpu"], epochs=1)
    plan = batch_plan(lengths, cfg)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
    assert padded < 1.15 * sum(lengths)                   # a random mix pads ~2x (measured on cpu data)
    assert len({len(b) for b in plan}) > 1                # short-sample batches hold more samples
    longest = [max(lengths[i] for i in b) for b in plan]
    assert longest != sorted(longest, reverse=True)       # batch order is shuffled, not long-to-short


@pytest.mark.integration
def test_cli_train_outputs_and_eval(tiny_target_dir, features, tmp_path):
    out = tmp_path / "d"
    s = _cli("--target", str(tiny_target_dir), "--features", str(features[0]), "--out", str(out),
             "--eval-features", str(features[1]))
    assert s["ok"] and s["steps"] > 0 and len(s["eval"]["acc"]) == PRESETS["tiny"].ttt_steps
    assert s["compute_dtype"] == "float32"  # the tiny preset pins it; `auto` is resolved and recorded
    assert 1.0 <= s["eval_simulated_acceptance"] <= 1 + PRESETS["tiny"].ttt_steps
    for f in ("draft.safetensors", "draft_config.json", "metrics.json", "vocab.safetensors"):
        assert (out / f).exists()
    assert "embed_tokens.weight" not in load_file(str(out / "draft.safetensors"))


@pytest.mark.integration
@pytest.mark.parametrize("preset", ["tiny", "cpu"])  # cpu: its K, Vd, batch and bf16 autocast where it pays
def test_resume_after_sigkill_matches_the_uninterrupted_run(tiny_target_dir, features, tmp_path, preset):
    common = ["--target", str(tiny_target_dir), "--features", str(features[0]), "--epochs", "20",
              "--ckpt-every", "2"]
    ref = _cli(*common, "--out", str(tmp_path / "ref"), preset=preset)
    total = ref["steps"]
    killed = tmp_path / "killed"
    p = _cli(*common, "--out", str(killed), wait=False, preset=preset)
    state, deadline = killed / "checkpoint" / "state.json", time.time() + 240
    while time.time() < deadline and p.poll() is None:
        try:
            if json.loads(state.read_text())["step"] >= 4:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "draft.safetensors").exists()
    step_at_kill = json.loads(state.read_text())["step"]
    assert 0 < step_at_kill < total
    resumed = _cli(*common, "--out", str(killed), "--resume", preset=preset)
    assert resumed["resumed_from"] == step_at_kill
    a, b = load_file(str(tmp_path / "ref" / "draft.safetensors")), load_file(str(killed / "draft.safetensors"))
    assert set(a) == set(b)
    # same data order, schedule and RNG state, so the runs agree to rounding: two processes may still
    # pick other kernels (oneDNN) for a reduction; a resume bug (lost AdamW moments, a shifted step or
    # batch) moves weights by ~lr per step, orders of magnitude beyond this tolerance
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)


def test_resume_refuses_a_checkpoint_made_on_other_data_in_the_same_dir(tiny_target_dir, tmp_path):
    """Features re-extracted into the same dir with as many samples (other conversations): the
    checkpoint was trained on other data, so --resume must refuse it, not go on from it."""
    feats, out = tmp_path / "feats", tmp_path / "out"
    cfg = replace(PRESETS["tiny"], epochs=1, num_threads=1)
    target_features(tiny_target_dir, feats, n_samples=6, seed=0)
    train(tiny_target_dir, [str(feats)], out, cfg)
    assert train(tiny_target_dir, [str(feats)], out, cfg, resume=True)["resumed_from"] > 0  # same data
    target_features(tiny_target_dir, feats, n_samples=6, seed=1)
    with pytest.raises(ValueError, match="written for a different run"):
        train(tiny_target_dir, [str(feats)], out, cfg, resume=True)


@pytest.mark.integration
def test_ddp_two_gloo_processes_match_one(tiny_target_dir, features, tmp_path):
    common = ["--target", str(tiny_target_dir), "--features", str(features[0])]
    one = _cli(*common, "--out", str(tmp_path / "one"))
    # rank 0 only on the console: both ranks print the same summary line, which could interleave
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--local-ranks-filter", "0",
           "-m", "eagle3_platform.cli", "train", "--preset", "tiny", "--threads", "1", *common,
           "--out", str(tmp_path / "two")]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    two = json.loads(r.stdout.strip().splitlines()[-1])
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["steps"] == one["steps"]
    assert two["train_tokens"] == one["train_tokens"] and "train_eval" in two
    h1 = json.loads((tmp_path / "one" / "metrics.json").read_text())["history"]
    h2 = json.loads((tmp_path / "two" / "metrics.json").read_text())["history"]
    assert [h["loss"] for h in h2] == pytest.approx([h["loss"] for h in h1], rel=1e-5)
    a, b = load_file(str(tmp_path / "one" / "draft.safetensors")), load_file(str(tmp_path / "two" / "draft.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-4)


def test_supervise_setting_is_checked_and_overridable():
    from pydantic import ValidationError

    from eagle3_platform.draft.stages import TrainRequest, train_config

    with pytest.raises(ValueError, match="supervise must be one of"):
        replace(PRESETS["tiny"], supervise="prompts")
    req = dict(target="t", features=["f"], out="o", preset="cpu")
    assert train_config(TrainRequest(**req)).supervise == PRESETS["cpu"].supervise  # the preset's
    assert train_config(TrainRequest(**req, supervise="all")).supervise == "all"
    with pytest.raises(ValidationError):
        TrainRequest(**req, supervise="prompts")
    assert train_config(TrainRequest(**req)).feature_noise == PRESETS["cpu"].feature_noise
    assert train_config(TrainRequest(**req, feature_noise=0.3)).feature_noise == 0.3
    with pytest.raises(ValidationError):
        TrainRequest(**req, feature_noise=1.5)


@pytest.mark.integration
def test_supervise_all_trains_prompt_positions_too(tiny_target_dir, features, tmp_path):
    """supervise=all adds the prompt positions to the loss (the teacher is the target's distribution
    there too); the held-out metrics still count response positions only, so heads compare alike."""
    runs = {}
    for mode in ("response", "all"):
        cfg = replace(PRESETS["tiny"], supervise=mode, num_threads=1)
        runs[mode] = train(tiny_target_dir, [features[0]], tmp_path / mode, cfg, eval_dirs=[features[1]])
    trained = {m: sum(h["supervised"][0] for h in s["history"]) for m, s in runs.items()}
    # ~40% of each sample is prompt, but only positions whose target top-1 is in the draft vocab (built
    # from response tokens) are trained: on random prompt ids few are
    assert trained["all"] > trained["response"] > 0
    assert runs["all"]["eval"]["response_positions"] == runs["response"]["eval"]["response_positions"]
    assert runs["all"]["steps"] == runs["response"]["steps"]  # same data plan: only the mask differs


def test_resume_of_a_checkpoint_from_before_the_supervise_setting(tiny_target_dir, tmp_path):
    """Checkpoints written before `supervise` (and `feature_noise`) existed trained response positions
    without noise: an upgrade in the middle of a training resumes them under the defaults, and refuses
    them for supervise=all."""
    feats, out = tmp_path / "feats", tmp_path / "out"
    cfg = replace(PRESETS["tiny"], epochs=1, num_threads=1)
    target_features(tiny_target_dir, feats, n_samples=6, seed=0)
    train(tiny_target_dir, [str(feats)], out, cfg)
    state_path = out / "checkpoint" / "state.json"
    state = json.loads(state_path.read_text())
    del state["fingerprint"]["train"]["supervise"]
    del state["fingerprint"]["train"]["feature_noise"]
    state_path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="written for a different run"):
        train(tiny_target_dir, [str(feats)], out, replace(cfg, supervise="all"), resume=True)
    assert train(tiny_target_dir, [str(feats)], out, cfg, resume=True)["resumed_from"] > 0


def test_feature_noise_is_bounded_per_layer_and_seeded():
    H = 8
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.1, 1.0, 30.0])  # three layers whose features differ in scale
    aux = (torch.randn(2, 5, 3, H, generator=g) * scales[:, None]).view(2, 5, 3 * H)
    aux[1, 3:] = 0  # padding rows
    noisy = noisy_features(aux, H, 0.2, seed=7)
    x, y = aux.view(2, 5, 3, H), noisy.view(2, 5, 3, H)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((y - x).abs() <= 0.2 * rms + 1e-6).all()        # at most a·rms per element, per layer
    rel = ((y - x).pow(2).mean(-1).sqrt() / rms.squeeze(-1).clamp(min=1e-9))[0]
    assert (rel > 0.02).all()                               # every layer moved, the small one too
    assert torch.equal(noisy[1, 3:], aux[1, 3:])            # padding stays zero
    torch.testing.assert_close(noisy_features(aux, H, 0.2, seed=7), noisy)
    assert not torch.allclose(noisy_features(aux, H, 0.2, seed=8), noisy)
    with pytest.raises(ValueError, match="feature_noise"):
        TrainConfig(feature_noise=-0.1)


def crash_at_step(monkeypatch, step: int):
    """Training raises at optimizer step `step` until the returned real step function is put back."""
    real = train_mod._train_step

    def crash(*args, **kw):
        if args[-1] == step:
            raise RuntimeError("simulated crash")
        return real(*args, **kw)

    monkeypatch.setattr(train_mod, "_train_step", crash)
    return real


def test_feature_noise_trains_otherwise_and_resumes_exactly(tiny_target_dir, tmp_path, monkeypatch):
    """Noise changes what the head learns; a run stopped by a crash and resumed draws the same noise
    per step as an uninterrupted one, so it ends with the same weights."""
    feats = target_features(tiny_target_dir, tmp_path / "f", n_samples=6, seed=0)
    cfg = replace(PRESETS["tiny"], epochs=8, num_threads=1, ckpt_every=2, feature_noise=0.3)
    ref = train(tiny_target_dir, [str(feats)], tmp_path / "ref", cfg)
    plain = train(tiny_target_dir, [str(feats)], tmp_path / "plain", replace(cfg, feature_noise=0.0))
    assert ref["steps"] == plain["steps"] >= 4
    a = load_file(str(tmp_path / "ref" / "draft.safetensors"))
    b = load_file(str(tmp_path / "plain" / "draft.safetensors"))
    assert any(not torch.allclose(a[k], b[k], atol=1e-4) for k in a)

    real = crash_at_step(monkeypatch, 3)  # step 3: after the checkpoint of step 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_target_dir, [str(feats)], tmp_path / "crashed", cfg)
    monkeypatch.setattr(train_mod, "_train_step", real)
    resumed = train(tiny_target_dir, [str(feats)], tmp_path / "crashed", cfg, resume=True)
    assert resumed["resumed_from"] == 2
    c = load_file(str(tmp_path / "crashed" / "draft.safetensors"))
    for k in a:
        torch.testing.assert_close(c[k], a[k], atol=1e-6, rtol=1e-5, msg=k)


def test_train_device_resolution(monkeypatch):
    assert train_mod.train_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train_mod.train_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        train_mod.train_device("cuda")
    for bad in ("mps", "gpu0"):  # another device type; not a device at all
        with pytest.raises(ValueError, match="expected auto, cpu or cuda"):
            train_mod.train_device(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a torchrun rank: one GPU per process
    assert train_mod.train_device("auto") == torch.device("cuda", 1)
    assert train_mod.train_device("cuda:0") == torch.device("cuda", 0)


def _relative_gap(a: dict, b: dict) -> float:
    """The largest ||a[k] - b[k]|| / ||a[k]|| over the float tensors of two weight files."""
    return max(float((a[k].float() - b[k].float()).norm() / a[k].float().norm().clamp(min=1e-12))
               for k in a if a[k].is_floating_point())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="trains on a CUDA device: run on a GPU machine")
def test_cuda_training_matches_the_cpu_and_resumes_across_devices(tiny_target_dir, tmp_path, monkeypatch):
    """fp32 on CUDA ends within rounding of the CPU run's weights (other kernels, same arithmetic); a run
    crashed on CUDA resumes on the CPU (checkpoints hold CPU tensors) and ends there too; `auto` trains
    in bf16 on the GPU."""
    feats = target_features(tiny_target_dir, tmp_path / "f", n_samples=6, seed=0)
    cfg = replace(PRESETS["tiny"], epochs=6, num_threads=1, ckpt_every=2)
    cpu = train(tiny_target_dir, [str(feats)], tmp_path / "cpu", replace(cfg, device="cpu"))
    gpu = train(tiny_target_dir, [str(feats)], tmp_path / "gpu", replace(cfg, device="cuda"))
    assert (cpu["device"], gpu["device"]) == ("cpu", "cuda") and cpu["steps"] == gpu["steps"] >= 4
    ref = load_file(str(tmp_path / "cpu" / "draft.safetensors"))
    assert _relative_gap(ref, load_file(str(tmp_path / "gpu" / "draft.safetensors"))) < 1e-3

    real = crash_at_step(monkeypatch, 3)  # step 3: after the checkpoint of step 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_target_dir, [str(feats)], tmp_path / "moved", replace(cfg, device="cuda"))
    monkeypatch.setattr(train_mod, "_train_step", real)
    resumed = train(tiny_target_dir, [str(feats)], tmp_path / "moved", replace(cfg, device="cpu"), resume=True)
    assert resumed["resumed_from"] == 2 and resumed["device"] == "cpu"
    assert _relative_gap(ref, load_file(str(tmp_path / "moved" / "draft.safetensors"))) < 1e-3

    bf16 = train(tiny_target_dir, [str(feats)], tmp_path / "bf16", replace(cfg, device="cuda", dtype="auto"))
    assert bf16["compute_dtype"] == "bfloat16" and bf16["steps"] == cpu["steps"]


def test_a_warm_start_keeps_the_trained_weights_and_moves_lm_head_rows_with_their_tokens(
        tiny_target_dir, features, tmp_path):
    """--init-from: the grown data's vocab differs from the one the head was trained on, so lm_head
    rows follow their target token (a new token keeps the fresh init); every other weight is the
    trained head's; the warm start is part of the run's identity (a resume with another refuses)."""
    from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
    from eagle3_platform.draft.vocab import check_vocab, load_vocab, save_vocab
    from eagle3_platform.draft.warm_start import warm_start
    from eagle3_platform.model.target import identity

    cfg = replace(PRESETS["tiny"], epochs=1, num_threads=1)
    first = tmp_path / "first"
    train(tiny_target_dir, [str(features[0])], first, cfg)
    expect, V = identity(tiny_target_dir), target_hf_config(tiny_target_dir)["vocab_size"]
    # the grown data's vocab: half the trained one's tokens, half others (ids sorted, as built)
    trained = load_vocab(first / "vocab.safetensors")[0]
    trained_ids = trained + torch.arange(trained.numel())
    others = torch.tensor([i for i in range(V) if i not in set(trained_ids.tolist())][:trained.numel() // 2])
    ids = torch.cat([trained_ids[::2], others]).sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    check_vocab(ids - torch.arange(ids.numel()), t2d)
    save_vocab(tmp_path / "other.safetensors", ids - torch.arange(ids.numel()), t2d, {})
    d2t, t2d, _ = load_vocab(tmp_path / "other.safetensors")

    def fresh():
        torch.manual_seed(cfg.seed)
        return build_draft(tiny_target_dir, DraftConfig.from_target(
            target_hf_config(tiny_target_dir), d2t.numel(), expect["capture_layer_ids"]), False, d2t, t2d)

    init, warm = fresh(), fresh()
    info = warm_start(warm, first, expect)
    old = load_file(str(first / "draft.safetensors"))
    assert info["lm_head_rows_kept"] > 0 and info["lm_head_rows_new"] > 0
    assert info["lm_head_rows_kept"] + info["lm_head_rows_new"] == d2t.numel()
    for name, t in warm.head_state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            torch.testing.assert_close(t, old[name], msg=name)
    torch.testing.assert_close(warm.d2t, d2t.long())  # this run's vocab, not the old one
    old_ids = (old["d2t"].long() + torch.arange(old["d2t"].numel())).tolist()
    new_ids = warm.to_target_ids(torch.arange(d2t.numel())).tolist()
    for row, tok in enumerate(new_ids):
        want = old["lm_head.weight"][old_ids.index(tok)] if tok in old_ids else init.lm_head.weight[row]
        torch.testing.assert_close(warm.lm_head.weight[row], want, msg=f"row {row}, token {tok}")

    # through train(): recorded, resumable, and a resume from another start refuses
    out = tmp_path / "warm"
    s = train(tiny_target_dir, [str(features[0])], out, replace(cfg, max_steps=2), vocab_path=tmp_path /
              "other.safetensors", init_from=first)
    assert s["warm_start"]["lm_head_rows_kept"] == info["lm_head_rows_kept"]
    assert train(tiny_target_dir, [str(features[0])], out, replace(cfg, max_steps=2), resume=True,
                 vocab_path=tmp_path / "other.safetensors", init_from=first)["resumed_from"] == 2
    with pytest.raises(ValueError, match="written for a different run"):
        train(tiny_target_dir, [str(features[0])], out, replace(cfg, max_steps=2), resume=True,
              vocab_path=tmp_path / "other.safetensors")


def test_a_warm_start_refuses_a_head_for_another_target_or_geometry(tiny_target_dir, features, tmp_path):
    cfg = replace(PRESETS["tiny"], epochs=1, num_threads=1, max_steps=1)
    first = tmp_path / "first"
    train(tiny_target_dir, [str(features[0])], first, cfg)
    meta = json.loads((first / "draft_config.json").read_text())
    with pytest.raises(FileNotFoundError, match="a trained draft dir"):
        train(tiny_target_dir, [str(features[0])], tmp_path / "a", cfg, init_from=tmp_path)
    (first / "draft_config.json").write_text(json.dumps({**meta, "target": {**meta["target"], "weights_hash": "x"}}))
    with pytest.raises(ValueError, match="another target"):
        train(tiny_target_dir, [str(features[0])], tmp_path / "b", cfg, init_from=first)
    bigger = {**meta["draft"], "intermediate_size": meta["draft"]["intermediate_size"] * 2}
    (first / "draft_config.json").write_text(json.dumps({**meta, "draft": bigger}))
    with pytest.raises(ValueError, match="geometry differs.*intermediate_size"):
        train(tiny_target_dir, [str(features[0])], tmp_path / "c", cfg, init_from=first)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_training_keeps_every_conversation_its_preset_regenerates_whole(preset):
    """Samples are truncated to max_len from the front, and a conversation ends with its response:
    a max_len below regeneration's max_length cuts responses off (the tiny pipeline's head once saw
    no response position at all)."""
    from eagle3_platform.data.regenerate import PRESETS as REGEN
    from eagle3_platform.features.extract import PRESETS as FEATURES

    assert PRESETS[preset].max_len >= REGEN[preset].max_length <= FEATURES[preset].max_length


def test_samples_with_no_response_within_max_len_are_left_out_and_counted(tiny_target_dir, features, tmp_path):
    """A sample whose response starts past max_len costs a forward and supervises nothing: it is left
    out of the plan and counted; when that is every sample, training refuses instead of "succeeding"
    on zero-loss steps with an untrained head (the tiny pipeline's head once did)."""
    from eagle3_platform.features.shards import ShardDataset

    ds = ShardDataset([features[0]])
    cfg = replace(PRESETS["tiny"], max_len=8)
    starts = [int(m.nonzero()[0]) for m in ds.loss_masks()]       # first response position per sample
    assert [len(m) for m in ds.loss_masks()] == ds.sample_lengths()
    lengths, left_out = trainable_lengths(ds, cfg)
    assert 0 < left_out < len(ds) and left_out == sum(s >= cfg.max_len for s in starts)
    assert [n == 0 for n in lengths] == [s >= cfg.max_len for s in starts]
    assert {i for b in batch_plan(lengths, cfg) for i in b} == {i for i, n in enumerate(lengths) if n}
    assert trainable_lengths(ds, replace(cfg, supervise="all"))[1] == 0   # prompt positions count there

    summary = train(tiny_target_dir, [features[0]], tmp_path / "some", cfg)
    assert summary["samples"] == len(ds) and summary["samples_left_out"] == left_out
    assert (tmp_path / "some" / "draft.safetensors").exists()
    with pytest.raises(ValueError, match="none of the 12 samples .* within max_len=4"):
        train(tiny_target_dir, [features[0]], tmp_path / "none", replace(cfg, max_len=4))
    assert not (tmp_path / "none" / "draft.safetensors").exists()


def test_train_writes_the_answer_table_of_its_features_and_export_ships_it(tiny_target_dir, features, tmp_path):
    """The lookup branch's answer table (draft/answer_ngrams.py) is built from the train features' answers
    (each loss-masked run, with its turn header's ANSWER_LEAD tokens), written beside the head, and
    exported in a folder of its own (SGLang loads every top-level *.safetensors as weights)."""
    from eagle3_platform.draft.answer_ngrams import ANSWER_LEAD, AnswerNgrams
    from eagle3_platform.draft.export import ANSWERS_FILE, export_draft, load_answer_ngrams
    from eagle3_platform.features.shards import ShardDataset

    ds = ShardDataset([features[0]])
    want = []
    for i in range(len(ds)):  # the runs, found one position at a time
        ids, mask = ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist()
        for t in range(len(mask)):
            if mask[t] and (t == 0 or not mask[t - 1]):
                stop = next((u for u in range(t, len(mask)) if not mask[u]), len(mask))
                want.append(ids[max(0, t - ANSWER_LEAD):stop])
    spans = list(ds.response_spans(ANSWER_LEAD))
    assert spans == want and len(spans) >= len(ds)

    summary = train(tiny_target_dir, [features[0]], tmp_path / "d", PRESETS["tiny"])
    table = AnswerNgrams.load(tmp_path / "d" / "answer_ngrams.safetensors")
    assert table.keys.tolist() == AnswerNgrams.build(want).keys.tolist()
    assert summary["answer_ngrams"]["contexts"] == len(table) > 0
    assert table.answer_tokens == sum(map(len, want))

    out = export_draft(tmp_path / "d", tmp_path / "x", dtype="float32")
    assert out["answer_ngrams"] == len(table) and (tmp_path / "x" / ANSWERS_FILE).exists()
    assert [p.name for p in (tmp_path / "x").glob("*.safetensors")] == ["model.safetensors"]
    assert load_answer_ngrams(tmp_path / "x").tokens.tolist() == table.tokens.tolist()
    (tmp_path / "d" / "answer_ngrams.safetensors").unlink()  # a head trained before the table existed
    assert export_draft(tmp_path / "d", tmp_path / "y")["answer_ngrams"] is None
    assert load_answer_ngrams(tmp_path / "y") is None
