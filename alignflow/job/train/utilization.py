"""How well a stage used its hardware: model FLOPs, TFLOP/s, MFU, against the device's peak.

Model FLOPs are Megatron-LM's (`num_floating_point_operations` in megatron/training/training.py,
the dense-transformer case; Narayanan et al. 2021, appendix "Floating-point operations"),
generalised to packed rows as Megatron-Bridge does (attention sums the squares of each
document's length, since a document never attends across another). Per token, forward:
- weight GEMMs, 2 FLOPs per multiply-add: 2 h (q + 2 kv) [QKV, GQA: kv = kv_heads x head_dim]
  + 2 q h [output] + 2 x 3 h f [SwiGLU MLP: gate, up, down, as in every Llama-family model
  alignflow converts] per layer, + 2 h V [logits, tied or not; V = 1: a reward model's score];
- core attention, causal (half of the score matrix is computed, as Megatron-LM counts it):
  QK^T and (QK^T)V, 2 x 2 q n / 2 per layer for a token of a document of n tokens.
Norms, RoPE, softmax and the loss are left out (as Megatron-LM). A training step is 3 forwards
(forward, weight gradient, input gradient); a LoRA step skips the frozen weights' gradient (2
for the weight GEMMs, 3 for the core attention, adapters not counted); a forward-only pass is 1.
PaLM's 6N + 12 L h n per token (Chowdhery et al. 2022, appendix B) is the same but counts the
whole score matrix. Recomputed activations are not model FLOPs: MFU, not hardware FLOPs.

MFU = achieved model FLOP/s / (ranks x the device's dense bf16 peak); no peak on CPU or on a
device the table does not know (MFU null then). No torch here: the orchestrator reads the
metric names.
"""

import re
import resource
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Iterable, Optional

from alignflow.job.convert.families import CAUSAL_OF

# Dense (no sparsity) bf16 Tensor Core peak, TFLOP/s, by torch.cuda.get_device_name() pattern,
# first match wins. NVIDIA's datasheets print the sparse figure, twice these: H100 SXM5 1,979
# ("NVIDIA H100 80GB HBM3"), H100 PCIe 1,513, H200 SXM 1,979 (H100 and H200 datasheets, 2023-24);
# A100 312 dense (A100 datasheet, SXM4 and PCIe alike).
PEAK_BF16_TFLOPS = (
    ("*H100*PCIe*", 756.0),
    ("*H100*HBM3*", 989.0),
    ("*H100*SXM*", 989.0),
    ("*H200*", 989.0),
    ("*A100*", 312.0),
)
PEAK_SOURCE = "NVIDIA datasheets, dense bf16 Tensor Core (half the printed sparse figure)"

# The metrics a stage reports about its hardware use (manifest, artifacts, report.html).
HARDWARE_METRICS = ("tokens_per_s", "tflops", "mfu", "peak_memory_gib", "peak_memory_of")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def of(cls, hf_config: dict) -> "ModelShape":
        """From a Llama-family HF config.json (the models alignflow converts); a reward model's
        ...ForSequenceClassification ends in one output, not the vocabulary."""
        h, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
        scores = (hf_config.get("architectures") or [""])[0] in CAUSAL_OF
        return cls(
            hidden=h,
            layers=hf_config["num_hidden_layers"],
            heads=heads,
            kv_heads=hf_config.get("num_key_value_heads") or heads,
            head_dim=hf_config.get("head_dim") or h // heads,
            ffn=hf_config["intermediate_size"],
            vocab=1 if scores else hf_config["vocab_size"],
        )

    def weight_flops_per_token(self) -> float:
        """Forward FLOPs of the weight GEMMs for one token (independent of the context)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * self.ffn  # the Llama family's MLP: gate, up, down
        return self.layers * per_layer + 2 * h * self.vocab

    def attention_flops_per_token(self, context: float) -> float:
        """Forward FLOPs of the causal core attention for a token of a document of `context` tokens."""
        return self.layers * 2 * 2 * self.heads * self.head_dim * context / 2


@dataclass(frozen=True)
class Passes:
    """Forward-equivalents per token: of the weight GEMMs and of the core attention."""

    weights: float
    attention: float

    def __add__(self, other: "Passes") -> "Passes":
        return Passes(self.weights + other.weights, self.attention + other.attention)

    def __mul__(self, times: float) -> "Passes":
        return Passes(self.weights * times, self.attention * times)


FORWARD = Passes(1, 1)
TRAINING = Passes(3, 3)
LORA_TRAINING = Passes(2, 3)


def model_flops(shape: ModelShape, documents: Iterable[int], passes: Passes = TRAINING) -> float:
    """Model FLOPs of `passes` over documents of these lengths (each attends within itself)."""
    lengths = [int(n) for n in documents]
    return flops_of(shape, sum(lengths), sum(n * n for n in lengths), passes)


def flops_of(shape: ModelShape, tokens: float, squares: float, passes: Passes) -> float:
    """Model FLOPs of `passes` over `tokens` tokens whose documents' squared lengths sum to `squares`."""
    return passes.weights * tokens * shape.weight_flops_per_token() + passes.attention * shape.attention_flops_per_token(1) * squares


def peak_tflops(device_name: Optional[str]) -> Optional[float]:
    """The device's dense bf16 peak (None: a CPU, or a device the table does not know)."""
    if not device_name:
        return None
    return next((tflops for pattern, tflops in PEAK_BF16_TFLOPS if fnmatch(device_name, pattern)), None)


def figures(flops: float, seconds: float, ranks: int, device_name: Optional[str]) -> dict:
    """TFLOP/s achieved over all ranks and MFU (None without a known peak)."""
    achieved = flops / max(seconds, 1e-9) / 1e12
    peak = peak_tflops(device_name)
    return {"tflops": float(f"{achieved:.4g}"), "mfu": None if peak is None else float(f"{achieved / (peak * ranks):.4g}")}


def peak_rss_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM, which starts afresh at exec, not
    `ru_maxrss`, which Linux carries over exec from the process that forked it (a job started by
    a 1 GiB orchestrator would report at least 1 GiB); `ru_maxrss` where there is no /proc."""
    status = Path("/proc/self/status")
    if status.exists():
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text()).group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
