"""No stage reports success on a broken result; every bad input is named in one line.

Bad inputs go through the CLI as a user calls it (`eagle3_platform.cli.main`): exit 2, a one-line
`eagle3 <cmd>: error: ...` on stderr and `{"ok": false, ...}` as the last stdout line.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from eagle3_platform.cli import main
from eagle3_platform.model.target import tiny_tokenizer
from eagle3_platform.serve.config import ServeConfig
from eagle3_platform.serve.server import build_app
from eagle3_platform.testing.serve import FakeEngine, word_token_ids

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def cli_error(capsys, *argv: str) -> str:
    """Run `eagle3 argv...`; assert it failed the documented way; return the error line."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (out[-2000:], err[-2000:])
    assert json.loads(out.strip().splitlines()[-1])["ok"] is False
    lines = [ln for ln in err.splitlines() if ln.startswith(f"eagle3 {argv[0]}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def cli_ok(capsys, *argv: str) -> dict:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- fixtures: tiny conversations/features

def conversations(target, n: int, **update) -> list:
    from eagle3_platform.data.chat import render, template_hash
    from eagle3_platform.store.records import ConversationRecord

    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"what is {i} plus {i}"},
                {"role": "assistant", "content": f"the answer is {2 * i}"}]
        ids, mask = render(target.tokenizer, msgs)
        rec = ConversationRecord(id=f"c{i}", workload="chat", source="test", license="none", messages=msgs,
                                 input_ids=ids, loss_mask=mask, template_hash=template_hash(target.tokenizer),
                                 target_id=target.meta["target_id"])
        out.append(rec.model_copy(update=update))
    return out


def write_conv(path: Path, recs) -> Path:
    from eagle3_platform.store.records import write_jsonl_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(path, recs)
    return path


@pytest.fixture(scope="module")
def feats(tiny_target_dir, tmp_path_factory):
    from eagle3_platform.testing.synthetic import target_features

    return target_features(tiny_target_dir, tmp_path_factory.mktemp("hard") / "f", n_samples=4,
                           min_len=8, max_len=16)


@pytest.fixture()
def empty_feats(tmp_path) -> Path:
    """A feature dir with a valid, empty manifest (what extract used to write for 0 samples)."""
    from eagle3_platform.features.shards import write_manifest

    (tmp_path / "empty").mkdir()
    write_manifest(tmp_path / "empty", [])
    return tmp_path / "empty"


# ---------------------------------------------------------------- 1. empty results fail each stage

def test_extract_with_every_record_rejected_fails(tiny_target, tiny_target_dir, tmp_path, capsys):
    conv = write_conv(tmp_path / "conv.jsonl", conversations(tiny_target, 3, target_id="other-model"))
    line = cli_error(capsys, "extract", "--target", tiny_target_dir, "--in", conv, "--out", tmp_path / "fe",
                     "--preset", "tiny")
    assert "all 3 records" in line and "mismatch:target_id: 3" in line and "rejected.jsonl" in line
    assert len((tmp_path / "fe" / "rejected.jsonl").read_text().splitlines()) == 3  # reasons kept
    assert not (tmp_path / "fe" / "manifest.parquet").exists()  # nothing that looks like features


def test_extract_with_empty_input_fails(tiny_target_dir, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    line = cli_error(capsys, "extract", "--target", tiny_target_dir, "--in", tmp_path / "empty.jsonl",
                     "--out", tmp_path / "fe", "--preset", "tiny")
    assert "no conversation records" in line


def test_vocab_from_empty_features_fails(tiny_target_dir, empty_feats, tmp_path, capsys):
    line = cli_error(capsys, "vocab", "--features", empty_feats, "--target", tiny_target_dir,
                     "--out", tmp_path / "v.safetensors", "--draft-vocab-size", "16")
    assert "no response tokens" in line and str(empty_feats) in line
    assert not (tmp_path / "v.safetensors").exists()


def test_train_with_zero_steps_fails(tiny_target_dir, empty_feats, tmp_path, capsys):
    from eagle3_platform.draft.model import target_hf_config
    from eagle3_platform.draft.vocab import build_vocab, save_vocab

    V = target_hf_config(tiny_target_dir)["vocab_size"]
    vocab = tmp_path / "vocab.safetensors"
    save_vocab(vocab, *build_vocab(torch.ones(V, dtype=torch.int64), V, 16))
    base = ["train", "--target", tiny_target_dir, "--features", empty_feats, "--preset", "tiny",
            "--threads", "1"]
    line = cli_error(capsys, *base, "--out", tmp_path / "te", "--vocab", vocab)
    assert "0 optimizer steps" in line and "0 samples" in line
    line = cli_error(capsys, *base, "--out", tmp_path / "te2")  # vocab built from the same features
    assert "no response tokens" in line
    for out in ("te", "te2"):
        assert not (tmp_path / out / "draft.safetensors").exists()


def _draft_dir(target_dir, out: Path, steps: int | None, nan: bool = False) -> Path:
    from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
    from eagle3_platform.draft.train import METRICS, save_draft_dir
    from eagle3_platform.draft.vocab import build_vocab
    from eagle3_platform.model.target import read_meta

    hf = target_hf_config(target_dir)
    d2t, t2d, _ = build_vocab(torch.ones(hf["vocab_size"], dtype=torch.int64), hf["vocab_size"], 16)
    cfg = DraftConfig.from_target(hf, 16, read_meta(target_dir)["capture_layer_ids"])
    draft = build_draft(target_dir, cfg, False, d2t, t2d)
    if nan:
        with torch.no_grad():
            draft.fc.weight[0, 0] = float("nan")
    save_draft_dir(out, draft, {"target": read_meta(target_dir)})
    if steps is not None:
        (out / METRICS).write_text(json.dumps({"steps": steps}))
    return out


def test_export_refuses_untrained_or_diverged_head(tiny_target_dir, tmp_path, capsys):
    untrained = _draft_dir(tiny_target_dir, tmp_path / "d0", steps=0)
    line = cli_error(capsys, "export", "--draft", untrained, "--out", tmp_path / "x0")
    assert "0 steps" in line and not (tmp_path / "x0").exists()
    diverged = _draft_dir(tiny_target_dir, tmp_path / "dn", steps=3, nan=True)
    line = cli_error(capsys, "export", "--draft", diverged, "--out", tmp_path / "xn")
    assert "non-finite" in line and "fc.weight" in line and not (tmp_path / "xn").exists()
    trained = _draft_dir(tiny_target_dir, tmp_path / "d3", steps=3)  # the same head, trained: exports
    assert cli_ok(capsys, "export", "--draft", trained, "--out", tmp_path / "x3")["tensors"] == 15


@pytest.mark.parametrize("compute", ["in_process", pytest.param("pipes", marks=pytest.mark.integration)])
def test_feature_shards_asset_fails_instead_of_materializing(tiny_target, tiny_target_dir, tmp_path, compute):
    """Dagster: the library's error (in-process) or the CLI's exit 2 (Pipes) fails the asset; no
    materialization is recorded, and the reason reaches the run's log."""
    from dagster import AssetKey, DagsterInstance, materialize

    from assets.partitions import SPLITS, Keys
    from dagster_helpers import GRAPH, tiny_resources
    from resources import StorageResource

    storage = StorageResource(root=str(tmp_path / "data"))
    for split in SPLITS:
        write_conv(storage.local_path(Keys.conversations("chat", split)),
                   conversations(tiny_target, 2, target_id="other-model"))
    with DagsterInstance.ephemeral() as instance:
        result = materialize(GRAPH, selection=["feature_shards"], partition_key="chat", instance=instance,
                             resources=tiny_resources(storage, tiny_target_dir, compute), raise_on_error=False)
        assert not result.success
        assert not instance.fetch_materializations(AssetKey("feature_shards"), limit=1).records
        logged = [r.user_message for r in instance.all_logs(result.run_id)]
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    reported = failure.step_failure_data.error.to_string() + "\n".join(logged)
    assert "mismatch:target_id" in reported
    assert not storage.exists(f"{Keys.features('chat', 'train')}/manifest.parquet")


def test_draft_assets_fail_on_empty_features(tiny_target_dir, tmp_path):
    """Features stored with 0 samples (as extract used to write them): draft_vocab and draft_head fail
    instead of materializing a padding-only vocab / an untrained head."""
    from dagster import AssetKey, DagsterInstance, materialize

    from assets.draft import VOCAB_FILE
    from assets.features import TARGET_SIDECAR, expect_header
    from assets.partitions import SPLITS, Keys
    from dagster_helpers import GRAPH, tiny_resources
    from eagle3_platform.draft.model import target_hf_config
    from eagle3_platform.draft.vocab import build_vocab, save_vocab
    from eagle3_platform.features.shards import write_manifest
    from resources import StorageResource

    storage = StorageResource(root=str(tmp_path / "data"))
    res = tiny_resources(storage, tiny_target_dir)
    for split in SPLITS:
        d = storage.local_path(Keys.features("chat", split))
        d.mkdir(parents=True)
        write_manifest(d, [])
        (d / TARGET_SIDECAR).write_text(json.dumps(expect_header(res["target"])))
    V = target_hf_config(tiny_target_dir)["vocab_size"]
    save_vocab(storage.local_path(f"{Keys.VOCAB}/{VOCAB_FILE}"), *build_vocab(torch.ones(V, dtype=torch.int64), V, 16))
    with DagsterInstance.ephemeral() as instance:
        for asset, why in (("draft_vocab", "no response tokens"), ("draft_head", "0 optimizer steps")):
            result = materialize(GRAPH, selection=[asset], instance=instance, resources=res,
                                 raise_on_error=False)
            assert not result.success
            assert not instance.fetch_materializations(AssetKey(asset), limit=1).records
            (failure,) = [e for e in result.all_events if e.is_step_failure]
            assert why in failure.step_failure_data.error.to_string()
    assert not storage.exists(f"{Keys.EXPORT}/model.safetensors")


# ---------------------------------------------------------------- 5. client mistakes are 4xx, not 500

@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _app(tok, api_key=None):
    cfg = ServeConfig(max_tokens=40, default_max_tokens=4, max_queue=4, allowed_hosts=("testserver",))
    return build_app(FakeEngine(word_token_ids(tok), chunk=3), tok, cfg, model_name="fake",
                     context_length=256, api_key=api_key)


def test_non_ascii_api_key_is_refused_at_startup(tok, tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="printable ASCII"):
        _app(tok, api_key="clé")
    # the CLI refuses before loading any model (the target dir need not even exist)
    line = cli_error(capsys, "serve", "--target", tmp_path / "none", "--port", "0", "--api-key", "clé")
    assert "printable ASCII" in line and "clé" not in line  # never echo a secret
    monkeypatch.setenv("EAGLE3_API_KEY", " padded ")
    assert "printable ASCII" in cli_error(capsys, "serve", "--target", tmp_path / "none", "--port", "0")


def test_non_ascii_key_sent_by_client_is_401(tok):
    with TestClient(_app(tok, api_key="s3cret")) as c:
        r = c.post(CHAT, json={"messages": MSGS}, headers={"Authorization": "Bearer clé".encode()})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        ok = c.post(CHAT, json={"messages": MSGS}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


# the bounds are torch.Generator.manual_seed's: it takes exactly [-2^63, 2^64)
@pytest.mark.parametrize("seed,status", [(2 ** 64, 400), (-2 ** 63 - 1, 400), (10 ** 30, 400),
                                         (2 ** 64 - 1, 200), (-2 ** 63, 200)])
def test_seed_outside_generator_range_is_400(tok, seed, status):
    with TestClient(_app(tok)) as c:
        r = c.post(CHAT, json={"messages": MSGS, "seed": seed, "temperature": 0.7})
        assert r.status_code == status, r.text
        if status == 400:
            assert "seed" in r.json()["error"]["message"]


# ---------------------------------------------------------------- 7. one-line errors, not tracebacks

def test_upload_cut_mid_body_is_one_log_line(tok, caplog):
    app = _app(tok)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"500")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    incoming = [{"type": "http.request", "body": b'{"messages": [{"role": "us', "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.INFO, logger="eagle3.serve"):
        asyncio.run(app(scope, receive, send))  # before the fix: ClientDisconnect escaped the app
    records = [r for r in caplog.records if r.name == "eagle3.serve"]
    assert len(records) == 1 and "disconnected" in records[0].getMessage()
    assert records[0].exc_info is None and records[0].levelno < logging.ERROR
    assert app.state.service.counts["requests_disconnected"] == 1


def test_truncated_manifest_is_named_then_rebuilt_by_extract(tiny_target, tiny_target_dir, tmp_path, capsys):
    conv = write_conv(tmp_path / "conv.jsonl", conversations(tiny_target, 6))
    args = ["extract", "--target", tiny_target_dir, "--in", conv, "--out", tmp_path / "fe", "--preset", "tiny"]
    first = cli_ok(capsys, *args)
    assert first["shards"] == 2
    manifest = tmp_path / "fe" / "manifest.parquet"
    manifest.write_bytes(manifest.read_bytes()[:100])
    line = cli_error(capsys, "verify-features", "--dir", tmp_path / "fe")
    assert str(manifest) in line and "unreadable" in line and "eagle3 extract" in line
    again = cli_ok(capsys, *args)  # rebuilt from the shards on disk: nothing recomputed
    assert again["shards_skipped"] == 2 and again["shards_written"] == 0
    assert again["samples"] == first["samples"] == 6
    assert cli_ok(capsys, "verify-features", "--dir", tmp_path / "fe")["bad"] == []


def test_corrupt_checkpoint_on_resume_is_named(tiny_target_dir, feats, tmp_path, capsys):
    ckpt = tmp_path / "te" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text('{"step": 1')  # a checkpoint cut short
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    base = ["train", "--target", tiny_target_dir, "--features", feats, "--out", tmp_path / "te",
            "--preset", "tiny", "--threads", "1", "--max-steps", "1"]
    line = cli_error(capsys, *base, "--resume")
    assert str(ckpt) in line and "without --resume" in line
    assert cli_ok(capsys, *base)["steps"] == 1  # the offered way out works


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--target", "t", "--max-tokens", "-5"], "--max-tokens"),
    (["serve", "--target", "t", "--max-batch", "0"], "--max-batch"),
    (["eval", "--target", "t", "--prompts", "p.jsonl", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["eval", "--target", "t", "--prompts", "p.jsonl", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["bench", "--url", "http://127.0.0.1:9", "--prompts", "p.jsonl", "--out", "r", "--max-tokens", "-2"],
     "--max-tokens"),
    (["train", "--target", "t", "--features", "f", "--out", "o", "--max-steps", "-1"], "--max-steps"),
    (["train", "--target", "t", "--features", "f", "--out", "o", "--epochs", "0"], "--epochs"),
    (["vocab", "--target", "t", "--features", "f", "--out", "v", "--draft-vocab-size", "-3"],
     "--draft-vocab-size"),
    (["filter", "--in", __file__, "--out", "k.jsonl", "--rejected", "r.jsonl", "--max-tokens", "0"],
     "--max-tokens"),
    (["regenerate", "--target", "t", "--in", __file__, "--out", "o.jsonl", "--max-new-tokens", "-4"],
     "--max-new-tokens"),
])
def test_non_positive_counts_are_refused(argv, flag, capsys):
    line = cli_error(capsys, *argv)
    assert f"{flag} must be >= 1" in line


def test_negative_serve_threads_are_refused(capsys):
    line = cli_error(capsys, "serve", "--target", "t", "--threads", "-1")
    assert "--threads must be >= 0 (0 = every core)" in line


def test_serve_threads_set_every_role_and_the_rest_stays_the_preset():
    """--threads N pins the target's, the head's and the rest's threads alike; 0 gives the target
    and the head every core and keeps the preset's for the rest; omitted, the preset's split."""
    from eagle3_platform.cli import build_parser
    from eagle3_platform.cli.serve import serve_config
    from eagle3_platform.serve.config import PRESETS

    def cfg(*flags):
        return serve_config(build_parser().parse_args(["serve", "--target", "t", *flags]))

    assert cfg() == PRESETS["demo"]
    two = cfg("--threads", "2")
    assert (two.torch_threads, two.target_threads, two.draft_threads) == (2, 2, 2)
    every = cfg("--threads", "0", "--preset", "tiny")
    assert (every.torch_threads, every.target_threads, every.draft_threads) == (1, 0, 0)
    assert every.prefill_chunk == PRESETS["tiny"].prefill_chunk  # scheduler constants: the preset's


def test_same_feature_dir_twice_is_refused(tiny_target_dir, feats, tmp_path, capsys):
    twice = f"{feats},{feats}/"
    line = cli_error(capsys, "train", "--target", tiny_target_dir, "--features", twice, "--out", tmp_path / "te",
                     "--preset", "tiny", "--threads", "1")
    assert "listed twice" in line and str(feats) in line
    assert not (tmp_path / "te").exists()  # refused before anything was written
    line = cli_error(capsys, "vocab", "--target", tiny_target_dir, "--features", twice,
                     "--out", tmp_path / "v.safetensors", "--draft-vocab-size", "16")
    assert "listed twice" in line
    from eagle3_platform.features.shards import ShardDataset  # library callers get the same refusal

    with pytest.raises(ValueError, match="listed twice"):
        ShardDataset([feats, Path(str(feats) + "/.")])
