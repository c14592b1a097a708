"""The HF architectures alignflow converts and trains, as data: how each reads its config
(`ARCHITECTURES`), and one name table (`TABLE`) whose entries exist under shape flags.

Supported: LlamaForCausalLM (with attention / MLP biases, RoPE default, linear, or llama3
scaling with any constants), MistralForCausalLM (sliding window on all layers),
Qwen2ForCausalLM (qkv bias), Qwen3ForCausalLM (per-head q/k RMSNorm), Olmo2ForCausalLM
(post-norm layers, q/k RMSNorm over the whole projection, attention biases), Phi3ForCausalLM
(Phi-3 and Phi-4: HF's fused qkv_proj and gate_up_proj, partial rotary, sliding window); GQA,
tied or untied embeddings, RMSNorm, SwiGLU. Refused with a ValueError that says why: any other
architecture or activation, other rope types, longrope past original_max_position_embeddings
positions or with a partial rotary factor (Phi-4-mini), a partial rotary factor outside Phi-3, Qwen2/Qwen3 per-layer sliding windows. Each would otherwise convert into a
different model.

Megatron names are the ones Megatron-Core checkpoints hold: Transformer Engine's names
(`self_attention.linear_qkv.layer_norm_weight`, ...) whatever the layer spec;
`alignflow.megatron.model` maps them onto a local-spec module. `{layer}` is the layer number:
global on the HF side, local to a pipeline stage on the Megatron side.

Imports no torch, so config validation can call `model_shape`.
"""

import math
from dataclasses import dataclass
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
    "partial_rotary_factor": None,  # older configs; transformers >= 5 keeps it in rope_parameters
}

NO_LAYER_WINDOWS = ("use_sliding_window", True, "per-layer sliding windows (use_sliding_window) are not mapped")


@dataclass(frozen=True)
class Family:
    """One HF architecture: the ModelShape flags its config sets (`flags`, from the config with
    HF_DEFAULTS filled in) and the config values it refuses, each with why."""

    flags: Callable[[Mapping[str, Any]], dict[str, Any]]
    refused: tuple[tuple[str, Any, str], ...] = ()
    activation: str = "silu"  # SwiGLU: Megatron's gated_linear_unit with F.silu
    partial_rotary: bool = False  # HF's RoPE honours partial_rotary_factor (rotates the first dims of each head)


def _llama(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": cfg["attention_bias"], "proj_bias": cfg["attention_bias"], "mlp_bias": cfg["mlp_bias"]}


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama),
    "MistralForCausalLM": Family(lambda cfg: {"sliding_window": cfg["sliding_window"]}),
    "Qwen2ForCausalLM": Family(lambda cfg: {"qkv_bias": True}, refused=(NO_LAYER_WINDOWS,)),
    "Qwen3ForCausalLM": Family(lambda cfg: {**_llama(cfg), "qk_norm": True}, refused=(NO_LAYER_WINDOWS,)),
    "Olmo2ForCausalLM": Family(lambda cfg: {"qkv_bias": cfg["attention_bias"], "proj_bias": cfg["attention_bias"], "qk_norm": True,
                                            "qk_norm_whole": True, "post_norm": True}),
    "Phi3ForCausalLM": Family(lambda cfg: {"fused_projections": True, "sliding_window": cfg["sliding_window"]}, partial_rotary=True),
}

ROPE_TYPES = ("default", "linear", "llama3", "longrope")
LONGROPE_WHY = ("its attention factor scales the rotated dims of q and k only, which is not one softmax scale; "
                "Megatron-Core's attention has no such term")
LLAMA3_ROPE_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
    qk_norm: bool = False  # RMSNorm of q and of k, before RoPE: over each head (Qwen3), or
    qk_norm_whole: bool = False  # over the whole projection, all heads at once (OLMo 2)
    post_norm: bool = False  # OLMo 2: RMSNorm on the attention's and the MLP's outputs, none on their inputs
    fused_projections: bool = False  # Phi-3: HF holds qkv_proj ([all q; all k; all v]) and gate_up_proj ([gate; up])
    rotary_percent: float = 1.0  # the share of each head's dims RoPE rotates (the first ones)
    rope_short_factor: tuple[float, ...] = ()  # longrope: each rotary frequency divided by its factor
    rope_attention_factor: float = 1.0  # longrope: HF scales cos and sin by it (so the scores by its square)
    rope_original_max: Optional[int] = None  # longrope: past this many positions HF switches to long_factor (refused)
    sliding_window: Optional[int] = None

    @property
    def untied_embeddings(self) -> bool:
        return not self.tied_embeddings

    @property
    def pre_norm(self) -> bool:
        return not self.post_norm

    @property
    def separate_projections(self) -> bool:
        return not self.fused_projections


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

    def megatron_name(self, layer: Optional[int] = None) -> str:
        return self.megatron.format(layer=layer)

    def hf_names(self, layer: Optional[int] = None) -> tuple[str, ...]:
        return tuple(name.format(layer=layer) for name in self.hf)


_HF = "model.layers.{layer}."
_MEG = "decoder.layers.{layer}."

TABLE: tuple[Param, ...] = (
    Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
    Param(_MEG + "self_attention.linear_qkv.layer_norm_weight", (_HF + "input_layernorm.weight",), when="pre_norm"),
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
    Param(_MEG + "post_self_attn_layernorm.weight", (_HF + "post_attention_layernorm.weight",), when="post_norm"),
    Param(_MEG + "mlp.linear_fc1.layer_norm_weight", (_HF + "post_attention_layernorm.weight",), when="pre_norm"),
    Param(_MEG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), fuse="fc1", when="separate_projections"),
    Param(_MEG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_up_proj.weight",), when="fused_projections"),  # [gate; up] as Megatron's
    Param(_MEG + "mlp.linear_fc1.bias", (_HF + "mlp.gate_proj.bias", _HF + "mlp.up_proj.bias"), fuse="fc1", when="mlp_bias"),
    Param(_MEG + "mlp.linear_fc2.weight", (_HF + "mlp.down_proj.weight",)),
    Param(_MEG + "mlp.linear_fc2.bias", (_HF + "mlp.down_proj.bias",), when="mlp_bias"),
    Param(_MEG + "post_mlp_layernorm.weight", (_HF + "post_feedforward_layernorm.weight",), when="post_norm"),
    Param("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Param("output_layer.weight", ("lm_head.weight",), when="untied_embeddings"),
)

# With tied embeddings, a last pipeline stage that lacks the embedding holds its own copy of
# the output weight (Megatron all-reduces the two); it is the HF embedding.
TIED_OUTPUT_COPY = Param("output_layer.weight", ("model.embed_tokens.weight",))


def params_for(shape: ModelShape) -> tuple[Param, ...]:
    """The table's entries that exist for this model."""
    return tuple(p for p in TABLE if p.when is None or getattr(shape, p.when))


def model_shape(hf_config: Mapping[str, Any]) -> ModelShape:
    """Read an HF config dict (config.json); raise ValueError for anything not supported."""
    cfg = {**HF_DEFAULTS, **hf_config}
    architecture = _architecture(cfg)
    family = ARCHITECTURES[architecture]
    _refuse_unsupported(cfg, family)
    heads = cfg["num_attention_heads"]
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
        tied_embeddings=bool(cfg["tie_word_embeddings"]),
        **_rope(cfg, family),
        **family.flags(cfg),
    )


def _architecture(cfg: Mapping[str, Any]) -> str:
    architecture = (cfg["architectures"] or [None])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return architecture


def _refuse_unsupported(cfg: Mapping[str, Any], family: Family) -> None:
    for key, refused, why in family.refused:
        if cfg.get(key) == refused:
            raise ValueError(f"unsupported HF config {key}={refused!r}: {why}")
    if cfg["hidden_act"] != family.activation:
        raise ValueError(f"unsupported HF config hidden_act={cfg['hidden_act']!r}: {cfg['architectures'][0]} maps only {family.activation!r}")


def _rope(cfg: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """ModelShape's rope fields from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
    params = cfg["rope_parameters"] or {"rope_theta": cfg["rope_theta"], **(cfg["rope_scaling"] or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", cfg["partial_rotary_factor"] or 1.0))
    if partial != 1.0 and not family.partial_rotary:
        raise ValueError(f"unsupported HF config partial_rotary_factor={partial}: {cfg['architectures'][0]} is mapped with RoPE "
                         "over whole heads")
    missing = [k for k in LLAMA3_ROPE_KEYS if rope_type == "llama3" and params.get(k) is None]
    if missing:
        raise ValueError(f"llama3 rope scaling without {', '.join(missing)} in rope_parameters")
    if rope_type == "longrope" and partial != 1.0:
        raise ValueError(f"unsupported rope_type 'longrope' with partial_rotary_factor={partial} (Phi-4-mini): {LONGROPE_WHY}")
    return {
        "rope_theta": float(params.get("rope_theta", cfg["rope_theta"])),
        "rope_type": rope_type,
        "rope_factor": float(params.get("factor", 1.0)),
        "rope_llama3": tuple(float(params[k]) for k in LLAMA3_ROPE_KEYS) if rope_type == "llama3" else (),
        "rotary_percent": partial,
        **(_longrope(cfg, params) if rope_type == "longrope" else {}),
    }


def _longrope(cfg: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-3's long-context RoPE as HF computes it (`_compute_longrope_parameters`) up to
    original_max_position_embeddings positions: each frequency divided by its short_factor,
    cos and sin scaled by the attention factor. Past it HF switches the whole sequence to
    long_factor, which `alignflow.megatron.model` refuses at run time."""
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    if original is None or params.get("short_factor") is None:
        raise ValueError("longrope rope scaling without original_max_position_embeddings or short_factor in rope_parameters")
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {"rope_short_factor": tuple(float(f) for f in params["short_factor"]), "rope_attention_factor": float(attention),
            "rope_original_max": int(original)}
