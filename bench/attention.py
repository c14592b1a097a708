"""Attention of one packed micro batch, forward + backward, by each candidate kernel: time,
its peak memory (CUDA: allocated; CPU: RSS over the step), and its error against `sdpa`.

Candidates (`alignflow.job.model.attention` takes `varlen` on CUDA in bf16/fp16, else `sdpa`):
- `dense`: Megatron's unfused attention as main ran it for bf16 training: scores of whole
  rows [rows, heads, s, s], a block-diagonal mask, softmax in fp32;
- `sdpa`: `packed_attention`'s SDPA kernel per group of documents (no mask);
- `varlen`: torch's `varlen_attn` over cu_seqlens (CUDA only);
- `flex`: FlexAttention with a document (and window) block mask; compiled on CUDA, eager on
  CPU (where torch computes it unfused, and has no backward for it: forward only).
Shape: Llama-3.2-1B's attention (32 heads, 8 query groups, head dim 64), one row of --seq
tokens packing documents of --docs lengths (the rest padding), --window for Mistral's.

Run: .venv/bin/python bench/attention.py [--seq 4096 --dtype bf16]   (CPU default: --seq 2048 fp32;
--tiny: TINY's shape, with a window, every candidate in a second, so CI runs it end to end)
"""

import argparse
import ctypes
import re
import time

import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

from alignflow.job.model.attention import KERNELS, Documents

cuda = torch.cuda.is_available()
TINY = {"seq": 256, "window": 64, "heads": 4, "groups": 2, "repeats": 1}
parser = argparse.ArgumentParser()
parser.add_argument("--seq", type=int, default=4096 if cuda else 2048)
parser.add_argument("--docs", default=None, help="document lengths (default: 8 of 37% down to 0.7% of --seq)")
parser.add_argument("--window", type=int, default=None)
parser.add_argument("--dtype", default="bf16" if cuda else "fp32")
parser.add_argument("--heads", type=int, default=32)
parser.add_argument("--groups", type=int, default=8)
parser.add_argument("--repeats", type=int, default=10 if cuda else 2)
parser.add_argument("--tiny", action="store_true", help=f"the options {TINY}")
args = parser.parse_args()
if args.tiny:
    vars(args).update(TINY)
device, dtype = torch.device("cuda" if cuda else "cpu"), {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
s, heads, groups, dim = args.seq, args.heads, args.groups, 64
lengths = [int(n) for n in args.docs.split(",")] if args.docs else [s * n // 4096 for n in (1500, 900, 700, 400, 300, 120, 60, 30)]
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), s], dtype=torch.int32, device=device).unique_consecutive()
window_size = None if args.window is None else (args.window - 1, 0)
document = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff())


def dense(q, k, v):
    k, v = (t.repeat_interleave(heads // groups, 1) for t in (k, v))
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, s, dim]
    i = torch.arange(s, device=device)
    allowed = (document[:, None] == document[None]) & (i[:, None] >= i[None])
    if window_size is not None:
        allowed &= i[:, None] - i[None] <= window_size[0]
    scores = (q @ k.transpose(-1, -2) * dim**-0.5).float().masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1).to(v.dtype) @ v)[0].transpose(0, 1)


def flex(q, k, v):
    def same_document(b, h, i, j):
        return document[i] == document[j]

    def causal(b, h, i, j):
        return i >= j

    def in_window(b, h, i, j):
        return i - j <= window_size[0]

    rules = [same_document, causal] + ([in_window] if window_size is not None else [])
    mask = create_block_mask(and_masks(*rules), None, None, s, s, device=device)
    attend = torch.compile(flex_attention) if cuda else flex_attention
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    return attend(q, k, v, block_mask=mask, scale=dim**-0.5, enable_gqa=True)[0].transpose(0, 1)


def packed(name):
    documents = Documents.of(cu, int(cu.diff().max()), s)
    return lambda q, k, v: KERNELS[name](q, k, v, documents, window_size, dim**-0.5, 0.0)


def kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", open("/proc/self/status").read(), re.M).group(1))


def fresh_peak() -> int:
    """Return freed heap to the OS, reset the peak (VmHWM); the RSS now (as bench/memory.py)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    open("/proc/self/clear_refs", "w").write("5")
    return kb("VmRSS")


def step(fn, q, k, v, backward=True):
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out = fn(q, k, v)
    if backward:
        out.float().square().sum().backward()
    return out.detach()


# name: (kernel, with backward); torch's FlexAttention has no backward on CPU
candidates = {"dense": (dense, True), "sdpa": (packed("sdpa"), True), "flex": (flex, cuda)} | ({"varlen": (packed("varlen"), True)} if cuda else {})
q = torch.randn(s, heads, dim, device=device, dtype=dtype)
k, v = (torch.randn(s, groups, dim, device=device, dtype=dtype) for _ in range(2))
print(
    f"{device.type} {args.dtype}: one row of {s} tokens, documents {lengths} (+ padding), window {args.window}, "
    f"{heads} heads / {groups} groups x {dim}; forward + backward"
)
reference = step(candidates["sdpa"][0], q, k, v)
for name, (fn, backward) in candidates.items():
    out = step(fn, q, k, v, backward)  # warm-up (and compilation)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step(fn, q, k, v, backward)
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / args.repeats * 1e3
    if cuda:
        memory = f"peak {torch.cuda.max_memory_allocated() / 2**20:8.1f} MiB"
    else:
        before = fresh_peak()
        step(fn, q, k, v, backward)
        memory = f"peak RSS +{(kb('VmHWM') - before) / 1024:8.1f} MiB"
    error = (out.float() - reference.float()).abs().max().item()
    print(f"{name:>7}: {ms:9.2f} ms   {memory}   max |out - sdpa| {error:.1e}{'' if backward else '   (forward only)'}")
