"""Shared fixtures. Everything here is offline and CPU-only."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Before any presidio/dagster import: no network lookups, no telemetry, 2-core friendly torch.
os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A prepared tiny-random target (tiny Llama + small ChatML tokenizer), built once per session."""
    from eagle3_platform.model.target import TINY, prepare_target

    cache = tmp_path_factory.mktemp("eagle3_cache")
    old = os.environ.get("EAGLE3_CACHE")
    os.environ["EAGLE3_CACHE"] = str(cache)
    try:
        out = cache / "tiny-target"
        prepare_target(TINY, out)
    finally:
        if old is None:
            os.environ.pop("EAGLE3_CACHE", None)
        else:
            os.environ["EAGLE3_CACHE"] = old
    return out


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from eagle3_platform.model.target import load_target

    return load_target(tiny_target_dir)


@pytest.fixture(scope="session")
def random_head_export(tiny_target_dir, tmp_path_factory) -> Path:
    """An exported EAGLE-3 head with random weights (seed 0) for the tiny target."""
    import torch

    from eagle3_platform.draft.export import export_draft
    from eagle3_platform.draft.model import DraftConfig, build_draft, target_hf_config
    from eagle3_platform.draft.train import save_draft_dir
    from eagle3_platform.model.target import read_meta

    torch.manual_seed(0)
    cfg = DraftConfig.from_target(target_hf_config(tiny_target_dir), 64,
                                  read_meta(tiny_target_dir)["capture_layer_ids"])
    root = tmp_path_factory.mktemp("random_head")
    save_draft_dir(root / "draft", build_draft(tiny_target_dir, cfg))
    export_draft(root / "draft", root / "export")
    return root / "export"


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The real embedded target (e2e tier only). Conversion is cached under ~/.cache/eagle3."""
    from eagle3_platform.model.target import SMOLLM2, prepare_target, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    out = tmp_path_factory.mktemp("smollm2") / "target"
    prepare_target(SMOLLM2, out)
    return out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops on a loaded 2-core box: intra-op threading costs far more than it saves."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture()
def answer_clock(monkeypatch) -> list[int]:
    """Regeneration's time budget counts answered turns instead of seconds, each TimeBudget from its
    own start (as a process's clock would), so where it runs out does not depend on the machine's
    speed. [0]: the turns answered so far in this test."""
    import eagle3_platform.data.regenerate as regen

    answered = [0]
    answer, init = regen.Turns.answer, regen.TimeBudget.__init__

    def counting(self, *a, **k):
        answered[0] += 1
        return answer(self, *a, **k)

    def starting(self, *a, **k):
        init(self, *a, **k)
        self.answered_at_start = answered[0]

    monkeypatch.setattr(regen.Turns, "answer", counting)
    monkeypatch.setattr(regen.TimeBudget, "__init__", starting)
    monkeypatch.setattr(regen.TimeBudget, "spent", lambda self: self.before + answered[0] - self.answered_at_start)
    return answered
