"""Small in-memory targets and random EAGLE-3 drafts for tests and examples (no files, seconds).

The prepared tiny-random target decodes one token over and over (its tied, small-init weights make
every greedy step pick the same id), which would make losslessness tests vacuous; `varied_target`
builds an untied, wider-init tiny Llama whose greedy and sampled outputs actually vary.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from eagle3_platform.draft.model import DraftConfig, Eagle3Draft
from eagle3_platform.model.packed_linear import pack_linears
from eagle3_platform.model.target import Target, capture_layer_ids


@dataclass(frozen=True)
class VariedTargetConfig:
    num_hidden_layers: int = 6
    initializer_range: float = 0.2  # wide init: peaked, context-dependent next-token distributions
    vocab_size: int | None = None  # None = the tokenizer's
    seed: int = 0


def varied_target(base: Target | None, cfg: VariedTargetConfig = VariedTargetConfig(),
                  pack: bool = True) -> Target:
    """An in-memory Llama with base's config/tokenizer (or a bare config when base is None); its linear
    layers packed as load_target packs them (pack=False: torch's row-major kernels)."""
    from transformers import LlamaForCausalLM

    from eagle3_platform.model.target import tiny_config

    hf = copy.deepcopy(base.model.config) if base is not None else tiny_config(cfg.vocab_size)
    hf.tie_word_embeddings = False
    hf.initializer_range = cfg.initializer_range
    hf.num_hidden_layers = cfg.num_hidden_layers
    if cfg.vocab_size is not None:
        hf.vocab_size = cfg.vocab_size
    if base is None:
        hf.eos_token_id = hf.bos_token_id = hf.pad_token_id = None
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(hf).eval()
    packed = pack_linears(model) if pack else 0
    meta = {"target_id": f"varied-{cfg.seed}", "num_hidden_layers": hf.num_hidden_layers,
            "hidden_size": hf.hidden_size, "vocab_size": hf.vocab_size, "packed_linears": packed,
            "capture_layer_ids": [min(max(i, 0), hf.num_hidden_layers - 1)  # valid for any depth
                                  for i in capture_layer_ids(hf.num_hidden_layers)]}
    return Target(model=model, tokenizer=base.tokenizer if base is not None else None, meta=meta)


def random_draft(target: Target, draft_vocab_size: int | None = None, seed: int = 0) -> Eagle3Draft:
    """An Eagle3Draft with random weights and the target's embedding; draft vocab = the first Vd ids."""
    hf = target.model.config
    vd = draft_vocab_size or hf.vocab_size
    cfg = DraftConfig.from_target(hf, vd, target.layer_ids)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    return draft.eval()
