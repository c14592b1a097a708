"""Attention of packed rows: each document of a micro batch attends causally within itself,
narrowed by Megatron's sliding `window_size` (Mistral, Gemma's window layers), its scores
soft-capped where asked (Gemma 2), in a fused kernel and without a mask over a row (a row of s
tokens never costs an s x s tensor).

`packed_attention` is the attention of every forward that is not Transformer Engine's:
Megatron's layers (`alignflow.job.model.gpt.DocumentWindowAttention`), the lean forward and
generation's prefill (`alignflow.job.model.decoder`), with gradients and without, so a
forward-only pass (reference log-probs, eval, a teacher, GRPO's old policy) computes what the
training forward computes on the same weights, bit for bit. Where Transformer Engine is
installed its attention runs the same documents as THD sequences instead
(`alignflow.job.model.gpt.document_params`).

`kernel` picks one of `KERNELS` per call (the one place to revisit the choice):
- `varlen`: torch's `varlen_attn` (FlashAttention-2 over cu_seqlens): all documents of the
  micro batch in one call, no padding, no mask, the window as flash's (left, 0) and query
  groups as they are. On CUDA in bf16/fp16 without attention dropout, where torch has it with
  `scale` and `window_size` (2.11 and later).
- `sdpa`: torch's `scaled_dot_product_attention` on groups of documents (`Documents.groups`):
  causal without a mask (its flash kernel on CPU and CUDA, the memory-efficient one for fp32
  on CUDA); only a document longer than the window gets a mask, of its own length squared.
  Everywhere else: CPU, fp32 on CUDA, attention dropout (on CPU torch computes dropout
  unfused: the scores of each document group).
- `eager`: soft-capped scores (cap * tanh(scores / cap), before the mask and the fp32
  softmax, as HF's Gemma 2), which neither SDPA nor torch's flash kernels take: the same
  document groups as `sdpa`, their scores [documents, heads, length, length] computed, capped,
  masked (causal, window) and softmaxed in plain torch ops; cost and memory sum(length^2) per
  group, never a row's s x s.
FlexAttention with a document (and window) block mask is the third candidate, not taken:
unfused, as it runs without torch.compile and on CPU, it computes the scores of whole rows
[rows, heads, s, s]; compiled, it costs a compilation per new packed shape and a block mask
per micro batch, where `varlen` needs neither. `bench/attention.py` measures the candidates
on whatever device it runs on (CUDA speed not measured yet).
"""

import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

VARLEN_ARGS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()
ALONE = 128  # `sdpa`: documents longer than this attend in calls of their own (their overhead is small beside them)


class Group(NamedTuple):
    """One `sdpa` call: documents of `length` tokens (padded at their end), read from the flat
    positions `gather` ([documents, length]: an index, or a slice of whole documents) and
    written back to `scatter` from the token positions `real` of the flattened [documents *
    length] output (None: all; an index, not a boolean mask, whose shape the device would
    have to tell the host)."""

    length: int
    gather: Tensor | slice
    scatter: Tensor | slice
    real: Optional[Tensor]


@dataclass
class Documents(PackedSeqParams):
    """`PackedSeqParams` of packed rows for `packed_attention`: the documents of the flattened
    [rows * length] micro batch start at `cu_seqlens_q` (int32, on the model's device; a row's
    padding is a document too); `longest` is the longest document. `max_seqlen_q` is the rows'
    length, which GPTModel computes RoPE for (row positions: RoPE is relative). `host`: the
    same offsets on the host where the caller has them (no device read to plan the calls)."""

    longest: int = 0
    host: Optional[list[int]] = None

    @classmethod
    def of(cls, cu_seqlens: Tensor, longest: int, length: int, host: Optional[list[int]] = None) -> "Documents":
        cu_seqlens = cu_seqlens.to(torch.int32)
        return cls(
            qkv_format="sbhd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=length,
            max_seqlen_kv=length,
            longest=int(longest),
            host=host,
        )

    @classmethod
    def rows(cls, rows: int, length: int, device: torch.device) -> "Documents":
        """Each row one document (unpacked sequences)."""
        host = list(range(0, rows * length + 1, length))
        return cls.of(torch.tensor(host, dtype=torch.int32, device=device), length, length, host)

    @cached_property
    def groups(self) -> list[Group]:
        """The `sdpa` calls, built once per micro batch (every layer reuses them) on cu_seqlens'
        device: runs of consecutive documents of one length over ALONE tokens as one slice
        (a view [documents, length]); shorter ones gathered by their length rounded up to a
        power of two (>= 16) and padded at their end, which causal attention never lets a
        token see, so short documents do not cost a call each."""
        cu = np.asarray(self.host if self.host is not None else self.cu_seqlens_q.tolist(), dtype=np.int64)
        device = self.cu_seqlens_q.device
        starts, lengths = cu[:-1], np.diff(cu)
        groups = [Group(int(n), run, run, None) for n, run in _runs(starts, lengths)]
        rounded = np.maximum(16, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
        short = lengths <= ALONE
        for length in np.unique(rounded[short]).tolist():
            picked = (rounded == length) & short
            offsets = np.arange(length)
            real = offsets[None] < lengths[picked, None]
            gather = np.where(real, starts[picked, None] + offsets[None], starts[picked, None])
            groups.append(Group(length, *(torch.from_numpy(a).to(device) for a in (gather, gather[real], np.flatnonzero(real)))))
        return groups


def _runs(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, slice]]:
    """(length, slice of flat positions) of each run of consecutive documents of one length over ALONE tokens."""
    runs: list[tuple[int, slice]] = []
    for start, n in zip(starts.tolist(), lengths.tolist()):
        if n <= ALONE:
            continue
        if runs and runs[-1][0] == n and runs[-1][1].stop == start:
            runs[-1] = (n, slice(runs[-1][1].start, start + n))
        else:
            runs.append((n, slice(start, start + n)))
    return runs


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: Documents,
    window_size: Optional[tuple],
    scale: float,
    dropout: float = 0.0,
    softcap: Optional[float] = None,
) -> Tensor:
    """Queries [t, heads, dim] and keys, values [t, query groups, dim] of the flattened rows
    (query head h reads group h // (heads / groups), as Megatron's) -> [t, heads, dim]."""
    if softcap is not None:
        return _eager(q, k, v, documents, window_size, scale, dropout, softcap)
    return KERNELS[kernel(q, dropout)](q, k, v, documents, window_size, scale, dropout)


def kernel(q: Tensor, dropout: float) -> str:
    """`varlen` where torch's flash kernel computes the call (see the top), else `sdpa`
    (soft-capped attention is always `eager`)."""
    flash = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    return "varlen" if flash and dropout == 0 and {"scale", "window_size"} <= VARLEN_ARGS else "sdpa"


def _varlen(q: Tensor, k: Tensor, v: Tensor, documents: Documents, window_size: Optional[tuple], scale: float, dropout: float) -> Tensor:
    if "enable_gqa" in VARLEN_ARGS:  # torch 2.13's; without it, the groups repeated to one per head
        gqa = {"enable_gqa": True}
    else:
        k, v, gqa = _repeated(k, q.shape[1]), _repeated(v, q.shape[1]), {}
    longest = documents.longest
    return varlen_attn(
        q,
        k,
        v,
        documents.cu_seqlens_q,
        documents.cu_seqlens_kv,
        longest,
        longest,
        scale=scale,
        window_size=tuple(window_size) if window_size is not None else (-1, 0),
        **gqa,
    )


def _sdpa(q: Tensor, k: Tensor, v: Tensor, documents: Documents, window_size: Optional[tuple], scale: float, dropout: float) -> Tensor:
    heads, dim = q.shape[1:]
    k, v = _repeated(k, heads), _repeated(v, heads)  # every SDPA backend takes equal heads; not all take enable_gqa
    out = torch.empty_like(q)
    for length, gather, scatter, real in documents.groups:
        qg, kg, vg = (t[gather].reshape(-1, length, heads, dim).transpose(1, 2) for t in (q, k, v))  # [documents, heads, length, dim]
        allowed = _window(length, window_size, q.device)
        part = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=allowed, is_causal=allowed is None, dropout_p=dropout, scale=scale).transpose(
            1, 2
        )
        part = part.reshape(-1, heads, dim)
        out[scatter] = part if real is None else part[real]
    return out


def _eager(
    q: Tensor, k: Tensor, v: Tensor, documents: Documents, window_size: Optional[tuple], scale: float, dropout: float, softcap: float
) -> Tensor:
    heads, dim = q.shape[1:]
    groups = k.shape[1]
    out = torch.empty_like(q)
    for length, gather, scatter, real in documents.groups:
        # [documents, groups, heads per group, length, dim]: a group's heads read its keys unrepeated
        qg = q[gather].reshape(-1, length, groups, heads // groups, dim).permute(0, 2, 3, 1, 4)
        kg, vg = (t[gather].reshape(-1, length, groups, 1, dim).permute(0, 2, 3, 1, 4) for t in (k, v))
        scores = torch.tanh(torch.matmul(qg, kg.transpose(-1, -2)) * scale / softcap) * softcap
        allowed = _window(length, window_size, q.device, always=True)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        part = torch.matmul(F.dropout(probs, dropout) if dropout else probs, vg)  # [documents, groups, per group, length, dim]
        part = part.permute(0, 3, 1, 2, 4).reshape(-1, heads, dim)
        out[scatter] = part if real is None else part[real]
    return out


def _window(length: int, window_size: Optional[tuple], device: torch.device, always: bool = False) -> Optional[Tensor]:
    """[length, length], True where query i sees key j (0 <= i - j <= window_size[0]); None where
    causal attention alone does (no window, or documents no longer than it) unless `always`."""
    if not always and (window_size is None or length <= window_size[0] + 1):
        return None
    distance = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)
    return (distance >= 0) & (distance <= (length if window_size is None else window_size[0]))


def _repeated(kv: Tensor, heads: int) -> Tensor:
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


KERNELS: dict[str, Callable[..., Tensor]] = {"varlen": _varlen, "sdpa": _sdpa}
