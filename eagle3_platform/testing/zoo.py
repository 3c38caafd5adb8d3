"""A model zoo: for every registered target family, a tiny random checkpoint built from that family's
own transformers config class (hidden 64, 4-8 layers, the tiny byte-level BPE of model/target.py),
saved as a Hugging Face directory with a tokenizer carrying the family's chat template.

The sizes keep each family's peculiarity live at test lengths: sliding windows and chunks of 16
tokens (prompts and answers run past them), 5:1 sliding/full layers (Gemma-3), alternating
sliding/full (GPT-OSS), experts routed top-2 of 4 (MoE), a 0.75 rotary fraction (Phi). Weights are
drawn wide (initializer_range 0.2) so greedy outputs vary with the context (a vacuous constant output
would make the exactness checks pass on anything).

Chat templates: the family's committed template (eagle3_platform/data/templates/<template>.jinja,
the special tokens it writes added to the tokenizer) where one exists, else ChatML.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3_platform.model.target import CHATML_TEMPLATE, tiny_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               image_size=28, patch_size=14)


@dataclass(frozen=True)
class ZooModel:
    family: str                          # the registry entry it exercises (model/families.py)
    config_class: str                    # transformers' config class
    text: dict                           # the decoder's config keys (beside _SIZES)
    template: str = ""                   # data/templates/<template>.jinja, if committed
    eos: str = "<|im_end|>"              # end of turn under the family's template
    nested: dict = field(default_factory=dict)  # outer config keys of a multimodal checkpoint
    model_class: str = "AutoModelForCausalLM"


ZOO: dict[str, ZooModel] = {z.family: z for z in (
    ZooModel("llama", "LlamaConfig", dict(intermediate_size=128, num_hidden_layers=8), "llama3", "<|eot_id|>"),
    ZooModel("qwen2", "Qwen2Config", dict(intermediate_size=128, num_hidden_layers=6), "qwen2.5"),
    ZooModel("qwen3", "Qwen3Config", dict(intermediate_size=128, num_hidden_layers=6), "qwen3"),
    ZooModel("qwen3_moe", "Qwen3MoeConfig", dict(intermediate_size=128, moe_intermediate_size=32,
                                                 num_experts=4, num_experts_per_tok=2, num_hidden_layers=4),
             "qwen3-moe"),
    ZooModel("mistral", "MistralConfig", dict(intermediate_size=128, num_hidden_layers=6, sliding_window=16),
             "mistral", "</s>"),
    ZooModel("mistral3", "Mistral3Config", dict(intermediate_size=128, num_hidden_layers=6, sliding_window=None),
             "mistral", "</s>", nested=dict(vision_config=dict(_VISION, head_dim=16), spatial_merge_size=2,
                                            tie_word_embeddings=False),
             model_class="Mistral3ForConditionalGeneration"),
    ZooModel("gemma3_text", "Gemma3TextConfig",
             dict(intermediate_size=128, num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=16),
             "gemma3", "<end_of_turn>"),
    ZooModel("gemma3", "Gemma3Config",
             dict(intermediate_size=128, num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=16),
             "gemma3", "<end_of_turn>", nested=dict(vision_config=_VISION, mm_tokens_per_image=4,
                                                      initializer_range=0.2, tie_word_embeddings=False),
             model_class="Gemma3ForConditionalGeneration"),
    ZooModel("llama4", "Llama4Config",
             dict(intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4, num_local_experts=2,
                  attention_chunk_size=16), "llama4", "<|eot|>",
             nested=dict(vision_config=dict(_VISION, vision_output_dim=32, projector_input_dim=32,
                                            projector_output_dim=32)),
             model_class="Llama4ForConditionalGeneration"),
    ZooModel("gpt_oss", "GptOssConfig", dict(intermediate_size=64, num_hidden_layers=4, num_local_experts=4,
                                             num_experts_per_tok=2, sliding_window=16), "gpt-oss", "<|return|>"),
    ZooModel("phi3", "Phi3Config", dict(intermediate_size=128, num_hidden_layers=6, partial_rotary_factor=0.75),
             "phi4-mini", "<|end|>"),
)}
# the literal special tokens of the templates (<|im_start|>, <start_of_turn>, [INST], <think>, ...)
_SPECIAL = re.compile(r"<\|[a-z_]+\|>|<(?:start|end)_of_turn>|\[/?INST\]|</?think>")


def zoo_tokenizer(z: ZooModel):
    """The tiny BPE with the family's template (and its special tokens), or ChatML where the family's
    template is not committed; -> (tokenizer, template name used)."""
    tok = tiny_tokenizer()
    path = TEMPLATES / f"{z.template}.jinja"
    if not path.exists():
        tok.chat_template = CHATML_TEMPLATE
        return tok, "chatml"
    template = path.read_text()
    specials = sorted(set(_SPECIAL.findall(template)) | {z.eos} - set(tok.get_vocab()))
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    tok.eos_token = z.eos
    return tok, path.stem


def zoo_config(z: ZooModel, vocab_size: int, eos_id: int, pad_id: int):
    import transformers

    cls = getattr(transformers, z.config_class)
    ids = dict(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    text = dict(_SIZES, vocab_size=vocab_size, **z.text, **ids)
    if not z.nested:
        return cls(**text)
    return cls(text_config=text, **z.nested, **ids)


def build_zoo_model(family: str, out: str | Path, seed: int = 0) -> Path:
    """The family's tiny random checkpoint + tokenizer saved as an HF directory at out (kept if there)."""
    import transformers

    out = Path(out)
    if (out / "config.json").exists():
        return out
    z = ZOO[family]
    tok, _ = zoo_tokenizer(z)
    cfg = zoo_config(z, len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    cls = getattr(transformers, z.model_class)
    model = (cls.from_config(cfg) if z.model_class.startswith("Auto") else cls(cfg)).to(torch.float32).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out
