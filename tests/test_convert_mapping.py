"""The Llama-family table: every HF tensor read once, every Megatron tensor made once, fused
layouts and TP shards exact in both directions, and clear refusals."""

import math
from collections import Counter
from typing import Iterator, Mapping

import pytest
import torch
from megatron_ranks import saved_state, tiny_hf_model
from transformers import Gemma2Config, Gemma3TextConfig

from alignflow.job.convert.layout import merge_fc1, merge_hf_qkv, merge_qkv, split_fc1, split_hf_qkv, split_qkv
from alignflow.job.convert.families import model_shape
from reference_convert import (
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
    shard,
    stage_layers,
    stage_params,
    unshard,
)

# GQA untied, tied, qkv bias, q/k norms, every bias, sandwich norms, post-norm with whole q/k norms, fused qkv_proj / gate_up_proj, experts
CASES = [
    "llama",
    "llama_tied",
    "qwen2",
    "qwen3_tied_bias",
    "llama_biases",
    "gemma2",
    "gemma3",
    "olmo2_tied_bias",
    "phi4_partial_tied",
    "mixtral",
    "qwen3_moe",
]
LAYER_NAMES = [
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict:
    """Each case's HF state as saved on disk, and its config."""
    states = {}
    for case in CASES:
        model, config = tiny_hf_model(case)
        states[case] = (saved_state(model, tmp_path_factory.mktemp(case)), config)
    return states


class Reads(Mapping):
    """An HF state that counts how often each tensor is read."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state, self.counts = state, Counter()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.counts[name] += 1
        return self.state[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def test_megatron_names(hf):
    layers = {f"decoder.layers.{i}.{name}" for i in range(4) for name in LAYER_NAMES}
    ends = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    assert set(hf_to_megatron(*hf["llama"], 0, 1, 0, 1)) == layers | ends | {"output_layer.weight"}
    qkv_bias = {f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(4)}
    assert set(hf_to_megatron(*hf["qwen2"], 0, 1, 0, 1)) == layers | ends | qkv_bias  # tied: no output layer


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_every_hf_tensor_is_read_once_and_every_megatron_tensor_made_once(hf, case, pp):
    hf_state, config = hf[case]
    shape = model_shape(config)
    reads = Reads(hf_state)
    for pp_rank in range(pp):
        names = [param.megatron_name(*local) for param, _, local in stage_params(shape, pp_rank, pp)]
        assert len(names) == len(set(names))
        assert set(hf_to_megatron(reads, config, 0, 1, pp_rank, pp)) == set(names)
    tied_copy = Counter({"model.embed_tokens.weight": 1} if shape.tied_embeddings and pp > 1 else {})
    assert reads.counts == Counter(dict.fromkeys(hf_state, 1)) + tied_copy  # the last stage's output copy


MOE_LAYER_NAMES = [
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "pre_mlp_layernorm.weight",
    "mlp.router.weight",
    *(f"mlp.experts.local_experts.{e}.{fc}.weight" for e in range(4) for fc in ("linear_fc1", "linear_fc2")),
]


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_moe_megatron_names_and_experts_split_over_ep(hf, case):
    hf_state, config = hf[case]
    extra = {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"} if case == "qwen3_moe" else set()
    names = set(hf_to_megatron(hf_state, config, 0, 1, 0, 1))
    assert names == {f"decoder.layers.{i}.{n}" for i in range(4) for n in [*MOE_LAYER_NAMES, *extra]} | {
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    }
    experts = "block_sparse_moe.experts.{e}.w{w}" if case == "mixtral" else "mlp.experts.{e}.{w}_proj"
    gate, up, down = ("1", "3", "2") if case == "mixtral" else ("gate", "up", "down")
    for ep_rank in range(2):  # EP rank r holds experts 2r, 2r + 1 as its local experts 0, 1
        local = hf_to_megatron(hf_state, config, 0, 1, 0, 1, ep_rank=ep_rank, ep_size=2)
        assert not any("local_experts.2." in n for n in local)
        for e in range(2):
            hf_name = f"model.layers.1.{experts}.weight"
            fc1 = local[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            assert torch.equal(
                fc1, torch.cat([hf_state[hf_name.format(e=2 * ep_rank + e, w=gate)], hf_state[hf_name.format(e=2 * ep_rank + e, w=up)]])
            )
            assert torch.equal(
                local[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"], hf_state[hf_name.format(e=2 * ep_rank + e, w=down)]
            )
    with pytest.raises(ValueError, match="num_experts=4 does not split over EP=3"):
        hf_to_megatron(hf_state, config, 0, 1, 0, 1, ep_rank=0, ep_size=3)


def test_pipeline_stages_number_layers_locally(hf):
    hf_state, config = hf["llama"]
    second = hf_to_megatron(hf_state, config, 0, 1, 1, 2)
    assert torch.equal(second["decoder.layers.0.self_attention.linear_proj.weight"], hf_state["model.layers.2.self_attn.o_proj.weight"])
    assert "embedding.word_embeddings.weight" not in second and "output_layer.weight" in second


def test_stage_layers_follow_megatron():
    shape = model_shape(tiny_hf_model("llama")[1])
    assert [stage_layers(shape, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    interleaved = [stage_layers(shape, r, 2, vp, 2) for vp in range(2) for r in range(2)]
    assert interleaved == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (4, 1)])  # GQA, MHA, MQA
def test_qkv_merge_and_split_are_exact_inverses(heads, groups):
    head_dim, hidden, per_group = 8, 32, heads // groups
    for rest in [(hidden,), ()]:  # weight and bias
        q, k, v = (torch.randn(n * head_dim, *rest) for n in (heads, groups, groups))
        fused = merge_qkv(q, k, v, heads, groups, head_dim)
        assert fused.shape == ((heads + 2 * groups) * head_dim, *rest)
        group0 = torch.cat([q[: per_group * head_dim], k[:head_dim], v[:head_dim]])
        assert torch.equal(fused[: (per_group + 2) * head_dim], group0)  # [q_g; k_g; v_g] per group
        assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups, head_dim), (q, k, v)))


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (4, 1)])
def test_phi3_fused_qkv_proj_regroups_as_separate_q_k_v_would(heads, groups):
    """HF's qkv_proj is [all q; all k; all v] (Phi3Attention slices it so): Megatron's layout of
    it is that of the three projections, and back."""
    head_dim, hidden = 8, 32
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, groups, groups))
    fused = merge_hf_qkv(torch.cat([q, k, v]), heads, groups, head_dim)
    assert torch.equal(fused, merge_qkv(q, k, v, heads, groups, head_dim))
    assert torch.equal(split_hf_qkv(fused, heads, groups, head_dim), torch.cat([q, k, v]))


def test_olmo2_and_phi3_names(hf):
    olmo = set(hf_to_megatron(*hf["olmo2_tied_bias"], 0, 1, 0, 1))
    assert "decoder.layers.0.post_self_attn_layernorm.weight" in olmo and "decoder.layers.0.post_mlp_layernorm.weight" in olmo
    assert not any("layer_norm_weight" in name for name in olmo)  # post-norm: no norm before attention or the MLP
    assert "decoder.layers.3.self_attention.q_layernorm.weight" in olmo and "decoder.layers.3.self_attention.linear_proj.bias" in olmo
    hf_state, config = hf["phi4_partial_tied"]
    phi = hf_to_megatron(hf_state, config, 0, 1, 0, 1)
    assert torch.equal(phi["decoder.layers.1.mlp.linear_fc1.weight"], hf_state["model.layers.1.mlp.gate_up_proj.weight"])  # [gate; up] both
    q, k, v = hf_state["model.layers.1.self_attn.qkv_proj.weight"].split([64, 32, 32])
    assert torch.equal(phi["decoder.layers.1.self_attention.linear_qkv.weight"], merge_qkv(q, k, v, 4, 2, 16))


def test_olmo2_whole_qk_norms_split_over_tp_with_their_heads(hf):
    """Each TP rank normalizes its own heads: it holds their slice of the q/k norm weight."""
    hf_state, config = hf["olmo2_tied_bias"]
    for r in range(2):
        mine = hf_to_megatron(hf_state, config, r, 2, 0, 1)
        for which in ("q", "k"):
            expected = hf_state[f"model.layers.2.self_attn.{which}_norm.weight"].chunk(2)[r]
            assert torch.equal(mine[f"decoder.layers.2.self_attention.{which}_layernorm.weight"], expected)


def test_phi3_config_reads_window_and_partial_rotary():
    assert model_shape(tiny_hf_model("phi3_window")[1]).sliding_window == 4
    shape = model_shape(tiny_hf_model("phi4_partial_tied")[1])
    assert (shape.rotary_percent, shape.fused_projections, shape.tied_embeddings) == (0.75, True, True)
    older = {**tiny_hf_model("phi3_window")[1], "rope_parameters": None, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    assert model_shape(older).rotary_percent == 0.5  # a config.json from before transformers 5


@pytest.mark.parametrize("case,rotary_dim", [("phi3_longrope", 16), ("phi4_mini_longrope", 12)])
def test_longrope_reads_hf_attention_factor(case, rotary_dim):
    """HF's default: sqrt(1 + ln(max / original max) / ln(original max)), read back from HF's
    own rotary embedding; Phi3Config's own original_max_position_embeddings wins over
    rope_parameters' (the tiny cases set both). Phi-4-mini rotates 12 of 16 dims: 6 factors."""
    hf_model, config = tiny_hf_model(case)
    shape = model_shape(config)
    assert (shape.rope_type, shape.rope_original_max, shape.rotary_dim, len(shape.rope_short_factor)) == ("longrope", 32, rotary_dim, rotary_dim // 2)
    assert shape.rope_attention_factor == hf_model.model.rotary_emb.attention_scaling == pytest.approx((1 + math.log(2) / math.log(32)) ** 0.5)
    assert shape.softmax_scale is None  # the factor is on the rotated dims (`RotaryScale`), not on the scores


def test_fc1_merge_and_split_are_exact_inverses():
    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    fused = merge_fc1(gate, up)
    assert torch.equal(fused[:64], gate)
    assert all(torch.equal(a, b) for a, b in zip(split_fc1(fused), (gate, up)))


def test_a_tp_rank_takes_whole_query_groups_and_its_slice_of_gate_and_up():
    heads, groups, head_dim, hidden = 4, 2, 8, 32
    q, k, v = (torch.randn(n * head_dim, hidden) for n in (heads, groups, groups))
    gate, up, proj = torch.randn(64, hidden), torch.randn(64, hidden), torch.randn(hidden, heads * head_dim)
    for r in range(2):
        mine = merge_qkv(q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r], heads // 2, groups // 2, head_dim)
        assert torch.equal(shard("decoder.layers.0.self_attention.linear_qkv.weight", merge_qkv(q, k, v, heads, groups, head_dim), r, 2), mine)
        assert torch.equal(shard("decoder.layers.0.mlp.linear_fc1.weight", merge_fc1(gate, up), r, 2), merge_fc1(gate.chunk(2)[r], up.chunk(2)[r]))
        assert torch.equal(shard("decoder.layers.0.self_attention.linear_proj.weight", proj, r, 2), proj.chunk(2, dim=1)[r])


@pytest.mark.parametrize("case", CASES)
def test_tp_shards_concatenate_to_the_full_tensor(hf, case):
    hf_state, config = hf[case]
    full = hf_to_megatron(hf_state, config, 0, 1, 0, 1)
    shards = [hf_to_megatron(hf_state, config, r, 2, 0, 1) for r in range(2)]
    assert all(s.keys() == full.keys() for s in shards)
    for name, tensor in full.items():
        gathered = unshard(name, [s[name] for s in shards], model_shape(config).qk_norm_whole)
        rows = tensor.shape[0]
        assert torch.equal(gathered[:rows], tensor), name
        assert not gathered[rows:].any(), name  # vocab: TP2 pads further, with zeros


@pytest.mark.parametrize("case", CASES)
def test_hf_to_megatron_to_hf_through_tp2_is_exact(hf, case):
    hf_state, config = hf[case]
    shards = [hf_to_megatron(hf_state, config, r, 2, 0, 1) for r in range(2)]
    whole = model_shape(config).qk_norm_whole
    back = megatron_to_hf({name: unshard(name, [s[name] for s in shards], whole) for name in shards[0]}, config)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], hf_state[name]) for name in hf_state)


def test_tp_must_split_query_groups_whole(hf):
    with pytest.raises(ValueError, match="num_query_groups=2 does not split over TP=4"):
        hf_to_megatron(*hf["llama"], 0, 4, 0, 1)


def test_megatron_to_hf_refuses_tensors_it_does_not_know(hf):
    hf_state, config = hf["llama"]
    full = {**hf_to_megatron(hf_state, config, 0, 1, 0, 1), "decoder.layers.0.mlp.linear_fc2.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="linear_fc2.bias"):
        megatron_to_hf(full, config)


def test_vocab_is_padded_to_a_multiple_of_128_times_tp():
    assert [padded_vocab_size(100, tp) for tp in (1, 2)] == [128, 256]
    assert padded_vocab_size(32000, 8) == 32768 and padded_vocab_size(151936, 1) == 151936


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(
        ValueError,
        match="'GPT2LMHeadModel'; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM",
    ):
        model_shape({**tiny_hf_model("llama")[1], "architectures": ["GPT2LMHeadModel"]})


def test_gemma_sandwich_norms_map_to_the_post_norms_of_the_projections(hf):
    """HF's post_attention_layernorm is Gemma's post-attention norm (Llama's pre-MLP one), its
    pre_feedforward_layernorm the pre-MLP norm; weights as stored (zero-centered, no + 1)."""
    hf_state, config = hf["gemma3"]
    megatron = hf_to_megatron(hf_state, config, 0, 1, 0, 1)
    layer = "decoder.layers.1."
    for name, hf_name in [
        ("self_attention.linear_proj.post_layernorm.weight", "post_attention_layernorm.weight"),
        ("mlp.linear_fc1.layer_norm_weight", "pre_feedforward_layernorm.weight"),
        ("mlp.linear_fc2.post_layernorm.weight", "post_feedforward_layernorm.weight"),
        ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ]:
        assert torch.equal(megatron[layer + name], hf_state["model.layers.1." + hf_name]), name


@pytest.mark.parametrize(
    "config_cls,legacy",
    [
        (
            Gemma3TextConfig,
            {
                "rope_theta": 1e6,
                "rope_local_base_freq": 1e4,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "sliding_window_pattern": 3,
                "num_hidden_layers": 7,
            },
        ),
        (Gemma2Config, {"rope_theta": 1e4, "num_hidden_layers": 5}),
    ],
)
def test_gemma_configs_without_layer_types_read_as_transformers_reads_them(config_cls, legacy):
    """A config.json of transformers 4 (no `layer_types`, no per-layer-type `rope_parameters`)
    gives the shape of the config transformers 5 makes of it."""
    architecture = {Gemma3TextConfig: "Gemma3ForCausalLM", Gemma2Config: "Gemma2ForCausalLM"}[config_cls]
    written = {
        "architectures": [architecture],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 100,
        "max_position_embeddings": 64,
        **legacy,
    }
    shape = model_shape(written)
    assert shape == model_shape({**config_cls(**written).to_dict(), "architectures": [architecture]})
    assert sum(shape.window_layers) < len(shape.window_layers) and any(shape.window_layers)


@pytest.mark.parametrize(
    "case,change,message",
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'yarn'"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3 rope scaling without low_freq_factor"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True: per-layer sliding windows"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window=True: per-layer sliding windows"),
        (
            "phi4_partial_tied",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.75,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                    "original_max_position_embeddings": 32,
                }
            },
            r"longrope rope_parameters.short_factor has 8 factors; the model's 12 rotary dims per head \(head_dim x partial_rotary_factor 0.75\) take 6",
        ),
        (
            "phi3_window",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}, "original_max_position_embeddings": None},
            "longrope rope scaling without original_max_position_embeddings or short_factor",
        ),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5: LlamaForCausalLM is mapped with RoPE over whole heads"),
        ("olmo2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("gemma2", {"attention_bias": True}, "attention_bias=True: Gemma's attention biases are not mapped"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True: bidirectional attention"),
        ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu': Gemma2ForCausalLM maps only 'gelu_pytorch_tanh'"),
        ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types=.*one of 'sliding_attention', 'full_attention'"),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                }
            },
            "rope_type 'linear' on sliding_attention layers",
        ),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "rope_type 'yarn'",
        ),
        ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "'Gemma3ForConditionalGeneration': the multimodal Gemma 3"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: dense layers among the MoE layers are not mapped"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2: dense layers among the MoE layers are not mapped"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1: router jitter noise"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_config_fails_clearly(case, change, message):
    with pytest.raises(ValueError, match=message):
        model_shape({**tiny_hf_model(case)[1], **change})
