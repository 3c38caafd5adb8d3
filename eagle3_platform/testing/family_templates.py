"""Tokenizers that carry each family's real chat template (eagle3_platform/data/templates/<name>.jinja)
on the tiny byte-level BPE of model/target.py, with the family's special tokens, BOS and EOS, so the
loss-mask goldens and the model zoo render exactly what the family's own tokenizer renders.

Only the template text and the special tokens come from the family; the vocabulary is the tiny BPE's
(the masks depend on where the template's text falls, not on the family's merges).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"


@dataclass(frozen=True)
class FamilyTokens:
    specials: tuple[str, ...]  # added as special tokens (skipped when decoding answers)
    bos: str | None
    eos: str
    plain: tuple[str, ...] = ()  # added as ordinary tokens (Qwen3's <think> is not special)


FAMILY_TOKENS: dict[str, FamilyTokens] = {
    "llama3": FamilyTokens(("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                            "<|eom_id|>", "<|python_tag|>"), "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": FamilyTokens((), None, "<|im_end|>", ("<tool_call>", "</tool_call>")),
    "qwen3": FamilyTokens((), None, "<|im_end|>", ("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "qwen3-moe": FamilyTokens((), None, "<|im_end|>", ("<think>", "</think>", "<tool_call>", "</tool_call>")),
    "mistral": FamilyTokens(("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                             "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "<s>", "</s>"),
    "gemma3": FamilyTokens(("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
                           "<bos>", "<eos>"),
    "llama4": FamilyTokens(("<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>", "<|eom|>",
                            "<|python_start|>", "<|python_end|>", "<|image|>"), "<|begin_of_text|>", "<|eot|>"),
    "gpt-oss": FamilyTokens(("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                             "<|return|>", "<|call|>", "<|constrain|>"), "<|startoftext|>", "<|return|>"),
    "phi4-mini": FamilyTokens(("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"),
                              None, "<|endoftext|>"),
}


def template_text(name: str) -> str:
    """The committed template of `name` (its source named in its first line)."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def family_tokenizer(name: str):
    """The tiny BPE carrying family `name`'s real template, special tokens, BOS and EOS."""
    from eagle3_platform.model.target import tiny_tokenizer

    spec = FAMILY_TOKENS[name]
    tok = tiny_tokenizer()
    if spec.specials:
        tok.add_special_tokens({"additional_special_tokens": list(spec.specials)})
    if spec.plain:
        tok.add_tokens(list(spec.plain))
    tok.bos_token = spec.bos
    tok.eos_token = spec.eos
    tok.chat_template = template_text(name)
    return tok
