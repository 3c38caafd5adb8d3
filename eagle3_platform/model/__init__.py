"""The target model: loading it, running its forward fast, and choosing its tokens; what regeneration,
feature extraction, training and the engine all run on. Imports nothing of the library above it.

target.py         load and convert the target (HF checkpoint, GGUF), its identity and layer choice
compute.py        the dtype and kernels per machine and kind of work, the torch thread count
attention.py      grouped-query decode and verify attention on CPU (a transformers attention kernel)
kv_cache.py       the growing KV cache of one sequence
ragged.py         the KV cache of a continuous batch of rows of different lengths
int4_weights.py   few-row matmuls on a 4-bit target's own codes
packed_linear.py  linear layers on oneDNN's packed layout, siblings fused (q|k|v, gate|up)
forward.py        the decode and verify step's forward for Llama-style targets
sampling.py       the greedy choice and the sampling distribution over the target's logits
"""
