"""A lean forward of a Llama-family GPTModel over the model's own parameters: KV-cached for
generation (`Decoder`), and over whole sequences (`LeanForward`) for one-rank forward passes
and training, in fp32, where it computes what Megatron's forward would.

Why: a decode step through Megatron's module forward is ~80 Python module calls, tensor-parallel
autograd functions and inference-context bookkeeping per token; at 8 rows and a 1M-parameter
model that overhead was most of a step (see `alignflow.job.generation`). `Decoder` reads each
layer's weights once per batch (no copy) and runs the same math as Megatron's layers in ~20
torch ops per layer: RMSNorm, the fused qkv per query group ([q heads of the group; k; v]),
q/k RMSNorm per head (Qwen3) or over the whole projection (OLMo 2, its sum of squares
all-reduced over TP), RoPE on queries and keys together (on the first dims of each head with
a partial rotary factor, Phi-3), grouped-query attention on a preallocated cache, SwiGLU or a
MoE layer's softmax top-k router and SwiGLU experts (Mixtral, Qwen3-MoE: each expert runs on
the tokens routed to it, scaled by their router probabilities), the norms before each
sublayer or, post-norm (OLMo 2), on its output.
Gemma 2 / 3 (`alignflow.job.model.gemma`): x * (1 + w) norms in fp32, the post-attention and
post-MLP norms, GeGLU, scaled embeddings, soft-capped scores and logits, and per layer its
window and its RoPE (Gemma 3's sliding layers have their own base).

Batches: prompts are left-padded to the longest of the batch; a padded row's positions start
at 0 at its first real token and its padding is never attended (prefill runs each row's
padding as a document of its own through `packed_attention`, the training forward's
attention; decode steps mask it). Identical prompts (GRPO's group) are prefilled once and
their cache copied to each of their rows. Decode steps attend to the cache in place, a slice of
it under a sliding window (Mistral, Gemma's window layers).

Parallelism, as Megatron holds the weights: under TP each rank keeps its shards (qkv and fc1
columns, proj and fc2 rows, its rows of the padded vocab) and all-reduces the row-parallel
outputs (2 per layer; a MoE layer's experts split as the dense MLP, their outputs summed
before the one reduction) and the embedding, and all-gathers the logits; under PP hidden states
[b, s, h] go stage to stage point to point. Sequence and context parallelism do not apply:
every rank of those groups computes the whole (short) sequence with the same weights.
Under EP each rank holds num_experts / EP experts, and the ranks of an EP group are
data-parallel ranks decoding different rows: a MoE layer all-gathers the group's tokens (padded
to the group's largest count; the counts are exchanged at prefill and at a batch's first decode
step, its later steps having the same rows), routes them all (the router is replicated), runs
its local experts on the tokens routed to them and reduce-scatters the weighted outputs, so each
rank gets the sum over every expert for its own tokens, as at EP1 (the same terms, to rounding:
products of other shapes, and with top-k > 2 another order of the sum). Simpler than Megatron's
all-to-all (no per-expert counts, no permutation); every token goes to every EP rank, which at
a decode step's few rows costs latency, not bandwidth. Every rank of the group must therefore
call `prefill` and `decode` equally often: `alignflow.job.generation` keeps them in step.

Supported: what `alignflow.job.model.gpt.build_gpt` builds (Llama with its biases, Mistral's
window, Qwen2's qkv bias, Qwen3's q/k norms, Gemma 2 / 3, OLMo 2's post-norm layers and
whole-projection q/k norms, Phi-3's partial rotary and longrope (its attention factor on cos
and sin as HF applies it: the product `RotaryScale` gives Megatron's layers), tied embeddings,
linear / llama3 RoPE scaling, Mixtral's and Qwen3-MoE's experts at any EP), on the local spec
(SequentialMLP experts) and, by the same weights under TE's names (`linear_qkv.layer_norm_weight`),
the Transformer Engine spec (not run on CPU CI). Anything else a TransformerConfig can describe raises `NotImplementedError`
(`check_supported`) rather than decode differently from the training forward.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model
from torch import Tensor

from alignflow.job.device import device as rank_device
from alignflow.job.model.attention import Documents, packed_attention
from alignflow.job.model.gemma import (
    LayerRopeSelfAttention,
    LayerTypeRotaryEmbedding,
    embedding_scale,
    gelu_tanh,
    is_window_layer,
    offset_rms_norm,
    softcap,
)
from alignflow.job.model.lora import effective_weight
from alignflow.job.model.gpt import ProjectionRMSNorm, output_weight, packed_thd
from alignflow.job.model.vocab_parallel import mask_padded

# TransformerConfig fields the decoder implements only at these values.
REQUIRED = {
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "multi_latent_attention": False,
    "rotary_interleaved": False,
    "fp32_residual_connection": False,
    "apply_residual_connection_post_layernorm": False,
    "softmax_type": "vanilla",
    "attention_output_gate": False,
    "no_rope_freq": None,
    "experimental_attention_variant": None,
    "activation_func_clamp_value": None,
    "heterogeneous_block_specs": False,
    "apply_query_key_layer_scaling": False,
    # MoE: every layer sparse, a plain softmax top-k router, every token kept
    "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None,
    "moe_expert_capacity_factor": None,
    "moe_router_score_function": "softmax",
    "moe_router_topk_scaling_factor": None,
    "moe_router_group_topk": None,
    "moe_router_enable_expert_bias": False,
    "moe_input_jitter_eps": None,
    "moe_z_loss_coeff": None,
    "moe_apply_probs_on_input": False,
}
ACTIVATIONS = (F.silu, gelu_tanh)  # SwiGLU, GeGLU


def check_supported(model) -> None:
    """Refuse a model whose forward the decoder would not reproduce."""
    if wrong := unsupported(model):
        raise NotImplementedError(f"generation supports the families of alignflow.job.convert.families only; this model has {wrong}")


def unsupported(model) -> dict:
    """What the model has that the decoder's math does not (empty: nothing)."""
    config = model.config
    wrong = {k: getattr(config, k) for k, v in REQUIRED.items() if getattr(config, k, v) != v}
    if config.activation_func not in ACTIVATIONS:
        wrong["activation_func"] = config.activation_func
    if model.position_embedding_type != "rope" or model.rotary_pos_emb.inv_freq.numel() * 2 > config.kv_channels:
        wrong["position_embedding"] = f"{model.position_embedding_type} (RoPE within each head needed)"
    return wrong


@dataclass(frozen=True)
class LayerWeights:
    """A layer's weights, and its attention window and RoPE (0: the model's, 1: the window layers' own)."""

    window_size: Optional[tuple]  # Megatron's (left, 0): keys i - j <= left
    rope: int
    norm1: Optional[Tensor]  # None post-norm (OLMo 2)
    qkv: Tensor
    qkv_bias: Optional[Tensor]
    q_norm: Optional[Tensor]  # before RoPE: per head, or over this rank's share of the projection (`qk_norm_whole`)
    k_norm: Optional[Tensor]
    proj: Tensor
    proj_bias: Optional[Tensor]  # added once, after the TP reduction (Megatron's row-parallel bias)
    norm2: Optional[Tensor]
    fc1: Optional[Tensor]  # [gate; up] of this TP rank (None in a MoE layer)
    fc1_bias: Optional[Tensor]
    fc2: Optional[Tensor]
    fc2_bias: Optional[Tensor]
    post_attention_norm: Optional[Tensor]  # Gemma's sandwich norms or OLMo 2's post-norms, after the TP reduction
    post_mlp_norm: Optional[Tensor]
    router: Optional[Tensor] = None  # a MoE layer's [experts, hidden]
    experts: tuple[tuple[Tensor, Tensor], ...] = ()  # each expert's (fc1, fc2), sharded as the dense MLP's
    qk_norm_whole: bool = False


def layer_weights(layer) -> LayerWeights:
    """A TransformerLayer's parameters (local spec: separate norms; TE: norms fused into the
    linears); a LoRA-adapted linear's weight merged with its adapter, as its forward applies it."""
    attention, mlp, config = layer.self_attention, layer.mlp, layer.config
    window = is_window_layer(config, layer.layer_number)
    common = dict(
        window_size=config.window_size if window else None,
        rope=int(window and isinstance(attention, LayerRopeSelfAttention)),
        norm1=_norm(layer.input_layernorm, attention.linear_qkv),
        qkv=effective_weight(attention.linear_qkv),
        qkv_bias=_bias(attention.linear_qkv),
        q_norm=_qk_norm(attention.q_layernorm),
        k_norm=_qk_norm(attention.k_layernorm),
        proj=effective_weight(attention.linear_proj),
        proj_bias=_bias(attention.linear_proj),
        post_attention_norm=_post_norm(attention.linear_proj, getattr(layer, "post_self_attn_layernorm", None)),
        qk_norm_whole=isinstance(attention.q_layernorm, ProjectionRMSNorm),
    )
    if hasattr(mlp, "router"):  # MoELayer: its norm stands apart (both specs)
        return LayerWeights(
            **common,
            norm2=layer.pre_mlp_layernorm.weight,
            fc1=None,
            fc1_bias=None,
            fc2=None,
            fc2_bias=None,
            post_mlp_norm=None,
            router=mlp.router.weight,
            experts=_experts(mlp.experts),
        )
    return LayerWeights(
        **common,
        norm2=_norm(layer.pre_mlp_layernorm, mlp.linear_fc1),
        fc1=effective_weight(mlp.linear_fc1),
        fc1_bias=_bias(mlp.linear_fc1),
        fc2=effective_weight(mlp.linear_fc2),
        fc2_bias=_bias(mlp.linear_fc2),
        post_mlp_norm=_post_norm(mlp.linear_fc2, getattr(layer, "post_mlp_layernorm", None)),
    )


def _post_norm(linear, layer_norm) -> Optional[Tensor]:
    """Gemma's sandwich norm (on the linear) or OLMo 2's post-norm (`PostNormTransformerLayer`'s)."""
    norm = getattr(linear, "post_layernorm", None)
    norm = layer_norm if norm is None else norm
    return None if norm is None else norm.weight


def _experts(experts) -> tuple[tuple[Tensor, Tensor], ...]:
    """Each local expert's (fc1, fc2): SequentialMLP's MLPs, or TEGroupedMLP's `weight{i}` (not run on CPU)."""
    if hasattr(experts, "local_experts"):
        return tuple((effective_weight(e.linear_fc1), effective_weight(e.linear_fc2)) for e in experts.local_experts)
    return tuple((getattr(experts.linear_fc1, f"weight{i}"), getattr(experts.linear_fc2, f"weight{i}")) for i in range(experts.num_local_experts))


def _qk_norm(norm) -> Optional[Tensor]:
    return getattr(norm, "weight", None)  # None or Megatron's IdentityOp without q/k norms


def _bias(linear) -> Optional[Tensor]:
    bias = getattr(linear, "bias", None)
    return bias if bias is not None and bias.numel() else None  # TE keeps an empty tensor for "no bias"


def _norm(norm, fused_linear) -> Optional[Tensor]:
    weight = getattr(norm, "weight", None)
    return weight if weight is not None else getattr(fused_linear, "layer_norm_weight", None)  # None: post-norm


class Decoder:
    """One batch's KV cache and forward on this rank's pipeline stage.

    `pad[b]`: left padding of each row (on the host: planning the calls reads no device
    value); `prefill` then `decode` return the last position's logits [b, padded vocab] on the
    last pipeline stage and None on the others."""

    def __init__(self, model, pad: list[int], max_length: int):
        check_supported(model)
        config, device, shape = model.config, rank_device(), model.hf_shape
        self.model, self.eps, self.hidden = model, config.layernorm_epsilon, config.hidden_size
        self.norm = offset_rms_norm if config.layernorm_zero_centered_gamma else _rms_norm
        self.activation, self.embedding_scale = config.activation_func, shape.embedding_scale
        self.attn_softcap, self.logit_softcap = shape.attn_softcap, shape.logit_softcap
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.groups, self.per_group = config.num_query_groups // self.tp, config.num_attention_heads // config.num_query_groups
        self.head_dim, self.dtype = config.kv_channels, config.params_dtype
        self.scale = config.softmax_scale or self.head_dim**-0.5
        self.top_k, self.pre_softmax = config.moe_router_topk, config.moe_router_pre_softmax
        self.ep = parallel_state.get_expert_model_parallel_world_size() if config.num_moe_experts else 1
        self.ep_group = parallel_state.get_expert_model_parallel_group() if self.ep > 1 else None
        self.first_expert = parallel_state.get_expert_model_parallel_rank() * (config.num_moe_experts or 0) // self.ep
        self.ep_counts: list[int] = []  # tokens of each EP rank in a forward: read at prefill and at the first decode step
        self.layers = [layer_weights(layer) for layer in model.decoder.layers]
        self.embedding = model.embedding.word_embeddings if model.pre_process else None
        if model.post_process:
            self.final_norm = model.decoder.final_layernorm.weight
            self.output = output_weight(model)  # a reward model's scalar head too: `LeanForward` gives its scores
        cache = (len(pad), self.groups, max_length, self.head_dim)
        self.keys = [torch.empty(cache, dtype=self.dtype, device=device) for _ in self.layers]
        self.values = [torch.empty(cache, dtype=self.dtype, device=device) for _ in self.layers]
        rope = model.rotary_pos_emb
        ropes = [rope, rope.local] if isinstance(rope, LayerTypeRotaryEmbedding) else [rope]  # LayerWeights.rope indexes them
        angles = [r.get_emb(max_length)[:, 0, 0].to(device) for r in ropes]  # [max_length, head_dim], fp32
        scale = shape.rope_attention_factor  # longrope's, on cos and sin in fp32 as HF's
        self.cos_tables = [(a.cos() * scale).to(self.dtype) for a in angles]
        self.sin_tables = [(_signed_sin(a) * scale).to(self.dtype) for a in angles]
        self.rotary_dim = angles[0].shape[-1]  # the first dims of each head, all of it unless partial
        pads = torch.tensor(pad, dtype=torch.long, device=device)
        self.ropes = self._rope(pads, max_length)  # (cos, sin) [b, max_length, 1, 1, d] per row, per RoPE
        padding = (torch.arange(max_length, device=device) < pads[:, None])[:, None, None]  # [b, 1, 1, L]
        self.padding_bias = (
            torch.zeros(padding.shape, dtype=self.dtype, device=device).masked_fill(padding, float("-inf")) if any(pad) else None
        )  # added to the scores of decode steps
        self.length, self.prompt_length, self.device = 0, 0, device
        self.router_logits: Optional[list[Tensor]] = None  # each MoE layer's, where a `LeanForward` keeps them

    def prefill(self, prompts: Tensor, pad: list[int], rows: Tensor) -> Optional[Tensor]:
        """Run the distinct prompts [u, s] (left-padded by `pad` [u]) and cache prompt rows[i] in
        row i of the batch; the logits [b, vocab] of each batch row's last prompt token."""
        u, s = prompts.shape
        self._exchange_counts(u * s)
        ropes = self._rope(torch.tensor(pad, dtype=torch.long, device=prompts.device), s)
        cu_seqlens = _padded_rows(pad, s)
        documents = Documents.of(torch.tensor(cu_seqlens, dtype=torch.int32, device=prompts.device), s, s, cu_seqlens)

        def attend(i: int, w: LayerWeights, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            self.keys[i][:, :, :s] = k[rows].transpose(1, 2)
            self.values[i][:, :, :s] = v[rows].transpose(1, 2)
            g, d = self.groups, self.head_dim
            out = packed_attention(
                q.reshape(u * s, g * self.per_group, d),
                k.reshape(u * s, g, d),
                v.reshape(u * s, g, d),
                documents,
                w.window_size,
                self.scale,
                softcap=self.attn_softcap,
            )
            return out.view(u, s, -1)

        logits = self._forward(prompts, ropes, attend)
        self.length = self.prompt_length = s
        return None if logits is None else logits[rows]

    def decode(self, tokens: Tensor) -> Optional[Tensor]:
        """Run one new token per row [b] at the next position."""
        t, b = self.length, len(tokens)
        if self.length == self.prompt_length:  # the first step: b rows a step from now on
            self._exchange_counts(b)

        def attend(i: int, w: LayerWeights, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # The heads of a query group as the rows of one product with the group's keys: no
            # repeated keys, and at one query position a plain matmul beats SDPA's kernel.
            low = 0 if w.window_size is None else max(0, t - w.window_size[0])  # keys t - j <= left
            keys, values = self.keys[i], self.values[i]
            keys[:, :, t] = k[:, 0]
            values[:, :, t] = v[:, 0]
            scores = torch.matmul(q[:, 0], keys[:, :, low : t + 1].transpose(-1, -2)) * self.scale  # [b, g, per, keys]
            if self.attn_softcap is not None:
                scores = softcap(scores, self.attn_softcap)
            if self.padding_bias is not None:
                scores = scores + self.padding_bias[:, :, :, low : t + 1]
            probs = scores.softmax(-1, dtype=torch.float32).to(values.dtype)  # fp32 softmax, as Megatron and HF
            return torch.matmul(probs, values[:, :, low : t + 1]).view(b, 1, -1)

        logits = self._forward(tokens[:, None], [(cos[:, t : t + 1], sin[:, t : t + 1]) for cos, sin in self.ropes], attend)
        self.length = t + 1
        return logits

    def _exchange_counts(self, tokens: int) -> None:
        """Every EP rank's number of tokens per forward (a host read: once per prefill and once per batch's decode steps)."""
        if self.ep > 1:
            counts = torch.empty(self.ep, dtype=torch.long, device=self.device)
            dist.all_gather_into_tensor(counts, torch.tensor([tokens], device=self.device), group=self.ep_group)
            self.ep_counts = counts.tolist()

    def _rope(self, pad: Tensor, length: int) -> list[tuple[Tensor, Tensor]]:
        return self.rope_at((torch.arange(length, device=pad.device) - pad[:, None]).clamp(min=0))

    def rope_at(self, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(cos, sin) [b, s, 1, 1, d] at `positions` [b, s], of each RoPE."""
        return [(cos[positions][:, :, None, None], sin[positions][:, :, None, None]) for cos, sin in zip(self.cos_tables, self.sin_tables)]

    def _forward(self, tokens: Tensor, ropes: list, attend: Callable) -> Optional[Tensor]:
        x = self._embed(tokens) if self.embedding is not None else self._receive(tokens.shape)
        for i, weights in enumerate(self.layers):
            x = self._layer(x, i, weights, ropes, attend)
        if not self.model.post_process:
            dist.send(x.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        return self._logits(x[:, -1])

    def _layer(self, x: Tensor, i: int, w: LayerWeights, ropes: list, attend: Callable) -> Tensor:
        b, s, _ = x.shape
        g, per, d, r = self.groups, self.per_group, self.head_dim, self.rotary_dim
        qkv = F.linear(self._normed(x, w.norm1), w.qkv, w.qkv_bias).view(b, s, g, per + 2, d)
        qk = qkv[..., : per + 1, :]  # each group's queries and key, rotated together
        if w.q_norm is not None:
            qk = torch.cat(
                [self._qk_norm(qk[..., :per, :], w.q_norm, w.qk_norm_whole), self._qk_norm(qk[..., per:, :], w.k_norm, w.qk_norm_whole)], -2
            )
        cos, sin = ropes[w.rope]
        rotated = qk[..., :r] * cos + qk[..., :r].roll(r // 2, -1) * sin  # x cos + rotate_half(x) sin
        qk = rotated if r == d else torch.cat([rotated, qk[..., r:]], -1)
        out = attend(i, w, qk[..., :per, :], qk[..., per, :], qkv[..., per + 1, :])  # [b, s, heads * d]
        x = x + self._normed(_biased(self._reduce(F.linear(out, w.proj)), w.proj_bias), w.post_attention_norm)
        h = self._normed(x, w.norm2)
        if w.router is not None:
            return x + self._reduce(self._experts(h, w))
        gate, up = F.linear(h, w.fc1, w.fc1_bias).chunk(2, -1)
        return x + self._normed(_biased(self._reduce(F.linear(self.activation(gate) * up, w.fc2)), w.fc2_bias), w.post_mlp_norm)

    def _normed(self, x: Tensor, weight: Optional[Tensor]) -> Tensor:
        """x through a norm of the layer, or x itself where the layer has none there."""
        return x if weight is None else self.norm(x, weight, self.eps)

    def _qk_norm(self, heads: Tensor, weight: Tensor, whole: bool) -> Tensor:
        """RMSNorm of q's heads [b, s, g, per, d] (k's [b, s, g, 1, d]) per head, or `whole`
        over all heads of the token (every TP rank's: `ProjectionRMSNorm`)."""
        if not whole:
            return self.norm(heads, weight, self.eps)
        flat = heads.flatten(-3)  # this rank's heads in order: its share of the q (k) projection
        squares = self._reduce(flat.float().square().sum(-1, keepdim=True))
        normed = flat.float() * torch.rsqrt(squares / (flat.shape[-1] * self.tp) + self.eps)
        return (weight * normed).to(heads.dtype).view(heads.shape)

    def _experts(self, h: Tensor, w: LayerWeights) -> Tensor:
        """A MoE layer before the TP reduction: Megatron's router (top-k of the softmax; with
        pre-softmax off, the softmax over the top-k logits, i.e. renormalized), then each expert
        on its tokens, its output scaled by their probabilities and summed per token. Under EP
        on the whole group's tokens with this rank's experts, summed back to each token's rank."""
        mine = h.reshape(-1, h.shape[-1])
        flat = self._group_tokens(mine) if self.ep > 1 else mine
        logits = F.linear(flat, w.router)
        if self.router_logits is not None:
            self.router_logits.append(logits)
        if self.pre_softmax:
            probs, chosen = torch.softmax(logits, -1, dtype=torch.float32).type_as(logits).topk(self.top_k, -1)
        else:
            top, chosen = logits.topk(self.top_k, -1)
            probs = torch.softmax(top, -1, dtype=torch.float32).type_as(logits)
        out = torch.zeros_like(flat)
        # (token, slot) pairs grouped by expert, in the order nonzero() would give them, with one
        # host read of the counts per layer (not one per expert: each is a GPU sync)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.first_expert + len(w.experts))
        starts, counts = torch.stack([counts.cumsum(0) - counts, counts])[:, self.first_expert :].tolist()
        for (fc1, fc2), start, count in zip(w.experts, starts, counts):
            if count:
                picked = order[start : start + count]
                rows, slot = picked // self.top_k, picked % self.top_k
                gate, up = F.linear(flat[rows], fc1).chunk(2, -1)
                out = out.index_add(0, rows, F.linear(F.silu(gate) * up * probs[rows, slot, None], fc2))
        return (self._own_tokens(out, len(mine)) if self.ep > 1 else out).view(h.shape)

    def _group_tokens(self, mine: Tensor) -> Tensor:
        """Every EP rank's tokens [sum of counts, h], in rank order: gathered padded to the
        largest count, the padding dropped."""
        most = max(self.ep_counts)
        gathered = mine.new_empty(self.ep * most, mine.shape[-1])
        dist.all_gather_into_tensor(gathered, F.pad(mine, (0, 0, 0, most - len(mine))), group=self.ep_group)
        return gathered.view(self.ep, most, -1)[self._real(most)]

    def _own_tokens(self, out: Tensor, n: int) -> Tensor:
        """This rank's rows [n, h] of the group's partial sums `out` (this rank's experts), summed over the EP ranks."""
        most = max(self.ep_counts)
        padded = out.new_zeros(self.ep, most, out.shape[-1])
        padded[self._real(most)] = out
        summed = out.new_empty(most, out.shape[-1])
        dist.reduce_scatter_tensor(summed, padded.view(self.ep * most, -1), group=self.ep_group)
        return summed[:n]

    def _real(self, most: int) -> Tensor:
        """[ep, most] True at each rank's real tokens."""
        return torch.arange(most, device=self.device) < torch.tensor(self.ep_counts, device=self.device)[:, None]

    def _embed(self, tokens: Tensor) -> Tensor:
        embedding = self.embedding  # vocab-parallel: this rank's rows of the padded vocab
        if self.tp == 1:
            x = F.embedding(tokens, embedding.weight)
        else:
            local = tokens - embedding.vocab_start_index
            outside = (local < 0) | (local >= embedding.weight.shape[0])
            x = self._reduce(F.embedding(local.masked_fill(outside, 0), embedding.weight).masked_fill(outside[..., None], 0))
        return x * embedding_scale(self.hidden, x) if self.embedding_scale else x

    def _receive(self, shape: torch.Size) -> Tensor:
        hidden = torch.empty(*shape, self.hidden, dtype=self.model.config.pipeline_dtype, device=self.device)
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        return hidden

    def head(self, x: Tensor) -> Tensor:
        """The output layer's logits (this rank's vocab rows) of final hidden states."""
        logits = F.linear(self.norm(x, self.final_norm, self.eps), self.output)
        return logits if self.logit_softcap is None else softcap(logits, self.logit_softcap)

    def _logits(self, last: Tensor) -> Tensor:
        logits = self.head(last)
        if self.tp == 1:
            return logits
        gathered = torch.empty(self.tp * logits.shape[0], logits.shape[1], dtype=logits.dtype, device=logits.device)
        dist.all_gather_into_tensor(gathered, logits.contiguous(), group=self.tp_group)
        return gathered.view(self.tp, *logits.shape).transpose(0, 1).reshape(logits.shape[0], -1)

    def _reduce(self, partial: Tensor) -> Tensor:
        if self.tp > 1:
            dist.all_reduce(partial, group=self.tp_group)
        return partial


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _biased(reduced: Tensor, bias: Optional[Tensor]) -> Tensor:
    return reduced if bias is None else reduced + bias


def _padded_rows(pad: list[int], length: int) -> list[int]:
    """cu_seqlens of left-padded rows of `length` flattened: each row's padding (where it has
    some) is a document of its own, then its tokens."""
    starts = [start for i, p in enumerate(pad) for start in ((i * length, i * length + p) if p else (i * length,))]
    return starts + [len(pad) * length]


def _signed_sin(angles: Tensor) -> Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(d / 2) * signed sin."""
    half = angles.shape[-1] // 2
    return torch.cat([-angles[..., :half].sin(), angles[..., half:].sin()], dim=-1)


class LeanForward:
    """Whole sequences through the model, no cache: GPTModel's forward, called as it is
    (`token_nll`, `logits_forward`: logits [b, s, padded vocab], a reward model's (`ScoreModel`)
    scores [b, s, 1]), with `Decoder`'s weights and
    layer math, ~20 torch ops a layer where Megatron's modules make ~80 calls and their own
    autograd functions. On the demo's 158k-parameter model that overhead was most of a
    reference pass (2.6x faster here) and of a DPO step (1.6x). Attention is
    `DocumentWindowAttention`'s (`packed_attention`): per document given `Documents`, else
    each row one document. RoPE at `position_ids` (restarting per document): the same scores
    as Megatron's row positions, RoPE being relative.

    `LeanForward.of` builds one only where it computes what Megatron's forward would, the
    gradients included (autograd through the same parameters; Megatron's DDP takes them from
    their accumulation hooks as before): one rank of TP, PP, CP and EP (DP any; its EP
    collectives carry no gradients), the local spec (TE's
    batches are THD), fp32 weights (in bf16 the two differ in rounding), no dropout, and with
    gradients no activation recompute; not where Megatron's DDP gathers weights in forward
    hooks (overlapped parameter gathers). Elsewhere None: Megatron's forward runs. A MoE model
    whose config sets output_router_logits keeps each layer's router logits of the call
    (`router_logits`), as `RecordingRouter`s do on Megatron's forward."""

    post_process = True

    def __init__(self, model, max_length: int):
        self.decoder = Decoder(model, [], max_length)
        self.records_routing = model.hf_shape.moe_aux_loss_coef != 0  # as `RecordingRouter`s do

    @classmethod
    def of(cls, chunks: list, max_length: int) -> Optional["LeanForward"]:
        model, ddp = unwrap_model(chunks[0]), getattr(chunks[0], "ddp_config", None)
        config = model.config
        one_rank = all(
            size() == 1
            for size in (
                parallel_state.get_tensor_model_parallel_world_size,
                parallel_state.get_pipeline_model_parallel_world_size,
                parallel_state.get_context_parallel_world_size,
                parallel_state.get_expert_model_parallel_world_size,
            )
        )
        dropout = model.training and (
            config.attention_dropout > 0 or config.hidden_dropout > 0 or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
        )  # LoRA's too
        recompute = torch.is_grad_enabled() and config.recompute_granularity is not None
        hooked_weights = ddp is not None and ddp.overlap_param_gather
        if (
            len(chunks) > 1
            or not one_rank
            or packed_thd()
            or config.params_dtype != torch.float32
            or dropout
            or recompute
            or hooked_weights
            or unsupported(model)
        ):
            return None
        return cls(model, max_length)

    def __call__(
        self,
        tokens: Tensor,
        position_ids: Tensor,
        attention_mask: Optional[Tensor],
        labels: Optional[Tensor] = None,
        packed_seq_params: Optional[Documents] = None,
    ) -> Tensor:
        if attention_mask is not None:
            raise ValueError("LeanForward takes documents (packed_seq_params), not a mask")
        d = self.decoder
        b, s = tokens.shape
        documents = packed_seq_params if packed_seq_params is not None else Documents.rows(b, s, tokens.device)

        def attend(i: int, w: LayerWeights, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [b, s, groups, per group, d], k, v [b, s, groups, d]
            g, dim = d.groups, d.head_dim
            out = packed_attention(
                q.reshape(b * s, g * d.per_group, dim),
                k.reshape(b * s, g, dim),
                v.reshape(b * s, g, dim),
                documents,
                w.window_size,
                d.scale,
                softcap=d.attn_softcap,
            )
            return out.view(b, s, -1)

        ropes = d.rope_at(position_ids)
        d.router_logits = [] if self.records_routing else None
        # With gradients, a LoRA layer's merged weight is computed again for each micro batch:
        # each backward frees the graph it was computed in.
        layers = [layer_weights(layer) for layer in d.model.decoder.layers] if torch.is_grad_enabled() else d.layers
        x = d._embed(tokens)
        for i, weights in enumerate(layers):
            x = d._layer(x, i, weights, ropes, attend)
        return mask_padded(d.head(x), d.model.real_vocab_size)


def router_logits(model) -> list[Tensor]:
    """Each MoE layer's router logits [tokens, experts] of the last forward through `model` (a
    `LeanForward`, or a GPTModel chunk, DDP-wrapped or not, with `RecordingRouter`s), tokens in
    the order of the micro batch's [rows, length] positions, with their graph."""
    if isinstance(model, LeanForward):
        return model.decoder.router_logits
    return [layer.mlp.router.logits for layer in unwrap_model(model).decoder.layers]
