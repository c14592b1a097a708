"""Gemma 2 / 3's pieces that Megatron-Core 0.16.1's GPTModel lacks, for `alignflow.job.model.gpt`:

- `GemmaRMSNorm`: x * (1 + w), computed in fp32 and cast back, as HF's Gemma2/Gemma3RMSNorm
  (the weights stay zero-centered as HF stores them). The local spec's norm (torch's RMSNorm)
  refuses `layernorm_zero_centered_gamma`; Transformer Engine's norms take it from the config.
- `post_normed`: a row-parallel linear whose (reduced) output goes through a norm, HF's
  post-attention and post-feedforward norms of the "sandwich"; the norm's weight is saved as
  `<linear>.post_layernorm.weight`, as Megatron-Bridge names it.
- `LayerTypeRotaryEmbedding` and `LayerRopeSelfAttention`: Gemma 3's sliding-window layers
  rotate with their own RoPE base; GPTModel computes one embedding, so both are computed and
  stacked, and each layer's attention takes its own.
- `install`: the embeddings scaled by sqrt(hidden_size) in the weights' dtype, and the final
  logits soft-capped (cap * tanh(logits / cap)), as forward hooks on GPTModel's modules.

Attention soft-capping and the per-layer window are `DocumentWindowAttention`'s
(`alignflow.job.model.attention.packed_attention`).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from alignflow.job.convert.families import ModelShape
from alignflow.job.device import device


def gelu_tanh(x: Tensor) -> Tensor:
    """HF's `gelu_pytorch_tanh`: GeGLU's gate activation."""
    return F.gelu(x, approximate="tanh")


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: x / rms(x) * (1 + w) in fp32, in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


def softcap(x: Tensor, cap: float) -> Tensor:
    return torch.tanh(x / cap) * cap


class GemmaRMSNorm(torch.nn.Module):
    """`offset_rms_norm` as a Megatron norm module (built as `norm(config=, hidden_size=, eps=)`);
    zeros (the identity) before weights are loaded, as HF initialises it."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device()))
        self.weight.sequence_parallel = config.sequence_parallel  # replicated: grads summed over TP under SP

    def forward(self, x: Tensor) -> Tensor:
        return offset_rms_norm(x, self.weight, self.eps)


def post_normed(linear: type, norm: type) -> type:
    """`linear` (a row-parallel linear of Megatron or TE, built without a bias) followed by
    `norm` on its reduced output."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        linear.__init__(self, input_size, output_size, config=config, **kwargs)
        self.post_layernorm = norm(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

    def forward(self, x: Tensor):
        out, bias = linear.forward(self, x)
        return self.post_layernorm(out), bias

    return type(f"PostNormed{linear.__name__}", (linear,), {"__init__": __init__, "forward": forward})


class LayerTypeRotaryEmbedding(RotaryEmbedding):
    """The full-attention layers' RoPE (this module's, with its scaling) and the sliding-window
    layers' (`local`, base `local_base`, unscaled), stacked: [2, s, 1, 1, dim]."""

    def __init__(self, *, local_base: float, **kwargs):
        super().__init__(**kwargs)
        self.local = RotaryEmbedding(**{**kwargs, "rotary_base": local_base, "seq_len_interpolation_factor": None})

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        return torch.stack(
            [super().forward(max_seq_len, offset, packed_seq, cp_group), self.local.forward(max_seq_len, offset, packed_seq, cp_group)]
        )


def is_window_layer(config, layer_number: int) -> bool:
    """Whether the (global, 1-based) layer attends within the sliding window."""
    return is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)


class LayerRopeSelfAttention(SelfAttention):
    """SelfAttention taking its layer type's RoPE from `LayerTypeRotaryEmbedding`'s stack."""

    def forward(self, *args, rotary_pos_emb: Optional[Tensor] = None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[int(is_window_layer(self.config, self.layer_number))]
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def install(model, shape: ModelShape) -> None:
    """Gemma's embedding scale, final logit soft-capping and per-layer-type RoPE on a built GPTModel chunk."""
    if shape.embedding_scale and model.pre_process:
        model.embedding.register_forward_hook(_scale_embedding)
    if shape.logit_softcap is not None and model.post_process:
        model.output_layer.register_forward_hook(lambda module, args, out: (softcap(out[0], shape.logit_softcap), out[1]))
    if shape.local_rope_theta is not None:
        rope = model.rotary_pos_emb
        model.rotary_pos_emb = LayerTypeRotaryEmbedding(
            local_base=shape.local_rope_theta,
            kv_channels=model.config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=model.config.rotary_interleaved,
            seq_len_interpolation_factor=rope.seq_len_interpolation_factor,
            rotary_base=shape.rope_theta,
            use_cpu_initialization=model.config.use_cpu_initialization,
            cp_group=rope.cp_group,
        )


def _scale_embedding(module, args, out: Tensor) -> Tensor:
    return out * embedding_scale(module.config.hidden_size, out)


def embedding_scale(hidden_size: int, like: Tensor) -> Tensor:
    """HF's Gemma2/Gemma3TextScaledWordEmbedding's scale: sqrt(hidden) in fp32, cast to the embeddings' dtype."""
    return torch.tensor(hidden_size**0.5, device=like.device).to(dtype=like.dtype)
