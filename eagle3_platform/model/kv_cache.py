"""A transformers DynamicCache that grows in place instead of by concatenation.

DynamicLayer appends with `torch.cat`, so every decode step copies the whole cache of every layer into
a fresh allocation; at batch 128 that is GBs per step, and on these VMs fresh pages are expensive.
Here keys/values are prefix views of buffers with spare room: an append writes into the buffer, and
the buffer grows by an eighth (and MIN_SPARE) when full: attention reads a buffer whole when it is
little wider than its keys (attention.py: contiguous, no copy), and a growth's copy comes only every
~need/8 appends. Code that replaces `.keys` keeps working: a shorter prefix
view (a crop) still writes into the same buffer; any other tensor
(`batch_select_indices`) is copied into a fresh buffer on the next append.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from eagle3_platform.model.attention import cache_buffer

MIN_SPARE = 64  # tokens of headroom added on every growth


def slot_capacity(need: int) -> int:
    """Slots to allocate for `need`: an eighth more and MIN_SPARE (buffers at most ~1.5x their span
    at 128+ tokens, so attention can read them whole)."""
    return need + need // 8 + MIN_SPARE


class GrowingLayer(DynamicLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buf = self.value_buf = None  # [B,kv,capacity,hd]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if not self._is_prefix_view(n + t, key_states.shape[0]):
            self._grow(n, n + t, key_states, value_states)
        self.key_buf[:, :, n:n + t] = key_states  # [B,kv,t,hd] written in place
        self.value_buf[:, :, n:n + t] = value_states
        self.keys, self.values = self.key_buf[:, :, :n + t], self.value_buf[:, :, :n + t]
        return self.keys, self.values

    def _is_prefix_view(self, need: int, batch: int) -> bool:
        buf = self.key_buf
        return (buf is not None and buf.shape[2] >= need and buf.shape[0] == batch
                and self.keys.data_ptr() == buf.data_ptr() and self.keys.stride() == buf.stride()
                and self.values.data_ptr() == self.value_buf.data_ptr())

    def _grow(self, n: int, need: int, key_states, value_states) -> None:
        """Fresh buffers with room for slot_capacity(need) entries, holding the current n."""
        bufs = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            b, h, _, d = new.shape
            buf = cache_buffer(new, (b, h, slot_capacity(need), d))
            if n:
                buf[:, :, :n] = old
            bufs.append(buf)
        self.key_buf, self.value_buf = bufs


class GrowingCache(DynamicCache):
    def __init__(self):
        Cache.__init__(self, layer_class_to_replicate=GrowingLayer)

    def adopt(self, layer_idx: int, key_buf: torch.Tensor, value_buf: torch.Tensor, n: int) -> None:
        """Layer layer_idx takes buffers [B,kv,capacity,hd] whose first n slots hold its keys/values
        (built elsewhere, e.g. rows of other caches stacked): no copy, and appends go in place."""
        while len(self.layers) <= layer_idx:
            self.layers.append(GrowingLayer())
        layer = self.layers[layer_idx]
        layer.lazy_initialization(key_buf, value_buf)
        layer.key_buf, layer.value_buf = key_buf, value_buf
        layer.keys, layer.values = key_buf[:, :, :n], value_buf[:, :, :n]
