"""Build a Megatron-Core GPTModel from an HF Llama-family config; move states in and out of it.

Supported: what `alignflow.job.convert.families` supports (Llama, Mistral, Qwen2, Qwen3: GQA,
tied or untied embeddings, qkv / attention output / MLP biases, per-head q/k RMSNorm, SwiGLU,
RoPE with linear or llama3 scaling, Mistral's sliding window; Gemma 2 / 3 with the pieces of
`alignflow.job.model.gemma` and per-layer windows; OLMo 2's post-norm layers and
whole-projection q/k norms, `PostNormTransformerLayer` and `ProjectionRMSNorm`, pieces
Megatron-Core lacks; Phi-3's partial rotary and longrope, `LongRoPE` and `RotaryScale` (its
attention factor on the rotated dims of q and k only, Phi-4-mini's too); Mixtral and Qwen3-MoE:
Megatron's MoELayer, a softmax top-k router as HF's (`moe_settings`; `RecordingRouter` keeps
its logits for HF's load-balancing loss), no token dropping), under
TP, PP (with virtual chunks), EP for the experts and, with Transformer Engine, CP (not with
attention soft-capping: its attention is ours).
Layer spec: Transformer Engine's where it is importable (GPU clusters), else Megatron's local
modules (CPU, with `cpu_shim`). Fusions stay at Megatron's defaults (off).

Packed rows (several documents per row) never attend across documents (`document_params`):
with Transformer Engine they run as THD packed sequences (cu_seqlens per document, no mask,
RoPE restarting per document); on the local spec each document attends on its own, narrowed
by a sliding window (Mistral), through a fused kernel (`DocumentWindowAttention`, which is
`alignflow.job.model.attention.packed_attention`: cost sum(document^2), no rows x s x s mask).

The two specs name the norms differently in `state_dict()` (local: `input_layernorm.weight`;
TE and every checkpoint: `self_attention.linear_qkv.layer_norm_weight`), so states enter and
leave a model under checkpoint names (`load_megatron_state`, `megatron_state`), the names
`alignflow.job.convert` produces.
"""

from contextlib import nullcontext
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_attr_wrapped_model
from torch import Tensor
from torch.distributed.nn.functional import all_reduce

from alignflow.job.convert.families import ModelShape, model_shape
from alignflow.job.convert.sharding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size, stage_ends
from alignflow.job.device import device
from alignflow.job.model import gemma
from alignflow.job.model.attention import Documents, packed_attention
from alignflow.job.model.runtime import parallel_sizes
from alignflow.job.model.vocab_parallel import masking_hook

# Megatron-Core 0.16.1's router gating tests `te_general_gemm is not None` but defines the name only
# when Transformer Engine imports: without TE (the CPU) the MoE router raises NameError. None is
# what it means: TE's GEMM is absent, torch's runs.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

# TransformerConfig settings where CUDA is absent.
CPU_SETTINGS = {
    "batch_p2p_sync": False,  # it calls torch.cuda.synchronize
    # On gloo, the interleaved (virtual PP) schedule's batched isend/irecv pairs activations and
    # gradients of the same shape in the wrong order; one op at a time in Megatron's fixed
    # even/odd order is exact.
    "batch_p2p_comm": False,
}


# TransformerConfig settings of a MoE model, given its shape: HF's router. Top-k of the
# softmax; renormalized over the top k (norm_topk_prob, Mixtral) is Megatron's softmax over the
# top-k logits, else the softmax over all experts before the top-k (pre-softmax). No capacity,
# so no token is dropped. Megatron's load-balancing loss stays off: HF's (with
# output_router_logits) is computed over all layers' routing of a micro batch together, unlike
# Megatron's per layer; the training objective adds it from the logits `RecordingRouter` keeps
# (`alignflow.job.losses.load_balancing`). The alltoall dispatcher runs on gloo (CPU) as on NCCL.
def moe_settings(shape: ModelShape, ep_size: int) -> dict[str, Any]:
    if not shape.moe:
        return {"moe_token_dispatcher_type": "alltoall"}  # variable_seq_lengths refuses the default even without experts
    return {
        "num_moe_experts": shape.num_experts,
        "moe_router_topk": shape.moe_top_k,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_router_pre_softmax": not shape.moe_norm_topk,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": packed_thd(),  # TEGroupedMLP with Transformer Engine, SequentialMLP on the local spec
        "expert_model_parallel_size": ep_size,
    }


class RecordingRouter(TopKRouter):
    """Megatron's router that keeps the router logits of its last forward (`logits`, [tokens,
    experts] in the order of the micro batch's [rows, length] positions, with their graph), for
    HF's load-balancing loss over all layers (`alignflow.job.losses.load_balancing`). Built where
    the model's config sets output_router_logits (`layer_spec`)."""

    logits: Optional[Tensor] = None

    def gating(self, input: Tensor) -> Tensor:
        logits = super().gating(input)  # [s, b, experts]; THD: [b * s, 1, experts]
        self.logits = logits.transpose(0, 1).reshape(-1, logits.shape[-1])
        return logits


# HF rope type -> GPTModel arguments, given the HF scaling factor (llama3: see `_llama3_rope`).
ROPE_ARGS = {
    "default": lambda factor: {},
    "linear": lambda factor: {"seq_len_interpolation_factor": factor},
    "llama3": lambda factor: {},
    "longrope": lambda factor: {},  # see `LongRoPE`
}


def transformer_config(shape: ModelShape, parallel_cfg: Any, *, params_dtype: torch.dtype = torch.float32, **overrides) -> TransformerConfig:
    """Megatron's TransformerConfig for an HF model shape; `overrides` (dropout, recompute...) win."""
    par = parallel_sizes(parallel_cfg)
    settings = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=shape.gemma_norms,  # TE's norms read it; the local spec's are GemmaRMSNorm
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=gemma.gelu_tanh if shape.gemma_norms else F.silu,
        add_bias_linear=False,  # the attention output's and the MLP's biases: `layer_spec`
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        window_size=None if shape.sliding_window is None else (shape.sliding_window - 1, 0),  # HF: i - j < window
        window_attn_skip_freq=[int(w) for w in shape.window_layers] or None,  # 1: the layer has the window
        softmax_scale=shape.softmax_scale,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par["tensor_model_parallel_size"],
        pipeline_model_parallel_size=par["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=par["virtual_pipeline_model_parallel_size"],
        context_parallel_size=par["context_parallel_size"],
        sequence_parallel=par["sequence_parallel"],
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        # Micro batches may differ in shape (packed preference pairs): stages exchange shapes first
        # (Megatron refuses it beside its default MoE dispatcher, though this model has no experts).
        variable_seq_lengths=par["pipeline_model_parallel_size"] > 1,
        **moe_settings(shape, par["expert_model_parallel_size"]),
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # On the CPU the weights are built from the full weight (TP ranks agree); elsewhere on the rank's device.
        use_cpu_initialization=device().type == "cpu",
        **({} if torch.cuda.is_available() else CPU_SETTINGS),
    )
    return TransformerConfig(**{**settings, **overrides})


class DocumentWindowAttention(DotProductAttention):
    """Megatron's local core attention as `packed_attention`: each document of a packed row
    (`Documents`; without them each row is one document) attends causally within itself,
    narrowed by the sliding window, in a fused kernel, with gradients and without. Attention
    dropout is the kernel's, drawn from Megatron's model-parallel RNG state as Megatron's own
    dropout is, so activation recompute and resumes draw the same masks.

    Megatron's own path (scores, softmax, dropout, a mask) never runs: its softmax would swap
    a given mask for the window mask, so the documents of a packed row saw each other, and
    its mask costs rows x s x s.

    Per layer: the window where the layer has one (`window_attn_skip_freq`, Gemma), and the
    scores soft-capped by `softcap` (Gemma 2: `layer_spec` sets it). Under Transformer Engine
    (soft-capped models only) the documents come as THD sequences [t, heads, dim]."""

    softcap: Optional[float] = None

    def __init__(self, config: TransformerConfig, layer_number: int, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.window_size = config.window_size if gemma.is_window_layer(config, self.layer_number) else None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        *args,
        packed_seq_params: Optional[PackedSeqParams] = None,
        **kwargs,
    ):
        """[s, b, heads (query groups for key, value), dim] -> [s, b, heads * dim]."""
        if attention_mask is not None:
            raise ValueError("DocumentWindowAttention takes documents (packed_seq_params), not a mask")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":  # TE's batches: [t, heads, dim]
            documents = Documents.of(packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q, query.shape[0])
            return self._attend(query, key, value, documents).flatten(1)
        s, b, heads, dim = query.shape
        documents = packed_seq_params if packed_seq_params is not None else Documents.rows(b, s, query.device)
        flat = [t.transpose(0, 1).reshape(b * s, t.shape[2], dim) for t in (query, key, value)]
        return self._attend(*flat, documents).view(b, s, heads * dim).transpose(0, 1)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, documents: Documents) -> Tensor:
        dropout = self.attention_dropout.p if self.training else 0.0
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 and not self.config.sequence_parallel else nullcontext()
        with rng:
            return packed_attention(q, k, v, documents, self.window_size, self.softmax_scale, dropout, self.softcap)


class ProjectionRMSNorm(torch.nn.Module):
    """OLMo 2's q/k norm: RMSNorm over the whole projection (all heads of q, or of k, at once),
    where Megatron's `q_layernorm` normalizes each head. Under TP a rank holds its heads and
    their slice of the weight (TP-sharded on dim 0, like the heads); the sum of squares is
    all-reduced over the TP group (its gradient too: each rank's heads depend on it), so any TP
    computes TP1's. Built by Megatron's SelfAttention in place of `q_layernorm` / `k_layernorm`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, heads: str):
        super().__init__()
        total = config.num_attention_heads if heads == "query" else config.num_query_groups
        self.width, self.eps, self.tp = total * config.kv_channels, eps, config.tensor_model_parallel_size
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp, dtype=config.params_dtype, device=device()))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: Tensor) -> Tensor:
        """[s, b, this rank's heads, head dim], normalized over every rank's heads of the token."""
        squares = x.float().square().sum((-2, -1), keepdim=True)
        if self.tp > 1:
            squares = all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        normed = x.float() * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight.view(x.shape[-2:]) * normed).to(x.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """The weight as one global tensor, TP-sharded on dim 0."""
        groups = (
            {"tp_group": parallel_state.get_tensor_model_parallel_group(), "dp_cp_group": metadata["dp_cp_group"]}
            if metadata and "dp_cp_group" in metadata
            else {}
        )  # Megatron's defaults take both or neither
        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix, {"weight": 0}, sharded_offsets, **groups)


class PostNormTransformerLayer(TransformerLayer):
    """OLMo 2's layer: no norm before attention or the MLP; RMSNorm on each one's output (its
    bias added) before the residual add: h = x + norm(attention(x)); out = h + norm(mlp(h)).
    Megatron-Core has no such layer: here its bias-dropout-adds get the normed outputs, so its
    forward (recompute, PP, TP's reductions) runs unchanged. The spec leaves the input norms out
    (`layer_spec`); `post_norm` is the norm class (the spec's own)."""

    def __init__(self, config: TransformerConfig, submodules, *args, post_norm: type, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        built = [build_module(post_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon) for _ in range(2)]
        self.post_self_attn_layernorm, self.post_mlp_layernorm = built
        self.self_attn_bda = _normed_first(self.self_attn_bda, self.post_self_attn_layernorm)
        self.mlp_bda = _normed_first(self.mlp_bda, self.post_mlp_layernorm)


def _normed_first(bda: Callable, norm: torch.nn.Module) -> Callable:
    """A Megatron bias-dropout-add factory whose add takes norm(output + bias)."""

    def factory(training: bool, fused: bool) -> Callable:
        add = bda(training, fused)

        def normed_add(output_with_bias: tuple, residual: Tensor, prob: float) -> Tensor:
            output, bias = output_with_bias
            return add((norm(output if bias is None else output + bias), None), residual, prob)

        return normed_add

    return factory


def token_nll(model, tokens: Tensor, position_ids: Tensor, attention_mask: Optional[Tensor], labels: Tensor, **kwargs) -> Tensor:
    """Per-token cross entropy [b, s] from a GPTModel chunk on the last pipeline stage (its
    hidden states elsewhere; the logits when `labels` is None), over the real vocab (the output
    layer masks the padded rows). At TP=1 torch's fused cross_entropy on the logits: Megatron's
    vocab-parallel cross entropy gives the same numbers through a custom autograd function of
    a dozen small ops, which on small models costs as much as the layers (a quarter of a
    reference pass). Under TP the vocabulary is split over ranks: Megatron's."""
    if labels is None or parallel_state.get_tensor_model_parallel_world_size() > 1:  # no labels: the logits
        return model(tokens, position_ids, attention_mask, labels=labels, **kwargs)
    out = model(tokens, position_ids, attention_mask, **kwargs)
    if not get_attr_wrapped_model(model, "post_process"):
        return out
    return F.cross_entropy(out.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


def packed_thd() -> bool:
    """Whether packed rows run as THD sequences (Transformer Engine's attention), else with a mask."""
    return gpt_layer_specs.HAVE_TE


def document_params(batch: dict) -> PackedSeqParams:
    """Where the documents of a batch of packed rows lie (`cu_seqlens` of the flattened rows):
    THD sequences for Transformer Engine's attention (the batch runs as one row [1, b * s]),
    else the same offsets on the [s, b] layout for `packed_attention` (`Documents`)."""
    cu_seqlens = batch["cu_seqlens"].to(torch.int32)
    if packed_thd():
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"]
        )
    return Documents.of(cu_seqlens, batch["max_seqlen"], batch["tokens"].shape[1])


def layer_spec(shape: ModelShape) -> ModuleSpec:
    """Transformer Engine's fused layers where importable (GPU clusters), else Megatron's own;
    the attention output and the MLP biased as the HF model is (Megatron's `add_bias_linear`
    sets both together, HF's attention_bias and mlp_bias apart); Gemma's pieces where the
    shape has them (see `alignflow.job.model.gemma`). MoE layers: TEGroupedMLP experts with TE,
    SequentialMLP on the local spec; both store the experts under one checkpoint key, and the
    pre-MLP norm under `pre_mlp_layernorm` (TE's MoE spec keeps it apart from fc1; the local
    spec would save it under fc1's name); with HF's load-balancing loss, `RecordingRouter`s."""
    experts = dict(num_experts=shape.num_experts or None, moe_grouped_gemm=shape.moe and packed_thd())
    if packed_thd():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm, **experts)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm", **experts)
        spec.submodules.self_attention.submodules.core_attention = DocumentWindowAttention
        if shape.moe:
            spec.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.")
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    if shape.moe_aux_loss_coef:
        mlp.router = RecordingRouter
    attention.linear_proj = _biased(attention.linear_proj, shape.proj_bias)
    if shape.dense:
        mlp.linear_fc1, mlp.linear_fc2 = _biased(mlp.linear_fc1, shape.mlp_bias), _biased(mlp.linear_fc2, shape.mlp_bias)
    if shape.attn_softcap is not None:  # neither TE's attention nor SDPA soft-caps: ours, THD batches included
        attention.core_attention = type("SoftcappedAttention", (DocumentWindowAttention,), {"softcap": shape.attn_softcap})
    if shape.local_rope_theta is not None:
        spec.submodules.self_attention.module = gemma.LayerRopeSelfAttention
    if shape.gemma_norms:
        _gemma_norms(spec, shape)
    if shape.qk_norm_whole:
        attention.q_layernorm = ModuleSpec(module=ProjectionRMSNorm, params={"heads": "query"})
        attention.k_layernorm = ModuleSpec(module=ProjectionRMSNorm, params={"heads": "key"})
    if shape.rope_attention_factor != 1.0:  # longrope (Phi-3 has no q/k norms to share the slot with)
        attention.q_layernorm = attention.k_layernorm = ModuleSpec(
            module=RotaryScale, params={"factor": shape.rope_attention_factor, "rotary_dim": shape.rotary_dim}
        )
    return _post_norm(spec) if shape.post_norm else spec


def _gemma_norms(spec: ModuleSpec, shape: ModelShape) -> None:
    """x * (1 + w) norms (the local spec's own: GemmaRMSNorm; TE's take the config's
    zero-centered gamma) and the sandwich's post-attention and post-MLP norms."""
    layer = spec.submodules
    attention, mlp = layer.self_attention.submodules, layer.mlp.submodules
    norm = gemma.GemmaRMSNorm
    if packed_thd():
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        layer.input_layernorm = layer.pre_mlp_layernorm = norm
        if shape.qk_norm:
            attention.q_layernorm = attention.k_layernorm = norm
    attention.linear_proj = gemma.post_normed(attention.linear_proj, norm)
    mlp.linear_fc2 = gemma.post_normed(mlp.linear_fc2, norm)


def block_spec(shape: ModelShape, config: TransformerConfig, vp_stage: Optional[int]) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """The decoder's spec: `layer_spec`, with Gemma's final norm on the local spec (Megatron
    builds the final norm of a layer spec with its default norm, torch's RMSNorm there)."""
    spec = layer_spec(shape)
    if not shape.gemma_norms or packed_thd():
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=gemma.GemmaRMSNorm)


def _post_norm(spec: ModuleSpec) -> ModuleSpec:
    """The spec as `PostNormTransformerLayer`s: its input norms (TE's fused into linear_qkv and
    linear_fc1) left out, its own norm class on the outputs."""
    layer, attention, mlp = spec.submodules, spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    if packed_thd():  # Transformer Engine: norms fused into the linears; never run on CPU CI
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        norm, attention.linear_qkv, mlp.linear_fc1 = TENorm, TEColumnParallelLinear, TEColumnParallelLinear
    else:
        norm = layer.input_layernorm
    layer.input_layernorm, layer.pre_mlp_layernorm = IdentityOp, IdentityOp
    return ModuleSpec(module=PostNormTransformerLayer, submodules=layer, params={"post_norm": norm})


def _biased(linear: type, bias: bool) -> type:
    """`linear` (a Megatron or TE parallel linear) built with a bias or without, whatever its caller asks."""
    if not bias:
        return linear

    def __init__(self, *args, **kwargs):
        linear.__init__(self, *args, **{**kwargs, "bias": True})

    return type(f"Biased{linear.__name__}", (linear,), {"__init__": __init__})


def _llama3_rope(model: GPTModel, shape: ModelShape) -> None:
    """Llama-3 scaling of the rotary frequencies with the HF config's constants (GPTModel's
    `rope_scaling` fixes low/high frequency factors 1/4 and 8192 original positions)."""
    rotary = model.rotary_pos_emb
    low, high, original = shape.rope_llama3
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=shape.rope_factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original
    )


class RotaryScale(torch.nn.Module):
    """Longrope's attention factor (Phi-3-*-128k, Phi-3.5-mini, Phi-4-mini): HF multiplies cos
    and sin by it, so RoPE's output, the first `rotary_dim` dims of each head of q and k; the
    dims RoPE passes through (a partial rotary factor) keep their scale, so it is not one
    softmax scale. Megatron-Core applies such a factor only as YaRN's `mscale`, derived from
    YaRN's own config fields. RoPE being linear, scaling the rotated dims before it is the
    same product: built by Megatron's SelfAttention in the q/k norm slot, which it applies to
    q and k right before RoPE (TE and THD batches alike); no weights."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, factor: float, rotary_dim: int):
        super().__init__()
        self.factor, self.rotary_dim = factor, rotary_dim

    def forward(self, x: Tensor) -> Tensor:
        """[..., head dim] -> the same, its first rotary_dim dims times the factor."""
        return torch.cat([x[..., : self.rotary_dim] * self.factor, x[..., self.rotary_dim :]], -1)


class LongRoPE(RotaryEmbedding):
    """HF's longrope where HF keeps its short factors: up to original_max_position_embeddings
    positions (its attention factor is `RotaryScale`'s). Past them HF switches the whole
    sequence to long_factor (and a KV-cached generation to a mix of both): refused, naming the
    lengths."""

    original_max: int

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        if max_seq_len + offset > self.original_max:
            raise ValueError(
                f"a sequence of {max_seq_len + offset} positions passes the longrope model's "
                f"original_max_position_embeddings={self.original_max}, past which HF switches to long_factor "
                "(not mapped); keep data.seq_length and prompt + generated tokens within it"
            )
        return super().get_emb(max_seq_len, offset)


def _longrope(model: GPTModel, shape: ModelShape) -> None:
    """The rotary frequencies as HF's longrope computes them with its short factors."""
    rotary = model.rotary_pos_emb
    dim = rotary.inv_freq.numel() * 2
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=rotary.inv_freq.device).float() / dim
    short = torch.tensor(shape.rope_short_factor, dtype=torch.float32, device=rotary.inv_freq.device)
    rotary.inv_freq = 1.0 / (short * shape.rope_theta**exponents)
    rotary.__class__, rotary.original_max = LongRoPE, shape.rope_original_max


# HF rope types whose frequencies are set after GPTModel builds its rotary embedding.
RESCALED_ROPE = {"llama3": _llama3_rope, "longrope": _longrope}


class ScoreModel(GPTModel):
    """A GPTModel whose last stage ends in a scalar head, `rm_head` (NeMo-Aligner's name), in
    place of the output layer: hidden -> 1 without a bias, as HF's ...ForSequenceClassification
    `score` (`alignflow.job.convert.families.SCORE_ARCHITECTURES`), so its output is every
    position's score [b, s, 1] (a reward model's; which position scores a sequence is the
    caller's: `alignflow.job.forward.objectives.sequence_scores`). The head is replicated over TP:
    every rank holds all of [1, hidden] and applies it to the whole hidden state, as it does
    the norms (so its gradient needs no reduction, and TP computes TP1's scores). A new head
    is drawn normal(0, initializer_range) (HF's and NeMo-Aligner's init) from its own generator
    seeded by `head_seed`: the same head at every layout. Not with sequence parallelism (each
    TP rank would score its share of the positions only)."""

    def __init__(self, *args, head_std: float, head_seed: int, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.sequence_parallel:
            raise NotImplementedError("a reward model's scalar head under sequence_parallel is not implemented: set it to false")
        if self.post_process:
            del self.output_layer
            self.rm_head = torch.nn.Linear(self.config.hidden_size, 1, bias=False, device="cpu")
            with torch.no_grad():
                self.rm_head.weight.normal_(0.0, head_std, generator=torch.Generator(device="cpu").manual_seed(head_seed))

    def _postprocess(self, hidden_states: Tensor, **_) -> Tensor:
        """[s, b, h] final hidden states -> scores [b, s, 1] (the hidden states on other stages)."""
        if not self.post_process:
            return hidden_states
        return self.rm_head(hidden_states).transpose(0, 1).contiguous()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        """Megatron's module default: GPTModel's and LanguageModule's own additions handle the output layer it has not."""
        return super(LanguageModule, self).sharded_state_dict(prefix, sharded_offsets, metadata)


def output_weight(model: GPTModel) -> Tensor:
    """The last stage's output matrix: the scalar head's [1, hidden], the output layer's or the tied embedding."""
    if isinstance(model, ScoreModel):
        return model.rm_head.weight
    return model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else model.output_layer.weight


def build_gpt(
    hf_config: Mapping[str, Any],
    parallel_cfg: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY,
    parallel_output: bool = True,
    head_seed: int = 0,
    **overrides,
) -> list[GPTModel]:
    """This rank's model chunks: one GPTModel (its pipeline stage), one per virtual stage with
    virtual PP (always a list, as Megatron-LM's `get_model`); `ScoreModel`s for a
    ...ForSequenceClassification config (a new head drawn with `head_seed`).

    Call after `runtime.init_parallel`. `parallel_output` keeps logits vocab-parallel (for
    Megatron's vocab-parallel cross entropy); pass `runtime_gather_output=True` to forward
    for full logits."""
    shape = model_shape(hf_config)
    config = transformer_config(shape, parallel_cfg, params_dtype=params_dtype, **overrides)
    vp_size = config.virtual_pipeline_model_parallel_size
    common = dict(
        config=config,
        vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by),
        max_sequence_length=shape.max_position_embeddings,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        rotary_percent=shape.rotary_percent,  # the first dims of each head, as HF's partial_rotary_factor
        **ROPE_ARGS[shape.rope_type](shape.rope_factor),
    )
    if shape.score_head:
        common |= {"head_std": shape.initializer_range, "head_seed": head_seed}
    return [_build_chunk(common, shape, vp_stage, vp_size) for vp_stage in (range(vp_size) if vp_size else [None])]


def _build_chunk(common: dict, shape: ModelShape, vp_stage: Optional[int], vp_size: Optional[int]) -> GPTModel:
    """One chunk; it keeps the HF shape it was built from (`hf_shape`: the lean forward reads
    what Megatron's modules do not say, Gemma's embedding scale and soft-caps). On the last
    stage its logits of the padded vocab rows are masked (-inf, after any soft-cap), so every
    log-prob and loss is over the real vocabulary, as HF's and generation's."""
    pre, post = stage_ends(
        parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size(), vp_stage, vp_size
    )
    model = (ScoreModel if shape.score_head else GPTModel)(
        pre_process=pre, post_process=post, vp_stage=vp_stage, transformer_layer_spec=block_spec(shape, common["config"], vp_stage), **common
    )
    model.hf_shape = shape
    gemma.install(model, shape)
    if shape.rope_type in RESCALED_ROPE:
        RESCALED_ROPE[shape.rope_type](model, shape)
    model.real_vocab_size = shape.vocab_size
    if post and not shape.score_head:
        model.output_layer.register_forward_hook(masking_hook(shape.vocab_size))
    # Every weight in params_dtype: the local spec builds its norms in fp32 whatever it says
    # (Megatron-LM's Float16Module casts them too; its optimizers expect one dtype).
    return model.to(device=device(), dtype=common["config"].params_dtype)


def checkpoint_names(model: GPTModel) -> dict[str, str]:
    """The model's state_dict keys -> checkpoint names, renamed by each layer's
    `sharded_state_dict_keys_map` exactly as Megatron's `sharded_state_dict` does.
    `_extra_state` entries (TE's fp8 metadata) are not weights and are left out."""
    prefix_map = {
        f"decoder.layers.{i}.{old}": f"decoder.layers.{i}.{new}"
        for i, layer in enumerate(model.decoder.layers)
        for old, new in layer.submodules_config.sharded_state_dict_keys_map.items()
    }
    return {key: _renamed(key, prefix_map) for key in model.state_dict() if not key.endswith("._extra_state")}


def _renamed(key: str, prefix_map: Mapping[str, str]) -> str:
    for old, new in prefix_map.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def load_megatron_state(model: GPTModel, state: Mapping[str, Tensor]) -> None:
    """Load a state under checkpoint names (e.g. from `hf_to_megatron`); every weight exactly once."""
    module_key = {ckpt: key for key, ckpt in checkpoint_names(model).items()}
    missing, unexpected = sorted(set(module_key) - set(state)), sorted(set(state) - set(module_key))
    if missing or unexpected:
        raise ValueError(f"state does not match the model: missing {missing}, unexpected {unexpected}")
    model.load_state_dict({module_key[name]: tensor for name, tensor in state.items()}, strict=False)


def megatron_state(model: GPTModel) -> dict[str, Tensor]:
    """The model's weights under checkpoint names (this rank's shards)."""
    state = model.state_dict()
    return {ckpt: state[key] for key, ckpt in checkpoint_names(model).items()}
