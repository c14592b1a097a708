"""Pure merge/split of the tensors Megatron fuses; each pair is exact in both directions.

- qkv: Megatron's `linear_qkv` holds, for each query group g in turn, that group's query
  heads, then its key head, then its value head: `[q_g; k_g; v_g]` along dim 0. Weights and
  biases use the same layout. Because a group is contiguous, a TP rank's slice of dim 0 is
  whole query groups.
- fc1: Megatron's `linear_fc1` is `[gate; up]` along dim 0 (SwiGLU: silu(gate) * up).
- hf_qkv: HF's fused `qkv_proj` (Phi-3) is `[all q; all k; all v]` along dim 0, regrouped
  per query group as qkv. (Phi-3's fused `gate_up_proj` is `[gate; up]`, fc1's own layout.)
"""

from typing import Callable, Sequence

import torch
from torch import Tensor


def merge_qkv(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> Tensor:
    """HF's separate q, k, v projections (weights or biases) -> Megatron's per-group layout."""
    rest = q.shape[1:]
    heads_per_group = num_heads // num_query_groups
    q = q.reshape(num_query_groups, heads_per_group * head_dim, *rest)
    k = k.reshape(num_query_groups, head_dim, *rest)
    v = v.reshape(num_query_groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Megatron's per-group layout -> HF's q, k, v (inverse of `merge_qkv`)."""
    rest = qkv.shape[1:]
    heads_per_group = num_heads // num_query_groups
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def merge_hf_qkv(qkv: Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> Tensor:
    """HF's fused [all q; all k; all v] -> Megatron's per-group layout."""
    q, k, v = torch.split(qkv, [num_heads * head_dim, num_query_groups * head_dim, num_query_groups * head_dim])
    return merge_qkv(q, k, v, num_heads, num_query_groups, head_dim)


def split_hf_qkv(qkv: Tensor, num_heads: int, num_query_groups: int, head_dim: int) -> Tensor:
    """Megatron's per-group layout -> HF's fused [all q; all k; all v] (inverse of `merge_hf_qkv`)."""
    return torch.cat(split_qkv(qkv, num_heads, num_query_groups, head_dim))


def merge_fc1(gate: Tensor, up: Tensor) -> Tensor:
    return torch.cat([gate, up], dim=0)


def split_fc1(fc1: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up


# Fused layout name (families.Param.fuse) -> (merge, split), both taking the model shape.
FUSED: dict[str, tuple[Callable[..., Tensor], Callable[..., Sequence[Tensor]]]] = {
    "qkv": (
        lambda parts, s: merge_qkv(*parts, s.num_attention_heads, s.num_query_groups, s.head_dim),
        lambda fused, s: split_qkv(fused, s.num_attention_heads, s.num_query_groups, s.head_dim),
    ),
    "fc1": (lambda parts, s: merge_fc1(*parts), lambda fused, s: split_fc1(fused)),
    "hf_qkv": (
        lambda parts, s: merge_hf_qkv(*parts, s.num_attention_heads, s.num_query_groups, s.head_dim),
        lambda fused, s: (split_hf_qkv(fused, s.num_attention_heads, s.num_query_groups, s.head_dim),),
    ),
}


def fuse(kind: str | None, parts: Sequence[Tensor], shape) -> Tensor:
    """HF tensors -> one full Megatron tensor; a plain rename when `kind` is None."""
    return parts[0] if kind is None else FUSED[kind][0](parts, shape)


def unfuse(kind: str | None, fused: Tensor, shape) -> Sequence[Tensor]:
    """One full Megatron tensor -> its HF tensors, in the table's order."""
    return (fused,) if kind is None else FUSED[kind][1](fused, shape)
