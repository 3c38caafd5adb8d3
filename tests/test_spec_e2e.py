"""Greedy losslessness of the engine on the real SmolLM2 target (e2e tier).

The head is the exported draft named by EAGLE3_E2E_DRAFT when set (a trained head, e.g. from
`eagle3 train` + `eagle3 export`); otherwise a head with random fc/midlayer whose lm_head/norm start
from the target's (build_draft's warm start) — losslessness must hold for any head, and an oracle
drafter on the same prompts covers deep acceptance through SmolLM2's tree-masked forwards.
"""
from __future__ import annotations

import os

import pytest
import torch

from eagle3_platform.spec.config import PRESETS, SpecConfig
from eagle3_platform.spec.engine import SpecEngine
from eagle3_platform.testing.oracle import OracleDrafter

pytestmark = pytest.mark.e2e

PROMPTS = ["Compose an engaging travel blog post about a recent trip to Hawaii.",
           "Write a Python function that returns the n-th Fibonacci number."
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from eagle3_platform.model.target import load_target

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_target(smollm2_dir)
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def head(smol, smollm2_dir):
    from eagle3_platform.draft.export import load_export
    from eagle3_platform.draft.model import DraftConfig, build_draft

    if os.environ.get("EAGLE3_E2E_DRAFT"):
        return load_export(os.environ["EAGLE3_E2E_DRAFT"], smol)
    torch.manual_seed(0)
    cfg = DraftConfig.from_target(smol.model.config, 4096, smol.layer_ids)
    return build_draft(smollm2_dir, cfg, init_from_target=True).eval()


@pytest.fixture(scope="module")
def cases(smol):
    from eagle3_platform.data.chat import render_prompt

    eos = SpecEngine(smol, None, PRESETS["baseline"]).eos_ids
    out = []
    for p in PROMPTS:
        ids = render_prompt(smol.tokenizer, [{"role": "user", "content": p}])
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = smol.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW + 6,
                                      do_sample=False, eos_token_id=sorted(eos),
                                      pad_token_id=smol.tokenizer.pad_token_id)[0, len(ids):].tolist()
        out.append((ids, ref))
    return out


@pytest.mark.parametrize("preset", ["chain", "tree"])
def test_smollm2_eagle3_greedy_lossless(smol, head, cases, preset):
    engine = SpecEngine(smol, head, PRESETS[preset])
    for ids, ref in cases:
        out, stats = engine.generate(ids, MAX_NEW)
        assert out == ref[:MAX_NEW]
        assert stats["acceptance_length"] >= 1.0


def test_smollm2_oracle_tree_lossless_with_deep_acceptance(smol, cases):
    taus = []
    for i, (ids, ref) in enumerate(cases):
        oracle = OracleDrafter(ref, smol.model.config.vocab_size, depth=5, seed=i)
        out, stats = SpecEngine(smol, oracle, SpecConfig(5, 2, 11)).generate(ids, MAX_NEW)
        assert out == ref[:MAX_NEW]
        taus.append(stats["acceptance_length"])
    assert max(taus) > 2.0  # multi-token acceptances went through SmolLM2's tree-masked verify
