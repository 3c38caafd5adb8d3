"""One target forward that also returns the EAGLE-3 features (docs/ARCHITECTURE.md §5).

Features are taken with forward hooks on the chosen decoder layers and on the final norm, not with
`output_hidden_states=True`: that would keep every layer's state alive, while hooks keep only the
three captured layers plus the final state, so the cost stays that of a plain forward.

Convention: layer id i means "the output of decoder layer i" (0-based), which is
`output_hidden_states`' hidden_states[i + 1] and SGLang's aux-hidden-state convention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from eagle3_platform.model.families import decoder


@dataclass
class CaptureOutput:
    logits: torch.Tensor | None  # [B,T,V]; None when compute_logits=False
    aux_hidden: torch.Tensor  # [B,T,len(layer_ids)*H] = concat of the captured layer outputs
    last_hidden: torch.Tensor  # [B,T,H] final post-norm state (lm_head input)
    past_key_values: Any  # the model's cache (None unless use_cache)


def decoder_stack(model: torch.nn.Module) -> torch.nn.Module:
    """The inner decoder of a *ForCausalLM where its family entry says it is (model/families.py);
    it owns `.layers` and `.norm`."""
    base = decoder(model)
    if not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise ValueError(f"{type(model).__name__} has no decoder stack with .layers and .norm")
    return base


def forward_capture(model, input_ids, layer_ids: Sequence[int], *, attention_mask=None,
                    position_ids=None, past_key_values=None, use_cache=False,
                    compute_logits: bool = True, logits_to_keep: int = 0, **model_kwargs) -> CaptureOutput:
    """One target forward that also returns the EAGLE-3 features.

    input_ids [B,T]; attention_mask: None, 2D padding mask [B,P+T], or 4D additive float [B,1,T,P+T];
    returns CaptureOutput(logits [B,T,V], aux_hidden [B,T,3H] = concat of the outputs of layers
    layer_ids (0-based, 'output of layer i'), last_hidden [B,T,H] (final post-norm), past_key_values).
    compute_logits=False runs only the decoder stack (offline extraction: the teacher logits are
    recomputed from last_hidden with the frozen lm_head at training time), saving the lm_head matmul.
    logits_to_keep=n > 0: logits of the last n positions only ([B,n,V]; a prefill needs one row, and
    the lm_head over every prompt token was ~12% of a SmolLM2 prefill), as transformers' argument.
    model_kwargs: passed on to the model (its attention function receives them).
    """
    base = decoder_stack(model)
    n_layers = len(base.layers)
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad or not layer_ids:
        raise ValueError(f"capture layer ids {list(layer_ids)} invalid for a {n_layers}-layer target")
    captured: dict[Any, torch.Tensor] = {}

    def keep(key):
        def hook(_module, _args, output):
            # Decoder layers return a tensor in transformers 5, a tuple in older versions.
            captured[key] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [base.layers[i].register_forward_hook(keep(i)) for i in set(layer_ids)]
    handles.append(base.norm.register_forward_hook(keep("norm")))
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  past_key_values=past_key_values, use_cache=use_cache, **model_kwargs)
    try:
        out = model(**kwargs, logits_to_keep=logits_to_keep) if compute_logits else base(**kwargs)
    finally:
        for h in handles:
            h.remove()
    # a sharded target (accelerate's device_map) leaves each layer's output on that layer's device:
    # gathered onto the final norm's device before the concat
    home = captured["norm"].device
    aux = torch.cat([captured[i].to(home) for i in layer_ids], dim=-1)  # 3 x [B,T,H] -> [B,T,3H]
    return CaptureOutput(logits=out.logits if compute_logits else None, aux_hidden=aux,
                         last_hidden=captured["norm"],
                         past_key_values=getattr(out, "past_key_values", None))
