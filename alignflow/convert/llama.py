"""The Llama family between HF and Megatron-Core, as data.

Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM with GQA, tied or untied
embeddings, Qwen2's qkv bias, RMSNorm, SwiGLU, RoPE (default, linear, and llama3 scaling
within Megatron-Core's fixed llama3 constants) and Mistral's sliding window (all layers).
Refused with a ValueError that says why: any other architecture, biases outside qkv (Llama's
`attention_bias` / `mlp_bias`), activations other than SiLU, other rope types, Qwen2's
per-layer sliding windows. Each of these would otherwise convert into a different model.

Megatron names are the ones Megatron-Core checkpoints hold: Transformer Engine's names
(`self_attention.linear_qkv.layer_norm_weight`, ...) whatever the layer spec;
`alignflow.megatron.model` maps them onto a local-spec module. `{layer}` is the layer number:
global on the HF side, local to a pipeline stage on the Megatron side.

Imports no torch, so config validation can call `model_shape`.
"""

from dataclasses import dataclass
from typing import Any, Mapping, Optional

# Architecture -> what distinguishes it within the family.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "sliding_window": False},
    "MistralForCausalLM": {"qkv_bias": False, "sliding_window": True},
    "Qwen2ForCausalLM": {"qkv_bias": True, "sliding_window": False},
}

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
}

# (config key, refused value, why): each would silently convert into a different model.
REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("attention_bias", True, "biases on the attention projections are not mapped"),
    ("mlp_bias", True, "biases on the MLP projections are not mapped"),
    ("use_sliding_window", True, "Qwen2's per-layer sliding windows are not mapped"),
)

ACTIVATION = "silu"  # SwiGLU: Megatron's gated_linear_unit with F.silu
ROPE_TYPES = ("default", "linear", "llama3")
# Megatron-Core 0.16.1's RotaryEmbedding._apply_scaling takes only `factor`; these are fixed.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
    qkv_bias: bool
    sliding_window: Optional[int]

    @property
    def untied_embeddings(self) -> bool:
        return not self.tied_embeddings


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
    Param(_MEG + "self_attention.linear_qkv.layer_norm_weight", (_HF + "input_layernorm.weight",)),
    Param(
        _MEG + "self_attention.linear_qkv.weight",
        (_HF + "self_attn.q_proj.weight", _HF + "self_attn.k_proj.weight", _HF + "self_attn.v_proj.weight"),
        fuse="qkv",
    ),
    Param(
        _MEG + "self_attention.linear_qkv.bias",
        (_HF + "self_attn.q_proj.bias", _HF + "self_attn.k_proj.bias", _HF + "self_attn.v_proj.bias"),
        fuse="qkv",
        when="qkv_bias",
    ),
    Param(_MEG + "self_attention.linear_proj.weight", (_HF + "self_attn.o_proj.weight",)),
    Param(_MEG + "mlp.linear_fc1.layer_norm_weight", (_HF + "post_attention_layernorm.weight",)),
    Param(_MEG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), fuse="fc1"),
    Param(_MEG + "mlp.linear_fc2.weight", (_HF + "mlp.down_proj.weight",)),
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
    _refuse_unsupported(cfg)
    rope_theta, rope_type, rope_factor = _rope(cfg)
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
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_factor=rope_factor,
        tied_embeddings=bool(cfg["tie_word_embeddings"]),
        qkv_bias=ARCHITECTURES[architecture]["qkv_bias"],
        sliding_window=cfg["sliding_window"] if ARCHITECTURES[architecture]["sliding_window"] else None,
    )


def _architecture(cfg: Mapping[str, Any]) -> str:
    architecture = (cfg["architectures"] or [None])[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    return architecture


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    for key, refused, why in REFUSED:
        if cfg[key] == refused:
            raise ValueError(f"unsupported HF config {key}={refused!r}: {why}")
    if cfg["hidden_act"] != ACTIVATION:
        raise ValueError(f"unsupported HF config hidden_act={cfg['hidden_act']!r}: only {ACTIVATION!r} (SwiGLU) is mapped")


def _rope(cfg: Mapping[str, Any]) -> tuple[float, str, float]:
    """(theta, type, factor) from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`."""
    params = cfg["rope_parameters"] or {"rope_theta": cfg["rope_theta"], **(cfg["rope_scaling"] or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "llama3":
        differing = {k: params.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if params.get(k) != v}
        if differing:
            raise ValueError(
                f"llama3 rope scaling with {differing} is not supported: Megatron-Core fixes {MEGATRON_LLAMA3_ROPE}"
            )
    return float(params.get("rope_theta", cfg["rope_theta"])), rope_type, float(params.get("factor", 1.0))
