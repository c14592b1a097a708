"""HF <-> Megatron-Core checkpoint conversion, driven by one table per architecture family.

- `families`: each HF architecture's config reading and the one name table, as data (imports no torch, so
  config validation can read a model's shape);
- `layout`: pure merge/split of fused tensors (qkv per query group, gate/up), both directions;
- `sharding`: vocab padding, pipeline stage ends, and the HF tensors of one Megatron tensor;
- `streaming`: the conversions the stages run, one layer at a time, to and from global
  torch_dist tensors (the in-memory reference they are tested against: tests/reference_convert.py).

This package's `__init__` stays empty so `alignflow.job.convert.families` imports without torch.
"""
