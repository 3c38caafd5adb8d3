"""Target families: where each decoder keeps its parts, which layers EAGLE-3 captures, and which of
the embedded engine's fast paths compute exactly what transformers computes for it.

A family is one `Family` entry in FAMILIES, not a code path. The engine's fast paths:
- the grouped attention kernel (attention.py): plain softmax(q·kᵀ·scale + mask)·v. Exact wherever
  the family's attention is that (window and chunk patterns ride in the mask, ragged.py); not with
  attention sinks (GPT-OSS) or logit soft-capping (Gemma-2), which transformers' own kernel computes;
- the step loop (forward.py): a Llama-shaped layer (q/k/v/o, gated MLP, pre-norms, full rotary, no
  q/k norms), full attention on every layer;
- the ragged masks (ragged.py): full, sliding-window and chunked layers, each its own mask.
What breaks a fast path is read off the config (`attention_layout`), so a Mistral checkpoint with a
sliding window and one without take the paths each can take exactly.

A model whose model_type is in no entry is refused (`family_of`): the error names the model_type and
what an entry must say.
"""
from __future__ import annotations

from dataclasses import dataclass

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]        # config.model_type values (outer config for nested ones)
    text_config: str | None = None      # the nested config holding the decoder's sizes (None: flat)
    decoder: str = "model"              # the *ForCausalLM's decoder stack (owns layers, norm, embed_tokens)
    lm_head: str = "lm_head"
    step_loop: bool = False             # forward.py's Llama-shaped loop computes this layer exactly
    grouped_attention: bool = True      # attention.py's kernel computes this attention exactly
    norm_offset: float = 0.0            # the final RMSNorm scales by (offset + weight) (Gemma: 1)
    model_class: str = "AutoModelForCausalLM"  # transformers' class that loads it (where Auto maps none)
    needs: str = ""                     # what the family needed (README's table)


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama",), step_loop=True, needs="none (the reference layout)"),
    Family("qwen2", ("qwen2",), needs="q/k/v biases: transformers' layer under the grouped kernel"),
    Family("qwen3", ("qwen3",), needs="q/k norms: transformers' layer under the grouped kernel"),
    Family("qwen3_moe", ("qwen3_moe",), needs="sparse MoE MLP and q/k norms: transformers' layer"),
    Family("mistral", ("mistral",), step_loop=True,
           needs="sliding window (v0.1) in the ragged masks; the step loop only without one"),
    Family("gemma3_text", ("gemma3_text",), norm_offset=1.0,
           needs="sliding/full layers (two masks), (1 + w) norms, scaled embeddings"),
    Family("gemma3", ("gemma3",), text_config="text_config", decoder="model.language_model",
           norm_offset=1.0, needs="nested text_config (>= 4B), as gemma3_text"),
    Family("mistral3", ("mistral3",), text_config="text_config", decoder="model.language_model", step_loop=True,
           model_class="Mistral3ForConditionalGeneration",
           needs="nested text_config (Mistral-Small-3.x), as mistral"),
    Family("llama4_text", ("llama4_text",), needs="chunked/full layers (two masks), MoE, NoPE layers"),
    Family("llama4", ("llama4",), text_config="text_config",
           needs="nested text_config, as llama4_text"),
    Family("gpt_oss", ("gpt_oss",), grouped_attention=False,
           needs="attention sinks: transformers' eager attention; sliding/full masks, additive"),
    Family("phi3", ("phi3",), needs="fused qkv/gate_up, partial rotary (the head keeps full rotary)"),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


class UnsupportedTarget(ValueError):
    """A target this platform cannot run exactly; the message says why and what would fix it."""


def family_of(config) -> Family:
    """The registry entry of an HF config (object or dict), or UnsupportedTarget naming what is missing."""
    mt = _get(config, "model_type")
    fam = _BY_TYPE.get(mt)
    if fam is None:
        raise UnsupportedTarget(
            f"target family {mt!r} is not registered (eagle3_platform/model/families.py knows "
            f"{', '.join(sorted(_BY_TYPE))}): an entry must say where its decoder layers, final norm, "
            "embeddings and lm_head are, its nested text config if any, and whether the engine's "
            "grouped attention and step loop compute its attention exactly")
    return fam


def text_config(config):
    """The config holding the decoder's sizes (num_hidden_layers, hidden_size, ...): the nested
    text config of a multimodal checkpoint (Llama-4, Gemma-3 >= 4B, Mistral-3), else the config."""
    fam = family_of(config)
    inner = _get(config, fam.text_config) if fam.text_config else None
    return config if inner is None else inner


def causal_lm_class(config):
    """The transformers class that loads a target of this config: AutoModelForCausalLM, or the family's
    own class where transformers' causal-LM mapping has no entry (Mistral-3)."""
    import transformers

    return getattr(transformers, family_of(config).model_class)


def capture_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3 low/mid/high capture: outputs of layers [1, L//2-1, L-4] (SGLang's convention, the
    inputs of layers [2, L//2, L-3]), distinct and in range from L = 7; shallower targets take three
    consecutive layers from layer 1 (L 5, 6: [1, 2, 3]) or 0 (L 3, 4: [0, 1, 2])."""
    if num_layers < 3:
        raise UnsupportedTarget(f"EAGLE-3 captures three layers; a {num_layers}-layer target has fewer")
    if num_layers >= 7:
        return [1, num_layers // 2 - 1, num_layers - 4]
    low = 1 if num_layers >= 5 else 0
    return [low, low + 1, low + 2]


@dataclass(frozen=True)
class AttentionLayout:
    """How each layer attends: kinds[i] in FULL | SLIDING | CHUNKED; window = the sliding window
    (a key at position k is seen from p when p - window < k <= p), chunk = the chunk size (keys of
    the query's own chunk only); additive: masks as additive floats (eager kernels add the mask)."""
    kinds: tuple[str, ...]
    window: int | None = None
    chunk: int | None = None
    additive: bool = False
    sinks: bool = False
    softcap: bool = False

    @property
    def uniform(self) -> bool:
        return len(set(self.kinds)) <= 1


def attention_layout(config) -> AttentionLayout:
    """The attention pattern of an HF config (outer or text), as transformers' masks build it."""
    fam = family_of(config)
    c = text_config(config)
    n = _get(c, "num_hidden_layers")
    window, chunk = _get(c, "sliding_window"), _get(c, "attention_chunk_size")
    kinds = _get(c, "layer_types")
    if kinds is None:  # one mask kind for every layer (Mistral, Phi-3, Qwen3-MoE: the window if set)
        kinds = [SLIDING if window is not None else FULL] * n
    unknown = sorted(set(kinds) - {FULL, SLIDING, CHUNKED})
    if unknown:
        raise UnsupportedTarget(f"target family {fam.name!r}: layer types {unknown} (only full, sliding "
                                "and chunked attention run exactly here)")
    return AttentionLayout(kinds=tuple(kinds), window=window if SLIDING in kinds else None,
                           chunk=chunk if CHUNKED in kinds else None, additive=not grouped_attention(config),
                           sinks=fam.name == "gpt_oss" or _get(c, "sinks") is not None,
                           softcap=_get(c, "attn_logit_softcapping") is not None)


def grouped_attention(config) -> bool:
    """attention.py's kernel is exact for this target: no sinks, no attention-logit soft-capping."""
    fam = family_of(config)
    return fam.grouped_attention and _get(text_config(config), "attn_logit_softcapping") is None


def step_loop(config) -> bool:
    """forward.py's loop is exact for this target: a Llama-shaped family, every layer full attention."""
    fam = family_of(config)
    return fam.step_loop and grouped_attention(config) and set(attention_layout(config).kinds) == {FULL}


def module_at(model, path: str):
    """model.a.b.c for path 'a.b.c'; AttributeError naming the path where a part is missing."""
    obj = model
    for part in path.split("."):
        if not hasattr(obj, part):
            raise UnsupportedTarget(f"{type(model).__name__} has no {path!r} "
                                    f"(its family entry says the decoder is there)")
        obj = getattr(obj, part)
    return obj


def decoder(model):
    """The decoder stack of a loaded *ForCausalLM (it owns .layers, .norm, .embed_tokens)."""
    return module_at(model, family_of(model.config).decoder)


def checkpoint_names(config, part: str) -> tuple[str, ...]:
    """The names a checkpoint may give the tensor of `part` ('embed_tokens', 'norm', 'lm_head'): as
    transformers saves this family today, and the older multimodal layout ('language_model.model.')."""
    fam = family_of(config)
    if part == "lm_head":
        return (f"{fam.lm_head}.weight", "language_model.lm_head.weight")
    names = [f"{fam.decoder}.{part}.weight", f"model.{part}.weight"]
    if fam.text_config:
        names.append(f"language_model.model.{part}.weight")
    return tuple(dict.fromkeys(names))


def _get(config, key: str):
    if key is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, key, None)
