"""Build a Megatron-Core GPTModel from an HF Llama-family config; move states in and out of it.

Supported: what `alignflow.convert.llama` supports (Llama, Mistral, Qwen2: GQA, tied or
untied embeddings, qkv bias, RMSNorm, SwiGLU, RoPE with linear or llama3 scaling, Mistral's
sliding window), under TP, PP (with virtual chunks) and, with Transformer Engine, CP.
Layer spec: Transformer Engine's where it is importable (GPU clusters), else Megatron's local
modules (CPU, with `cpu_shim`). Fusions stay at Megatron's defaults (off).

Packed rows (several documents per row) never attend across documents (`document_params`):
with Transformer Engine they run as THD packed sequences (cu_seqlens per document, no mask,
RoPE restarting per document); on the local spec each document attends on its own
(`DocumentWindowAttention`: cost sum(document^2), not rows x length^2), or, on Megatron's own
path, through the explicit block-diagonal mask, which a sliding window (Mistral) narrows
further instead of replacing.

The two specs name the norms differently in `state_dict()` (local: `input_layernorm.weight`;
TE and every checkpoint: `self_attention.linear_qkv.layer_norm_weight`), so states enter and
leave a model under checkpoint names (`load_megatron_state`, `megatron_state`), the names
`alignflow.convert` produces.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import utils as transformer_utils
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model
from torch import Tensor

from alignflow.convert.llama import ModelShape, model_shape
from alignflow.convert.sharding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size, stage_ends
from alignflow.device import device
from alignflow.megatron.runtime import parallel_sizes

# TransformerConfig settings where CUDA is absent.
CPU_SETTINGS = {
    "batch_p2p_sync": False,  # it calls torch.cuda.synchronize
    # On gloo, the interleaved (virtual PP) schedule's batched isend/irecv pairs activations and
    # gradients of the same shape in the wrong order; one op at a time in Megatron's fixed
    # even/odd order is exact.
    "batch_p2p_comm": False,
}

# HF rope type -> GPTModel arguments, given the HF scaling factor.
ROPE_ARGS = {
    "default": lambda factor: {},
    "linear": lambda factor: {"seq_len_interpolation_factor": factor},
    "llama3": lambda factor: {"rope_scaling": True, "rope_scaling_factor": factor},
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
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        window_size=None if shape.sliding_window is None else (shape.sliding_window - 1, 0),  # HF: i - j < window
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
        moe_token_dispatcher_type="alltoall",
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # On the CPU the weights are built from the full weight (TP ranks agree); elsewhere on the rank's device.
        use_cpu_initialization=device().type == "cpu",
        **({} if torch.cuda.is_available() else CPU_SETTINGS),
    )
    return TransformerConfig(**{**settings, **overrides})


class DocumentWindowAttention(DotProductAttention):
    """Megatron's local attention confined to each document of a packed row, narrowed by the
    sliding window, computed by torch's fused `scaled_dot_product_attention` (fp32, or without
    gradients) where no dropout applies: each document on its own (`Documents`, from
    `document_params`), so the other documents cost nothing; without document offsets, the
    given mask (documents, causal) narrowed by the window.

    Megatron's softmax swaps a given mask for the window mask when the model has a window, so
    the documents of a packed row would see each other; here the window narrows the mask, and
    without one (KV-cached decoding) the window alone applies. Megatron's own path (scores,
    fp32 softmax, dropout under the TP RNG tracker, the mask) runs with attention dropout and
    for bf16 training, so those stay bit-reproducible across resumes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.window_size, self.scale_mask_softmax.window_size = self.scale_mask_softmax.window_size, None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], *args,
                packed_seq_params: Optional[PackedSeqParams] = None, **kwargs):
        dropout = self.training and self.attention_dropout.p > 0
        bf16_backward = torch.is_grad_enabled() and query.dtype != torch.float32  # its CPU kernel is not bit-reproducible
        if dropout or bf16_backward or self.softmax_offset is not None or (attention_mask is None and packed_seq_params is None and query.shape[0] > 1):
            attention_mask = window_narrowed(attention_mask, self.window_size, query.shape[0], key.shape[0])  # query [sq, b, ...]
            return super().forward(query, key, value, attention_mask, *args, **kwargs)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        if packed_seq_params is not None:
            return self._per_document(query, key, value, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        attention_mask = window_narrowed(attention_mask, self.window_size, query.shape[0], key.shape[0])
        allowed = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [sq, b, heads * dim]

    def _per_document(self, query: Tensor, key: Tensor, value: Tensor, documents: "Documents") -> Tensor:
        """[s, b, heads, dim] -> [s, b, heads * dim], each document attending causally within itself."""
        s, b, heads, dim = query.shape
        flat = [t.transpose(0, 1).reshape(b * s, heads, dim) for t in (query, key, value)]
        out = per_document_attention(*flat, documents, self.window_size, self.softmax_scale)
        return out.reshape(b, s, heads * dim).transpose(0, 1)


def window_narrowed(attention_mask: Optional[Tensor], window_size: Optional[tuple], queries: int, keys: int) -> Optional[Tensor]:
    """A mask (True = masked) narrowed by Megatron's sliding `window_size`: the window alone
    without a mask, the mask alone without a window."""
    if window_size is None:
        return attention_mask
    window = transformer_utils.get_sliding_window_causal_mask(queries, keys, window_size)
    return window if attention_mask is None else attention_mask | window.to(attention_mask.device)


def per_document_attention(q: Tensor, k: Tensor, v: Tensor, documents: "Documents", window_size: Optional[tuple],
                           scale: Optional[float]) -> Tensor:
    """Flattened rows' queries, keys and values [b * s, heads, dim] -> [b * s, heads, dim], each
    document attending causally within itself (narrowed by Megatron's `window_size`): one fused
    attention call per group of documents padded to one length (`Documents.groups`)."""
    heads, dim = q.shape[1:]
    parts = []
    for length, where, real in documents.groups:
        qg, kg, vg = (t[where].view(-1, length, heads, dim).transpose(1, 2) for t in (q, k, v))  # [docs, heads, length, dim]
        window = None if window_size is None else ~transformer_utils.get_sliding_window_causal_mask(length, length, window_size)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=window, is_causal=window is None, scale=scale).transpose(1, 2)
        parts.append(out.reshape(length, heads, dim) if real is None else out[real])  # each document's own positions
    return torch.cat(parts)[documents.order]  # back to the flattened rows' order


ALONE = 128  # documents longer than this attend in a call of their own (its overhead is small beside them)


@dataclass
class Documents(PackedSeqParams):
    """`PackedSeqParams` for `DocumentWindowAttention`: the documents at `cu_seqlens_q` of the
    flattened rows, grouped once per forward (every layer reuses it) by length: documents up to
    ALONE tokens by their length rounded up to a power of two (>= 16), gathered and padded at
    their end (causal attention never lets a real token see its padding), so short documents
    do not cost a call each; longer ones alone, as views. `worthwhile`: whether that beats one
    masked call over the whole rows (it does not on rows of a few short documents)."""

    rows: int = 1

    @cached_property
    def lengths(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each document's start, length and group length (numpy: a batch's few documents,
        without torch's per-op overhead)."""
        cu = self.cu_seqlens_q.cpu().numpy().astype(np.int64)
        starts, lengths = cu[:-1], np.diff(cu)
        rounded = np.maximum(16, 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64))
        return starts, lengths, np.where(lengths > ALONE, lengths, rounded)

    @cached_property
    def plan(self) -> list[tuple[int, np.ndarray | slice, np.ndarray | None]]:
        """(length, gather index [documents, length] or a long document's slice, real-position
        mask [documents, length] or None for a slice), on the host."""
        starts, lengths, grouped = self.lengths
        plan = [(int(n), slice(int(a), int(a + n)), None) for a, n in zip(starts, lengths) if n > ALONE]
        short = lengths <= ALONE
        for length in np.unique(grouped[short]).tolist():
            picked = (grouped == length) & short
            offsets = np.arange(length)
            real = offsets[None] < lengths[picked, None]
            plan.append((length, np.where(real, starts[picked, None] + offsets[None], starts[picked, None]), real))
        return plan

    @cached_property
    def groups(self) -> list[tuple[int, Tensor | slice, Tensor | None]]:
        """`plan` with its index and mask tensors on the documents' device, where attention gathers."""
        on = self.cu_seqlens_q.device
        return [(n, where if real is None else torch.from_numpy(where).to(on), None if real is None else torch.from_numpy(real).to(on))
                for n, where, real in self.plan]

    @cached_property
    def order(self) -> Tensor:
        """Where each flattened position lies in the groups' concatenated outputs."""
        positions = np.concatenate([np.arange(where.start, where.stop) if real is None else where[real] for _, where, real in self.plan])
        order = np.empty_like(positions)
        order[positions] = np.arange(len(positions))
        return torch.from_numpy(order).to(self.cu_seqlens_q.device)

    @cached_property
    def worthwhile(self) -> bool:
        """Attention work (query x key pairs, a call counted as 64^2) at most half the mask's."""
        _, lengths, grouped = self.lengths
        calls = int((lengths > ALONE).sum()) + len(np.unique(grouped[lengths <= ALONE]))
        return 2 * (int((grouped ** 2).sum()) + calls * 64 * 64) <= self.rows * self.max_seqlen_q ** 2


def token_nll(model, tokens: Tensor, position_ids: Tensor, attention_mask: Optional[Tensor], labels: Tensor, **kwargs) -> Tensor:
    """Per-token cross entropy [b, s] from a GPTModel chunk on the last pipeline stage (its
    hidden states elsewhere; the logits when `labels` is None). At TP=1 torch's fused cross_entropy on the logits: Megatron's
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


def document_params(batch: dict) -> Optional[PackedSeqParams]:
    """Where the documents of a batch of packed rows lie (`cu_seqlens` of the flattened rows):
    THD sequences for Transformer Engine's attention (the batch runs as one row [1, b * s]),
    else the same offsets on the [s, b] layout for `DocumentWindowAttention` (max_seqlen is
    then the row's length, which GPTModel computes RoPE for), or None where one masked call
    over the rows costs less (`Documents.worthwhile`): the batch's mask then applies."""
    cu_seqlens = batch["cu_seqlens"].to(torch.int32)
    if packed_thd():
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])
    rows, length = batch["tokens"].shape
    documents = Documents(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=length, max_seqlen_kv=length,
                          rows=rows)
    return documents if documents.worthwhile else None


def layer_spec() -> ModuleSpec:
    """Transformer Engine's fused layers where importable (GPU clusters), else Megatron's own."""
    if packed_thd():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = DocumentWindowAttention
    return spec


def build_gpt(
    hf_config: Mapping[str, Any],
    parallel_cfg: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY,
    parallel_output: bool = True,
    **overrides,
) -> Union[GPTModel, list[GPTModel]]:
    """This rank's GPTModel (its pipeline stage), or its list of chunks with virtual PP.

    Call after `runtime.init_parallel`. `parallel_output` keeps logits vocab-parallel (for
    Megatron's vocab-parallel cross entropy); pass `runtime_gather_output=True` to forward
    for full logits."""
    shape = model_shape(hf_config)
    config = transformer_config(shape, parallel_cfg, params_dtype=params_dtype, **overrides)
    vp_size = config.virtual_pipeline_model_parallel_size
    common = dict(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by),
        max_sequence_length=shape.max_position_embeddings,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=shape.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        **ROPE_ARGS[shape.rope_type](shape.rope_factor),
    )
    chunks = [_build_chunk(common, vp_stage, vp_size) for vp_stage in (range(vp_size) if vp_size else [None])]
    return chunks if vp_size else chunks[0]


def _build_chunk(common: dict, vp_stage: Optional[int], vp_size: Optional[int]) -> GPTModel:
    pre, post = stage_ends(
        parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size(), vp_stage, vp_size
    )
    model = GPTModel(pre_process=pre, post_process=post, vp_stage=vp_stage, **common)
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
