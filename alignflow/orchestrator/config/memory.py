"""Per-rank memory of a training stage, estimated from the model's shape and the stage's layout
(no weights, no torch): what `align plan` prints and what compose checks against
`launcher.gpu_memory_gib`.

Per rank, in bytes (the busiest pipeline stage: the first holds the embedding and the most
micro batches in flight, the last the output layer and the logits):
- weights: parameters x 2 (bf16) or 4 (fp32); dense parameters split over TP (and PP),
  experts over EP x expert TP (= TP, Megatron's default) and PP;
- gradients: 4 per trainable parameter (Megatron's DDP accumulates and reduces in fp32 buffers,
  `grad_reduce_in_fp32`, whatever the weights' dtype; the buffer is whole under the
  distributed optimizer too);
- optimizer: Adam's two fp32 moments (8) plus, in bf16, the fp32 main weights (4), per
  trainable parameter; divided over the data-parallel ranks (experts: the expert-data-parallel
  ranks, world / (PP x EP x expert TP)) with `parallel.use_distributed_optimizer`;
- activations: what autograd keeps for the backward pass, per layer and micro batch of b rows
  of s tokens, at p = 2 (bf16) or 4 (fp32) bytes, in the manner of Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models", section 4: sbh(34 + 5as/h)
  bytes for a GPT layer, from the list of tensors it keeps) but for the layer alignflow builds
  (`ACTIVATIONS_PER_TOKEN`, checked against autograd's saved tensors): GQA, a gated MLP
  (SwiGLU/GeGLU), torch's unfused RMSNorm, flash-style attention everywhere (no s x s scores:
  Korthikanti's 5as/h term is 0), no dropout masks unless dropout. h-sized terms are split over
  TP only with sequence parallelism (as their 10 + 24/t). Micro batches in flight on the first
  PP stage: min(PP, micro batches per step), x (1 + (PP - 1) / (PP x VP)) interleaved (their
  section 4.2.3). Full recompute keeps each chunk's input (sbh) and recomputes one chunk at a
  time; selective recompute (the core attention) changes nothing here: a flash kernel keeps no
  scores to drop. The logits: three fp32 copies of [s, b, vocab / TP] live at the start of the
  backward (the saved log-softmax, its gradient and the input gradient). An MoE layer
  (`Dimensions.experts` > 0) keeps its router's fp32 probabilities and, per token, top-k copies
  of the expert MLP's tensors and of the token going in and out (tokens spread evenly).

Not counted: the CUDA context and the caching allocator's slack (a few GiB on a GPU: leave
headroom), communication buffers, GRPO's generation KV cache (it does not coexist with the
training activations), family extras of a layer (q/k norms, Gemma's sandwich norms: a few h per
token). Forward-only stages (reference log-probs, eval) are not estimated.
"""

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from alignflow.job.convert.lora import BY_PATH, select
from alignflow.orchestrator.kinds import STAGES

GIB = 2**30

# Saved activation bytes per token of one layer at p bytes per activation: (what, bytes, split
# over TP without sequence parallelism). Counted from autograd's saved tensors of alignflow's
# layers (tests/test_memory.py measures them): Korthikanti's inventory of a layer (their LN
# inputs, QKV input, Q, K, softmax, V, projection input, MLP inputs, dropout masks) for a layer
# whose norms are torch's unfused RMSNorm, whose attention is torch's SDPA and whose MLP is
# Megatron's unfused gated one (TransformerConfig.bias_activation_fusion stays False).
ACTIVATIONS_PER_TOKEN = (
    # 2 RMSNorms in fp32: the input as fp32 and x * rstd (4 + 4 bytes), the output (p; the next linear's input)
    ("norms", lambda d, p: 2 * (8 + p) * d.hidden, False),
    # q, k and v with k, v repeated to every query head (SDPA's grouped-query form on CPU; varlen
    # attention on GPU takes them unrepeated: 2 (q - kv) p fewer), the output and the output
    # projection's contiguous copy of it, the fp32 log-sum-exp; no s x s scores (flash-style kernels)
    ("attention", lambda d, p: 5 * p * d.q + 4 * d.heads, True),
    # fc1's [gate; up] (2f), act(gate), up + glu_linear_offset (a copy), their product (fc2's input)
    ("mlp", lambda d, p: 5 * p * d.mlp, True),
)


@dataclass(frozen=True)
class Dimensions:
    """The numbers of an HF config.json that size a model's memory (Llama-style layers; an MoE
    model's MLP is its experts). Read from the dict itself, so a family the converter does not
    map (yet) can be sized."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0  # 0: dense
    expert_ffn: int = 0
    experts_per_token: int = 0
    shared_expert_ffn: int = 0

    @classmethod
    def of(cls, hf_config: Mapping[str, Any]) -> "Dimensions":
        """From config.json; a multimodal checkpoint's `text_config` (Gemma 3) is the language model."""
        cfg = {**hf_config, **hf_config.get("text_config", {})}
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0  # Mixtral's name, Qwen-MoE's
        return cls(
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            ffn=cfg["intermediate_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab=cfg["vocab_size"],
            tied=bool(cfg.get("tie_word_embeddings", False)),
            experts=experts,
            expert_ffn=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
            experts_per_token=cfg.get("num_experts_per_tok", 0) if experts else 0,
            shared_expert_ffn=cfg.get("shared_expert_intermediate_size") or 0,
        )

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mlp(self) -> int:
        """The MLP width one token's activations see: the dense MLP's, or k experts' and the shared one's."""
        return self.experts_per_token * self.expert_ffn + self.shared_expert_ffn if self.experts else self.ffn

    def attention_params(self) -> int:
        return self.hidden * (self.q + 2 * self.kv) + self.q * self.hidden

    def expert_params(self) -> int:
        """All experts of one layer (gate, up, down each)."""
        return self.experts * 3 * self.hidden * self.expert_ffn

    def dense_mlp_params(self) -> int:
        """One layer's MLP weights outside the experts: the dense MLP, or the router and a shared expert."""
        return self.hidden * self.experts + 3 * self.hidden * self.shared_expert_ffn if self.experts else 3 * self.hidden * self.ffn

    def total_params(self) -> int:
        per_layer = self.attention_params() + self.dense_mlp_params() + self.expert_params() + 2 * self.hidden
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class Layout:
    """How a stage lays the model over its ranks, and what it keeps per rank."""

    world: int
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    bf16: bool = True
    micro_batch: int = 1
    seq_length: int = 2048
    micro_batches: int = 1  # per step and data-parallel rank
    recompute: str = "none"  # none, selective, full
    recompute_method: str = "uniform"
    recompute_layers: int = 1
    dropout: bool = False
    vocab_divisible_by: int = 128
    frozen_copies: int = 0  # whole frozen models beside the trained one (GRPO's reference)
    lora_params: Optional[int] = None  # trainable adapter parameters of the whole model; None: all weights train

    @property
    def dp(self) -> int:
        return max(self.world // (self.tp * self.pp), 1)

    @property
    def expert_dp(self) -> int:
        return max(self.world // (self.pp * self.ep * self.tp), 1)


@dataclass(frozen=True)
class Footprint:
    """Bytes per rank of the busiest rank (`stage`: which pipeline stage that is)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    stage: str = "only"

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def gib(self) -> dict[str, float]:
        return {name: round(getattr(self, name) / GIB, 4) for name in ("weights", "gradients", "optimizer", "activations", "total")}

    def describe(self) -> str:
        g = self.gib()
        return (
            f"{g['total']:.3g} GiB per rank = weights {g['weights']:.3g} + gradients {g['gradients']:.3g} + optimizer "
            f"{g['optimizer']:.3g} + activations {g['activations']:.3g}"
        )


def estimate(dims: Dimensions, layout: Layout) -> Footprint:
    """The larger of the first and the last pipeline stage's footprint (one and the same at PP 1)."""
    stages = ("first", "last") if layout.pp > 1 else ("only",)
    return max((_stage_footprint(dims, layout, stage) for stage in stages), key=lambda f: f.total)


def _stage_footprint(dims: Dimensions, layout: Layout, stage: str) -> Footprint:
    t, layers = layout.tp, dims.layers / layout.pp
    vocab = math.ceil(dims.vocab / (layout.vocab_divisible_by * t)) * layout.vocab_divisible_by * t
    first, last = stage in ("first", "only"), stage in ("last", "only")
    # the input embedding on the first stage, the output layer on the last (a tied model's last stage holds a copy)
    embeddings = {"only": 1 if dims.tied else 2, "first": 1, "last": 1}[stage] * vocab * dims.hidden / t
    dense = layers * ((dims.attention_params() + dims.dense_mlp_params()) / t + 2 * dims.hidden) + embeddings
    experts = layers * dims.expert_params() / (layout.ep * t)
    weight_bytes = 2 if layout.bf16 else 4
    weights = (dense + experts) * weight_bytes * (1 + layout.frozen_copies)
    if layout.lora_params is not None:
        trainable_dense, trainable_experts = layout.lora_params / layout.pp, 0.0
    else:
        trainable_dense, trainable_experts = dense, experts
    state = 12 if layout.bf16 else 8  # fp32 main weights (bf16 only: fp32 weights are their own) + Adam's moments
    shards = (layout.dp, layout.expert_dp) if layout.distributed_optimizer else (1, 1)
    optimizer = state * (trainable_dense / shards[0] + trainable_experts / shards[1])
    return Footprint(
        weights=weights,
        gradients=4 * (trainable_dense + trainable_experts),
        optimizer=optimizer,
        activations=activation_bytes(dims, layout, layers, first, last, vocab),
        stage=stage,
    )


def layer_activation_bytes(dims: Dimensions, layout: Layout) -> float:
    """One layer's saved activations for one micro batch (see ACTIVATIONS_PER_TOKEN)."""
    t, p = layout.tp, 2 if layout.bf16 else 4
    per_token = sum(size(dims, p) / (t if split or layout.sequence_parallel else 1) for _, size, split in ACTIVATIONS_PER_TOKEN)
    if dims.experts:  # the router's fp32 probabilities; k permuted copies of the token into the experts and out of them
        per_token += 4 * dims.experts + 2 * dims.experts_per_token * dims.hidden * p
    if layout.dropout:  # two hidden-dropout masks of one byte per element
        per_token += 2 * dims.hidden / (t if layout.sequence_parallel else 1)
    return per_token * layout.micro_batch * layout.seq_length


def activation_bytes(dims: Dimensions, layout: Layout, layers: float, first: bool, last: bool, vocab: int) -> float:
    """A pipeline stage's activations at its peak: its layers' for the micro batches in flight,
    the recompute window, and on the last stage the logits."""
    layer = layer_activation_bytes(dims, layout)
    tokens = layout.micro_batch * layout.seq_length
    checkpoint = tokens * dims.hidden * (2 if layout.bf16 else 4) / (layout.tp if layout.sequence_parallel else 1)
    n = min(layout.recompute_layers, layers)
    if layout.recompute != "full":
        kept, window = layers * layer, 0.0
    elif layout.recompute_method == "block":  # the first n layers of the stage keep their input only
        kept, window = n * checkpoint + (layers - n) * layer, layer
    else:  # chunks of n layers keep their input; one chunk is recomputed at a time
        kept, window = math.ceil(layers / n) * checkpoint, n * layer
    in_flight = min(layout.pp, layout.micro_batches) if first and layout.pp > 1 else 1
    if first and layout.pp > 1 and layout.vpp:
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    final = (3 * 4 * tokens * vocab / layout.tp + 3 * checkpoint) if last else 0.0  # fp32 logits x 3; final norm and output input
    return kept * in_flight + window + final


def lora_params(dims: Dimensions, targets: list[str], rank: int) -> int:
    """Adapter parameters of the whole model: r x (in + out) per adapted projection."""
    sizes = {
        "q_proj": (dims.hidden, dims.q),
        "k_proj": (dims.hidden, dims.kv),
        "v_proj": (dims.hidden, dims.kv),
        "o_proj": (dims.q, dims.hidden),
        "gate_proj": (dims.hidden, dims.ffn),
        "up_proj": (dims.hidden, dims.ffn),
        "down_proj": (dims.ffn, dims.hidden),
    }
    return sum(rank * sum(sizes[part]) for (_, path), parts in select(targets, dims.layers).items() for part in parts if path in BY_PATH)


def layout_of(kind: str, cfg: Any, inputs: Mapping[str, Any], dims: Dimensions) -> Optional[Layout]:
    """A training stage's Layout from its config as the instance sees it (`Stage.cfg`, precision
    resolved), with what its kind's micro batch rows hold and the frozen models it keeps
    (`StageKind.rows`, `frozen_models`); None for a stage that does not train."""
    section = cfg[kind]
    if "optim" not in section:
        return None
    par, data = section.parallel, cfg.data
    world = section.resources.nodes * section.resources.tasks_per_node
    sizes = (
        world,
        par.tensor_model_parallel_size,
        par.pipeline_model_parallel_size,
        par.virtual_pipeline_model_parallel_size or 1,
        par.expert_model_parallel_size,
        section.micro_batch_size,
        section.recompute_num_layers,
    )
    if min(sizes) < 1:  # refused by the layout checks
        return None
    dp, spec = max(world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size), 1), STAGES[kind]
    seq_length, rows = spec.rows(section, data, dp)
    lora = None if section.finetuning_type == "all_weights" else lora_params(dims, list(section.lora.target_modules), section.lora.adapter_dim)
    return Layout(
        world=world,
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        vpp=par.virtual_pipeline_model_parallel_size,
        ep=par.expert_model_parallel_size,
        sequence_parallel=par.sequence_parallel,
        distributed_optimizer=par.use_distributed_optimizer,
        bf16=section.precision == "bf16",
        micro_batch=section.micro_batch_size,
        seq_length=seq_length,
        micro_batches=max(rows // section.micro_batch_size, 1),
        recompute=str(section.recompute_granularity),
        recompute_method=str(section.recompute_method),
        recompute_layers=section.recompute_num_layers,
        dropout=section.hidden_dropout > 0,
        vocab_divisible_by=cfg.model.make_vocab_size_divisible_by,
        frozen_copies=spec.frozen_models(section, inputs, lora),
        lora_params=lora,
    )
