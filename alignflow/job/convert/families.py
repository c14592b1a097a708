"""The HF architectures alignflow converts and trains, as data: how each reads its config
(`ARCHITECTURES`), and one name table (`TABLE`) whose entries exist under shape flags.

Supported: LlamaForCausalLM (with attention / MLP biases, RoPE default, linear, or llama3
scaling with any constants), MistralForCausalLM (sliding window on all layers),
Qwen2ForCausalLM (qkv bias), Qwen3ForCausalLM (per-head q/k RMSNorm), Olmo2ForCausalLM
(post-norm layers, q/k RMSNorm over the whole projection, attention biases), Phi3ForCausalLM
(Phi-3 and Phi-4: HF's fused qkv_proj and gate_up_proj, partial rotary, sliding window,
longrope within its original positions, its attention factor on the rotated dims of q and k
only, so with partial rotary too: Phi-4-mini); GQA, tied or untied embeddings, RMSNorm,
SwiGLU. Gemma2ForCausalLM and Gemma3ForCausalLM: RMSNorm x * (1 + w) (weights stored as HF
holds them), sandwich norms, GeGLU (tanh), embeddings scaled by sqrt(hidden),
query_pre_attn_scalar, attention and final logit soft-capping, sliding-window layers by
`layer_types`, Gemma 3's per-head q/k norms and its own RoPE base on sliding layers.
The mixture-of-experts MixtralForCausalLM and Qwen3MoeForCausalLM: a softmax top-k router,
renormalized over the top k or not as `norm_topk_prob` says, SwiGLU experts, every layer sparse.
Refused with a ValueError that says why: any other architecture (Gemma3ForConditionalGeneration
by name) or activation, other rope types, a partial rotary factor outside Phi-3, longrope past
its original positions (HF switches to its long factors there; `alignflow.orchestrator.config.validate` and
`alignflow.job.model.gpt.LongRoPE` refuse it) or with short factors that do not match the
rotary dims, Qwen2/Qwen3 per-layer sliding windows, Gemma's attention biases and bidirectional
attention, Qwen3-MoE dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`),
Mixtral's router jitter. Each would otherwise convert into a different model.

Megatron names are the ones Megatron-Core checkpoints hold: Transformer Engine's names
(`self_attention.linear_qkv.layer_norm_weight`, ...) whatever the layer spec;
`alignflow.job.model.gpt` maps them onto a local-spec module. `{layer}` is the layer number:
global on the HF side, local to a pipeline stage on the Megatron side; `{expert}` the expert
number: global on the HF side, local to an expert-parallel rank on the Megatron side (the
local spec's `local_experts.{expert}`; a checkpoint stacks experts on an axis after the
layer's under `mlp.experts.experts.`, as Megatron-Core's SequentialMLP and TEGroupedMLP both
store them). A MoE layer's
pre-MLP norm is `pre_mlp_layernorm` (Transformer Engine's MoE spec keeps it apart from fc1).

Imports no torch, so config validation can call `model_shape`.
"""

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Optional

# HF's defaults for keys an older or hand-written config.json may omit.
HF_DEFAULTS: dict[str, Any] = {
    "architectures": None,
    "num_key_value_heads": None,  # -> num_attention_heads
    "head_dim": None,  # -> hidden_size // num_attention_heads
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "rope_parameters": None,  # transformers >= 5; older configs have rope_theta + rope_scaling
    "rope_theta": 10000.0,
    "rope_scaling": None,
    # mixture of experts (Mixtral, Qwen3-MoE)
    "num_local_experts": None,
    "num_experts": None,  # Qwen3-MoE's name in config.json
    "num_experts_per_tok": 2,
    "moe_intermediate_size": None,  # Qwen3-MoE; Mixtral's experts are intermediate_size wide
    "norm_topk_prob": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "partial_rotary_factor": None,  # older configs; transformers >= 5 keeps it in rope_parameters
    "initializer_range": 0.02,  # the std of HF's normal init (a new scalar head's)
}

NO_LAYER_WINDOWS = ("use_sliding_window", True, "per-layer sliding windows (use_sliding_window) are not mapped")
GEMMA_REFUSED = (
    ("attention_bias", True, "Gemma's attention biases are not mapped (no released Gemma has them)"),
    ("use_bidirectional_attention", True, "bidirectional attention (an encoder's) is not mapped: alignflow trains causal models"),
)
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types
GELU_TANH = "gelu_pytorch_tanh"  # GeGLU with torch's tanh approximation of GELU

ROPE_TYPES = ("default", "linear", "llama3")
PHI3_ROPE_TYPES = ("default", "longrope")  # Phi3Config's
LLAMA3_ROPE_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(cfg: Mapping[str, Any], rope_types: tuple[str, ...] = ROPE_TYPES, partial_rotary: bool = False) -> dict[str, Any]:
    """ModelShape's rope fields from `rope_parameters` (transformers >= 5) or `rope_theta` +
    `rope_scaling`; a partial rotary factor only where the family's RoPE honours it (Phi-3)."""
    params = cfg["rope_parameters"] or {"rope_theta": cfg["rope_theta"], **(cfg["rope_scaling"] or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in rope_types:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(rope_types)}")
    partial_factor = float(params.get("partial_rotary_factor", cfg["partial_rotary_factor"] or 1.0))
    if partial_factor != 1.0 and not partial_rotary:
        raise ValueError(
            f"unsupported HF config partial_rotary_factor={partial_factor}: {cfg['architectures'][0]} is mapped with RoPE over whole heads"
        )
    missing = [k for k in LLAMA3_ROPE_KEYS if rope_type == "llama3" and params.get(k) is None]
    if missing:
        raise ValueError(f"llama3 rope scaling without {', '.join(missing)} in rope_parameters")
    return {
        "rope_theta": float(params.get("rope_theta", cfg["rope_theta"])),
        "rope_type": rope_type,
        "rope_factor": float(params.get("factor", 1.0)),
        "rope_llama3": tuple(float(params[k]) for k in LLAMA3_ROPE_KEYS) if rope_type == "llama3" else (),
        "rotary_percent": partial_factor,
        **(_longrope(cfg, params, partial_factor) if rope_type == "longrope" else {}),
    }


def _longrope(cfg: Mapping[str, Any], params: Mapping[str, Any], partial_factor: float) -> dict[str, Any]:
    """Phi-3's long-context RoPE as HF computes it (`_compute_longrope_parameters`) up to
    original_max_position_embeddings positions: each rotary frequency divided by its
    short_factor, cos and sin scaled by the attention factor, so the rotated dims of q and k
    (all of them, or the first ones under a partial rotary factor: Phi-4-mini) and not the
    others. Past them HF switches the whole sequence to long_factor: refused at compose
    (`data.seq_length`) and at run time (`alignflow.job.model.gpt.LongRoPE`)."""
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None or params.get("short_factor") is None:
        raise ValueError("longrope rope scaling without original_max_position_embeddings or short_factor in rope_parameters")
    rotary_dim = int((cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]) * partial_factor)  # HF's
    if len(params["short_factor"]) != rotary_dim // 2:
        raise ValueError(
            f"longrope rope_parameters.short_factor has {len(params['short_factor'])} factors; the model's "
            f"{rotary_dim} rotary dims per head (head_dim x partial_rotary_factor {partial_factor}) take {rotary_dim // 2}"
        )
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {
        "rope_short_factor": tuple(float(f) for f in params["short_factor"]),
        "rope_original_max": int(original),
        "rope_attention_factor": float(attention),
    }


def _layer_type_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's two RoPEs: `rope_parameters` per layer type (transformers >= 5), or the global
    `rope_theta` + `rope_scaling` and the sliding layers' `rope_local_base_freq`. The sliding
    layers' must be unscaled."""
    params = cfg["rope_parameters"] or {}
    if FULL not in params:  # an older config.json, read as Gemma3TextConfig.convert_rope_params_to_dict does
        params = {
            FULL: {"rope_theta": cfg["rope_theta"], **(cfg["rope_scaling"] or {})},
            SLIDING: {"rope_theta": cfg["rope_local_base_freq"], "rope_type": "default"},
        }
    local = params[SLIDING]
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        raise ValueError(f"unsupported rope_type {local_type!r} on sliding_attention layers; only 'default' is mapped there")
    return {**_rope({**cfg, "rope_parameters": params[FULL]}), "local_rope_theta": float(local["rope_theta"])}


@dataclass(frozen=True)
class Family:
    """One HF architecture: the ModelShape flags its config sets (`flags`, from the config with
    HF_DEFAULTS filled in) and the config values it refuses (a value, or a predicate on it),
    each with why."""

    flags: Callable[[Mapping[str, Any]], dict[str, Any]]
    refused: tuple[tuple[str, Any, str], ...] = ()
    activation: str = "silu"  # SwiGLU: Megatron's gated_linear_unit with F.silu
    activation_key: str = "hidden_act"  # the config key HF's modeling code reads it from
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the family's HF defaults beyond HF_DEFAULTS
    rope: Callable[[Mapping[str, Any]], dict[str, Any]] = _rope  # ModelShape's rope fields


def _llama(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": cfg["attention_bias"], "proj_bias": cfg["attention_bias"], "mlp_bias": cfg["mlp_bias"]}


def _gemma(cfg: Mapping[str, Any], every: int) -> dict[str, Any]:
    """Gemma 2 and 3 (HF's Gemma2/Gemma3TextConfig): a sliding window on the layers `layer_types`
    names (else, as HF derives it, every layer but each `every`-th)."""
    layer_types = cfg["layer_types"] or [FULL if (i + 1) % every == 0 else SLIDING for i in range(cfg["num_hidden_layers"])]
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown or len(layer_types) != cfg["num_hidden_layers"]:
        raise ValueError(f"unsupported HF config layer_types={layer_types!r}: one of {SLIDING!r}, {FULL!r} per layer is mapped")
    return {
        "gemma_norms": True,
        "embedding_scale": True,
        "softmax_scale": cfg["query_pre_attn_scalar"] ** -0.5,
        "attn_softcap": cfg["attn_logit_softcapping"],
        "logit_softcap": cfg["final_logit_softcapping"],
        "sliding_window": cfg["sliding_window"],
        "window_layers": tuple(t == SLIDING for t in layer_types),
    }


GEMMA2_DEFAULTS = {  # Gemma2Config's
    "head_dim": 256,
    "hidden_activation": GELU_TANH,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
GEMMA3_DEFAULTS = {  # Gemma3TextConfig's
    **GEMMA2_DEFAULTS,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}


def _moe(cfg: Mapping[str, Any], expert_names: str, ffn_key: str, norm_topk: bool) -> dict[str, Any]:
    """A MoE family's flags. HF's loss adds the load-balancing loss only with `output_router_logits`."""
    return {
        "num_experts": cfg["num_local_experts"] or cfg["num_experts"],
        "moe_top_k": cfg["num_experts_per_tok"],
        "moe_ffn_hidden_size": cfg[ffn_key],
        "moe_norm_topk": norm_topk,
        "moe_aux_loss_coef": cfg["router_aux_loss_coef"] if cfg["output_router_logits"] else 0.0,
        "expert_names": expert_names,
    }


NO_JITTER = ("router_jitter_noise", lambda v: v not in (0, 0.0, None), "router jitter noise (random input scaling in training) is not mapped")
ALL_SPARSE = (
    ("mlp_only_layers", lambda v: bool(v), "dense layers among the MoE layers are not mapped (every layer must be sparse)"),
    ("decoder_sparse_step", lambda v: v != 1, "dense layers among the MoE layers are not mapped (every layer must be sparse)"),
)


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama),
    "MistralForCausalLM": Family(lambda cfg: {"sliding_window": cfg["sliding_window"]}),
    "Qwen2ForCausalLM": Family(lambda cfg: {"qkv_bias": True}, refused=(NO_LAYER_WINDOWS,)),
    "Qwen3ForCausalLM": Family(lambda cfg: {**_llama(cfg), "qk_norm": True}, refused=(NO_LAYER_WINDOWS,)),
    "Gemma2ForCausalLM": Family(lambda cfg: _gemma(cfg, every=2), GEMMA_REFUSED, GELU_TANH, "hidden_activation", GEMMA2_DEFAULTS),
    "Gemma3ForCausalLM": Family(
        lambda cfg: {**_gemma(cfg, every=cfg["sliding_window_pattern"]), "qk_norm": True},
        GEMMA_REFUSED,
        GELU_TANH,
        "hidden_activation",
        GEMMA3_DEFAULTS,
        _layer_type_rope,
    ),
    "MixtralForCausalLM": Family(
        lambda cfg: {"sliding_window": cfg["sliding_window"], **_moe(cfg, "mixtral", "intermediate_size", True)},
        refused=(NO_JITTER,),
    ),
    "Qwen3MoeForCausalLM": Family(
        lambda cfg: {**_llama(cfg), "qk_norm": True, **_moe(cfg, "qwen3_moe", "moe_intermediate_size", bool(cfg["norm_topk_prob"]))},
        refused=(NO_LAYER_WINDOWS, *ALL_SPARSE),
    ),
    "Olmo2ForCausalLM": Family(
        lambda cfg: {"qkv_bias": cfg["attention_bias"], "proj_bias": cfg["attention_bias"], "qk_norm": True, "qk_norm_whole": True, "post_norm": True}
    ),
    "Phi3ForCausalLM": Family(
        lambda cfg: {"fused_projections": True, "sliding_window": cfg["sliding_window"]},
        rope=partial(_rope, rope_types=PHI3_ROPE_TYPES, partial_rotary=True),
    ),
}

# Each causal LM's HF sequence classifier: the same trunk ending in `score` (hidden -> num_labels,
# no bias) at the last token that is not the pad token, no soft-cap. A model stage output of one
# (num_labels 1) is a reward model (`alignflow.job.model.gpt.ScoreModel`, `score_config`).
SCORE_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForSequenceClassification",
    "MistralForCausalLM": "MistralForSequenceClassification",
    "Qwen2ForCausalLM": "Qwen2ForSequenceClassification",
    "Qwen3ForCausalLM": "Qwen3ForSequenceClassification",
    "Gemma2ForCausalLM": "Gemma2ForSequenceClassification",
    "Gemma3ForCausalLM": "Gemma3TextForSequenceClassification",
    "MixtralForCausalLM": "MixtralForSequenceClassification",
    "Qwen3MoeForCausalLM": "Qwen3MoeForSequenceClassification",
    "Olmo2ForCausalLM": "Olmo2ForSequenceClassification",
    "Phi3ForCausalLM": "Phi3ForSequenceClassification",
}
CAUSAL_OF = {score: causal for causal, score in SCORE_ARCHITECTURES.items()}

# Architectures refused by name, with why (the generic refusal lists the supported ones).
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 checkpoint (a SigLIP vision tower beside the text model, "
    "its config under text_config) is not mapped; convert a Gemma3ForCausalLM text checkpoint",
}


@dataclass(frozen=True)
class ModelShape:
    """What the model builder and the converter need to know of an HF config."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float
    rope_type: str  # one of ROPE_TYPES
    rope_factor: float  # 1.0 unless scaled
    tied_embeddings: bool
    rope_llama3: tuple[float, ...] = ()  # LLAMA3_ROPE_KEYS' values with llama3 scaling
    qkv_bias: bool = False
    proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm of q and of k, before RoPE: over each head (Qwen3, Gemma 3), or
    qk_norm_whole: bool = False  # over the whole projection, all heads at once (OLMo 2)
    post_norm: bool = False  # OLMo 2: RMSNorm on the attention's and the MLP's outputs, none on their inputs
    fused_projections: bool = False  # Phi-3: HF holds qkv_proj ([all q; all k; all v]) and gate_up_proj ([gate; up])
    rotary_percent: float = 1.0  # the share of each head's dims RoPE rotates (the first ones)
    rope_short_factor: tuple[float, ...] = ()  # longrope: each rotary frequency divided by its factor
    rope_original_max: Optional[int] = None  # longrope: past this many positions HF switches to long_factor (refused)
    rope_attention_factor: float = 1.0  # longrope: cos and sin times this, so the rotated dims of q and k
    sliding_window: Optional[int] = None
    window_layers: tuple[bool, ...] = ()  # which layers have the window (empty: all, where there is one)
    local_rope_theta: Optional[float] = None  # RoPE base of the window layers where it differs (Gemma 3)
    gemma_norms: bool = False  # RMSNorm x * (1 + w) in fp32, and post-attention / post-MLP norms (sandwich)
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size) in the weights' dtype
    softmax_scale: Optional[float] = None  # of the attention scores; None: head_dim ** -0.5
    attn_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) before the softmax
    logit_softcap: Optional[float] = None  # the same on the output logits
    num_experts: int = 0  # 0: a dense MLP in every layer; else a MoE layer in every layer
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk: bool = False  # renormalize the top-k router probabilities (HF's norm_topk_prob)
    moe_aux_loss_coef: float = 0.0  # HF's load-balancing loss weight in its training loss (0: not added)
    expert_names: str = ""  # which EXPERT_NAMES the HF checkpoint uses
    score_head: bool = False  # a ...ForSequenceClassification: a scalar head `score` in place of the LM head (untied)
    initializer_range: float = 0.02

    @property
    def rotary_dim(self) -> int:
        """How many first dims of each head RoPE rotates (HF's and Megatron's int(head_dim x factor))."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def lm_head(self) -> bool:
        """An output layer of its own (not the tied embedding, not a scalar head)."""
        return not self.tied_embeddings and not self.score_head

    @property
    def input_norms(self) -> bool:
        return not self.post_norm

    @property
    def pre_norms_only(self) -> bool:
        """A dense MLP with only the norm before it (not Gemma's sandwich, not OLMo 2's post-norms)."""
        return self.dense and not self.gemma_norms and not self.post_norm

    @property
    def separate_projections(self) -> bool:
        """q, k, v (and a dense MLP's gate, up) are separate HF tensors (not Phi-3's qkv_proj, gate_up_proj)."""
        return not self.fused_projections

    @property
    def separate_gate_up(self) -> bool:
        return self.dense and self.separate_projections

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dense(self) -> bool:
        return not self.moe

    @property
    def mixtral_experts(self) -> bool:
        return self.expert_names == "mixtral"

    @property
    def qwen3_moe_experts(self) -> bool:
        return self.expert_names == "qwen3_moe"


@dataclass(frozen=True)
class Param:
    """One Megatron tensor and the HF tensors it is built from.

    `fuse` names the layout (see `layout.FUSED`) that combines several HF tensors, in the
    order of `hf`; `when` names the ModelShape flag the tensor exists under.
    """

    megatron: str
    hf: tuple[str, ...]
    fuse: Optional[str] = None
    when: Optional[str] = None

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.megatron

    def megatron_name(self, layer: Optional[int] = None, expert: Optional[int] = None) -> str:
        return self.megatron.format(layer=layer, expert=expert)

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> tuple[str, ...]:
        return tuple(name.format(layer=layer, expert=expert) for name in self.hf)


_HF = "model.layers.{layer}."
_MEG = "decoder.layers.{layer}."
_EXP = _MEG + "mlp.experts.local_experts.{expert}."
_MIX = _HF + "block_sparse_moe.experts.{expert}."  # Mixtral's w1 (gate), w3 (up), w2 (down)
_QMOE = _HF + "mlp.experts.{expert}."

TABLE: tuple[Param, ...] = (
    Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Param(_MEG + "self_attention.linear_qkv.layer_norm_weight", (_HF + "input_layernorm.weight",), when="input_norms"),
    Param(
        _MEG + "self_attention.linear_qkv.weight",
        (_HF + "self_attn.q_proj.weight", _HF + "self_attn.k_proj.weight", _HF + "self_attn.v_proj.weight"),
        fuse="qkv",
        when="separate_projections",
    ),
    Param(_MEG + "self_attention.linear_qkv.weight", (_HF + "self_attn.qkv_proj.weight",), fuse="hf_qkv", when="fused_projections"),
    Param(
        _MEG + "self_attention.linear_qkv.bias",
        (_HF + "self_attn.q_proj.bias", _HF + "self_attn.k_proj.bias", _HF + "self_attn.v_proj.bias"),
        fuse="qkv",
        when="qkv_bias",
    ),
    Param(_MEG + "self_attention.q_layernorm.weight", (_HF + "self_attn.q_norm.weight",), when="qk_norm"),
    Param(_MEG + "self_attention.k_layernorm.weight", (_HF + "self_attn.k_norm.weight",), when="qk_norm"),
    Param(_MEG + "self_attention.linear_proj.weight", (_HF + "self_attn.o_proj.weight",)),
    Param(_MEG + "self_attention.linear_proj.bias", (_HF + "self_attn.o_proj.bias",), when="proj_bias"),
    Param(_MEG + "self_attention.linear_proj.post_layernorm.weight", (_HF + "post_attention_layernorm.weight",), when="gemma_norms"),
    Param(_MEG + "post_self_attn_layernorm.weight", (_HF + "post_attention_layernorm.weight",), when="post_norm"),
    Param(_MEG + "mlp.linear_fc1.layer_norm_weight", (_HF + "post_attention_layernorm.weight",), when="pre_norms_only"),
    Param(_MEG + "mlp.linear_fc1.layer_norm_weight", (_HF + "pre_feedforward_layernorm.weight",), when="gemma_norms"),
    Param(_MEG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), fuse="fc1", when="separate_gate_up"),
    Param(_MEG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_up_proj.weight",), when="fused_projections"),  # [gate; up] as Megatron's
    Param(_MEG + "mlp.linear_fc1.bias", (_HF + "mlp.gate_proj.bias", _HF + "mlp.up_proj.bias"), fuse="fc1", when="mlp_bias"),
    Param(_MEG + "mlp.linear_fc2.weight", (_HF + "mlp.down_proj.weight",), when="dense"),
    Param(_MEG + "mlp.linear_fc2.bias", (_HF + "mlp.down_proj.bias",), when="mlp_bias"),
    Param(_MEG + "mlp.linear_fc2.post_layernorm.weight", (_HF + "post_feedforward_layernorm.weight",), when="gemma_norms"),
    Param(_MEG + "pre_mlp_layernorm.weight", (_HF + "post_attention_layernorm.weight",), when="moe"),
    Param(_MEG + "mlp.router.weight", (_HF + "block_sparse_moe.gate.weight",), when="mixtral_experts"),
    Param(_EXP + "linear_fc1.weight", (_MIX + "w1.weight", _MIX + "w3.weight"), fuse="fc1", when="mixtral_experts"),
    Param(_EXP + "linear_fc2.weight", (_MIX + "w2.weight",), when="mixtral_experts"),
    Param(_MEG + "mlp.router.weight", (_HF + "mlp.gate.weight",), when="qwen3_moe_experts"),
    Param(_EXP + "linear_fc1.weight", (_QMOE + "gate_proj.weight", _QMOE + "up_proj.weight"), fuse="fc1", when="qwen3_moe_experts"),
    Param(_EXP + "linear_fc2.weight", (_QMOE + "down_proj.weight",), when="qwen3_moe_experts"),
    Param(_MEG + "post_mlp_layernorm.weight", (_HF + "post_feedforward_layernorm.weight",), when="post_norm"),
    Param("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Param("output_layer.weight", ("lm_head.weight",), when="lm_head"),
    Param("rm_head.weight", ("score.weight",), when="score_head"),  # NeMo-Aligner's name; [1, hidden]
)

# With tied embeddings, a last pipeline stage that lacks the embedding holds its own copy of
# the output weight (Megatron all-reduces the two); it is the HF embedding.
TIED_OUTPUT_COPY = Param("output_layer.weight", ("model.embed_tokens.weight",))


def params_for(shape: ModelShape) -> tuple[Param, ...]:
    """The table's entries that exist for this model."""
    return tuple(p for p in TABLE if p.when is None or getattr(shape, p.when))


# Where one Megatron tensor of a table entry sits: (layer, expert), None where the entry has no such axis.
Slot = tuple[Optional[int], Optional[int]]


def slots(param: Param, shape: ModelShape) -> list[Slot]:
    """Every (layer, expert) of a table entry in the whole model, layer-major: one tensor each."""
    layers = range(shape.num_layers) if param.per_layer else [None]
    experts = range(shape.num_experts) if param.per_expert else [None]
    return [(layer, expert) for layer in layers for expert in experts]


def model_shape(hf_config: Mapping[str, Any]) -> ModelShape:
    """Read an HF config dict (config.json); raise ValueError for anything not supported."""
    architecture = _architecture(hf_config)
    family = ARCHITECTURES[CAUSAL_OF.get(architecture, architecture)]
    cfg = {**HF_DEFAULTS, **family.defaults, **hf_config}
    _refuse_unsupported(cfg, family)
    heads, score_head = cfg["num_attention_heads"], architecture in CAUSAL_OF
    if score_head and cfg.get("id2label") is not None and len(cfg["id2label"]) != 1:
        raise ValueError(f"unsupported {architecture} with {len(cfg['id2label'])} labels: a reward model has one (num_labels 1)")
    flags = family.flags(cfg) | ({"logit_softcap": None} if score_head else {})  # HF's classifiers do not soft-cap the score
    return ModelShape(
        architecture=architecture,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg["num_key_value_heads"] or heads,
        head_dim=cfg["head_dim"] or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        norm_eps=cfg["rms_norm_eps"],
        tied_embeddings=bool(cfg["tie_word_embeddings"]) and not score_head,
        score_head=score_head,
        initializer_range=cfg["initializer_range"],
        **family.rope(cfg),
        **flags,
    )


def score_config(hf_config: Mapping[str, Any], pad_token_id: int) -> dict[str, Any]:
    """The HF config.json of a reward model on `hf_config`'s trunk: its ...ForSequenceClassification
    with one label, as `save_pretrained` writes it, and the pad token HF's classifier scores
    before (the last token that is not `pad_token_id`)."""
    architecture = _architecture(hf_config)
    return {
        **hf_config,
        "architectures": [SCORE_ARCHITECTURES.get(architecture, architecture)],
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "pad_token_id": pad_token_id,
    }


def _architecture(cfg: Mapping[str, Any]) -> str:
    architecture = (cfg.get("architectures") or [None])[0]
    if architecture in REFUSED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}: {REFUSED_ARCHITECTURES[architecture]}")
    if architecture not in ARCHITECTURES and architecture not in CAUSAL_OF:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)} "
            "and their ...ForSequenceClassification (SCORE_ARCHITECTURES)"
        )
    return architecture


def _refuse_unsupported(cfg: Mapping[str, Any], family: Family) -> None:
    for key, refused, why in family.refused:
        if refused(cfg.get(key)) if callable(refused) else cfg.get(key) == refused:
            raise ValueError(f"unsupported HF config {key}={cfg.get(key)!r}: {why}")
    activation = cfg[family.activation_key]
    if activation != family.activation:
        raise ValueError(f"unsupported HF config {family.activation_key}={activation!r}: {cfg['architectures'][0]} maps only {family.activation!r}")
