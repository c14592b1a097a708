"""HF <-> Megatron-Core checkpoint conversion, driven by one table per architecture family.

- `llama`: the Llama family's name table and config reading, as data (imports no torch, so
  config validation can read a model's shape);
- `layout`: pure merge/split of fused tensors (qkv per query group, gate/up), both directions;
- `sharding`: tensor/pipeline-parallel placement, and the two conversions built from the
  above: `hf_to_megatron` (one rank's local state) and `megatron_to_hf` (from full tensors).

This package's `__init__` stays empty so `alignflow.convert.llama` imports without torch.
"""
