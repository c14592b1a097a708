"""Megatron models built from HF weights compute HF's logits (fp32, max abs 1e-5): one rank
in this process, and TP2 / PP2 / PP2 with virtual chunks on 2 ranks (tests/ranks.py)."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron_ranks import CASES, TOLERANCE, converted_chunks, max_logit_error, max_logprob_error, parallel_cfg, saved_state, tiny_hf_model, tokens
from ranks import run_ranks

from reference_convert import hf_to_megatron, megatron_to_hf
from alignflow.job.device import device, to_device
from alignflow.job.model import runtime
from alignflow.job.model.decoder import LeanForward
from alignflow.job.model.gpt import build_gpt, checkpoint_names, document_params, load_megatron_state, megatron_state, token_nll
from alignflow.job.forward.objectives import sft_forward
from alignflow.job.train.data import packed_rows

RANKS_SCRIPT = Path(__file__).with_name("megatron_ranks.py")
# every family trait over TP and PP (OLMo 2's whole-projection q/k norms all-reduced over TP, Phi-4-mini's partial rotary, longrope,
# and the two together: longrope's attention factor on the rotated dims only)
TWO_RANK_CASES = [
    "llama",
    "qwen2",
    "qwen3_tied_bias",
    "llama_biases",
    "mistral_window",
    "llama3_rope_other",
    "gemma2",
    "gemma3",
    "olmo2_tied_bias",
    "phi4_partial_tied",
    "phi3_longrope",
    "phi4_mini_longrope",
    "qwen3_moe",
]
EP_CASES = ["mixtral", "qwen3_moe_unnormed"]  # the two routers, experts split over EP


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_rank_logits_match_hf(one_rank, case, tmp_path):
    assert max_logit_error(case, one_rank, saved_state(tiny_hf_model(case)[0], tmp_path)) < TOLERANCE


@pytest.mark.parametrize("case", ["llama", "qwen3_tied_bias"])
def test_one_rank_token_logprobs_are_hfs_over_the_real_vocab(one_rank, case, tmp_path):
    """Per-token log-probs (`token_nll`) equal HF's log_softmax over its 100 tokens, not over
    Megatron's 128 padded rows (which generation never samples)."""
    assert max_logprob_error(case, one_rank, saved_state(tiny_hf_model(case)[0], tmp_path)) < TOLERANCE


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_importance_weight_is_1_before_any_update_on_a_padded_vocab(one_rank, temperature, tmp_path):
    """GRPO's importance weight exp(training logp - generation logp) is 1 when the policy has not
    moved: generation samples over the real 100 tokens, and GRPO's training forward (Megatron's
    vocab-parallel cross entropy at the generation temperature) now normalises over them too,
    not over the 128 padded rows (weights below 1 before)."""
    from alignflow.job.generation import Sampling, generate
    from alignflow.job.stages.grpo import UNFILTERED, nll_forward

    hf_model, config = tiny_hf_model("llama")
    model = converted_chunks(config, one_rank, saved_state(hf_model, tmp_path))[0]
    prompts = tokens(batch=4, seq=6).tolist()
    torch.manual_seed(0)
    sampling = Sampling(max_new_tokens=8, eos_id=config["vocab_size"], vocab_size=config["vocab_size"], temperature=temperature)
    rows = []
    for prompt, completion in zip(prompts, generate([model], prompts, sampling, batch_size=4, seed=3)):
        ids = np.array(prompt + completion.tokens)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(completion.tokens))]
        rows.append(((ids, mask, np.array([0, len(ids)])), completion.sampling_logps))
    batch = vars(packed_rows([row for row, _ in rows], length=14, pad_id=0))
    with torch.no_grad():
        training = -nll_forward(sampling, (UNFILTERED,))(model, batch)
    for i, (_, generation_logps) in enumerate(rows):
        picked = training[i, 5 : 5 + len(generation_logps)]
        torch.testing.assert_close(picked.exp() / torch.tensor(generation_logps).exp(), torch.ones(len(generation_logps)), atol=1e-5, rtol=1e-5)


def test_packed_documents_of_a_sliding_window_model_match_hf_one_by_one(one_rank, tmp_path):
    """A packed row of three documents through Mistral with a 4-token window (`sft_forward`):
    each document's per-token loss equals HF's on that document alone. Megatron's own
    attention replaced the documents' mask by the window, so documents saw their neighbours."""
    hf_model, config = tiny_hf_model("mistral_window")
    model = converted_chunks(config, one_rank, saved_state(hf_model, tmp_path))[0]
    cu, ids = np.array([0, 9, 20, 27]), tokens(batch=1, seq=27)[0].numpy()  # then 5 tokens of padding
    batch = to_device(vars(packed_rows([(ids, np.ones(27), cu)], length=32, pad_id=0)))
    with torch.no_grad():
        per_token = sft_forward(model, batch)[0]
        for a, e in zip(cu, cu[1:]):
            logits = hf_model(torch.as_tensor(ids[a:e])[None]).logits[0, :-1]  # the real vocab (100; Megatron's is padded to 128)
            expected = F.cross_entropy(logits, torch.as_tensor(ids[a + 1 : e]), reduction="none")
            torch.testing.assert_close(per_token[a : e - 1].cpu(), expected, atol=1e-5, rtol=1e-5)
        leaked = sft_forward(model, dict(batch, cu_seqlens=torch.tensor([0, 32], device=device()), max_seqlen=32))[0]  # the window alone, as before
        assert not torch.allclose(leaked[cu[1] : cu[1] + 3], per_token[cu[1] : cu[1] + 3], atol=1e-3)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lean_forward_matches_hf_on_each_document_of_a_packed_row(one_rank, case, tmp_path):
    """`LeanForward`, the one-rank forward of forward-only passes and fp32 training, on a
    packed row of three documents: each document's per-token loss equals HF's on that document
    alone, and its gradients (of the summed loss, per weight) Megatron's own forward's. Never
    used where either differs."""
    hf_model, config = tiny_hf_model(case)
    model = converted_chunks(config, one_rank, saved_state(hf_model, tmp_path))[0]
    cu, ids = np.array([0, 9, 20, 27]), tokens(batch=1, seq=27)[0].numpy()  # then 5 tokens of padding
    batch = to_device(vars(packed_rows([(ids, np.ones(27), cu)], length=32, pad_id=0)))
    documents = document_params(batch)
    inputs, loss_mask = (batch["tokens"], batch["position_ids"]), batch["loss_mask"]
    lean = LeanForward.of([model], 32)
    with torch.no_grad():
        per_document = token_nll(lean, *inputs, None, batch["labels"], packed_seq_params=documents)[0]
    for a, e in zip(cu, cu[1:]):
        with torch.no_grad():
            logits = hf_model(torch.as_tensor(ids[a:e])[None]).logits[0, :-1]
        expected = F.cross_entropy(logits, torch.as_tensor(ids[a + 1 : e]), reduction="none")  # over the real vocab
        torch.testing.assert_close(per_document[a : e - 1].cpu(), expected, atol=1e-5, rtol=1e-5)
    gradients = []
    for forward in (lean, model):
        model.zero_grad()
        (token_nll(forward, *inputs, None, batch["labels"], packed_seq_params=documents) * loss_mask).sum().backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in gradients[0].items():
        torch.testing.assert_close(grad, gradients[1][name], atol=1e-5, rtol=1e-4, msg=name)
    model.config.recompute_granularity = "full"
    assert LeanForward.of([model], 32) is None  # recomputed activations: Megatron's path
    with torch.no_grad():
        assert LeanForward.of([model], 32) is not None  # nothing to recompute without gradients


def test_local_spec_norms_load_under_checkpoint_names(one_rank, tmp_path):
    hf_model, config = tiny_hf_model("qwen2")
    [model] = build_gpt(config, one_rank)
    names = checkpoint_names(model)
    assert names["decoder.layers.0.input_layernorm.weight"] == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert names["decoder.layers.0.pre_mlp_layernorm.weight"] == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert set(hf_to_megatron(saved_state(hf_model, tmp_path), config, 0, 1, 0, 1)) == set(names.values())
    assert model.embedding.word_embeddings.weight.shape == (128, 64)  # vocab 100 padded to 128


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_through_a_megatron_model_and_back_is_exact(one_rank, case, tmp_path):
    hf_model, config = tiny_hf_model(case)
    hf_state = saved_state(hf_model, tmp_path)
    [model] = build_gpt(config, one_rank)
    load_megatron_state(model, hf_to_megatron(hf_state, config, 0, 1, 0, 1))
    back = megatron_to_hf(megatron_state(model), config)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], hf_state[name]) for name in hf_state)


def test_load_refuses_a_state_that_does_not_match(one_rank, tmp_path):
    hf_model, config = tiny_hf_model("llama")
    state = hf_to_megatron(saved_state(hf_model, tmp_path), config, 0, 1, 0, 1)
    del state["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="missing .*decoder.layers.1.mlp.linear_fc2.weight"):
        load_megatron_state(build_gpt(config, one_rank)[0], state)


def test_seeds_make_init_reproducible_and_the_rng_tracker_runs_on_cpu(one_rank):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    config = tiny_hf_model("llama")[1]

    def init(seed: int) -> dict:
        runtime.seed_all(seed)
        return megatron_state(build_gpt(config, one_rank)[0])

    first, second, other = init(7), init(7), init(8)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["output_layer.weight"], other["output_layer.weight"])
    outer = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():  # the 'model-parallel-rng' state, on the CPU generator
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer) and not torch.equal(inside, torch.rand(4))


def test_fp32_matmuls_take_tf32_on_cuda_only(monkeypatch):
    """Every rank's `init_parallel` lets CUDA round fp32 matmuls to TF32; on the CPU they stay
    exact (the same switch would let oneDNN round them too)."""
    try:
        for cuda, expected in ((False, "highest"), (True, "high")):
            monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
            runtime.fast_fp32_matmuls()
            assert torch.get_float32_matmul_precision() == expected
    finally:
        torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("case", ["phi3_longrope", "phi4_mini_longrope"])
def test_longrope_past_its_original_positions_is_refused(one_rank, case, tmp_path):
    """Past original_max_position_embeddings (32 here) HF switches the whole sequence to
    long_factor: a forward or a generation that long fails naming the lengths."""
    from alignflow.job.generation import Sampling, generate

    hf_model, config = tiny_hf_model(case)
    model = converted_chunks(config, one_rank, saved_state(hf_model, tmp_path))[0]
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="a sequence of 33 positions passes the longrope model's original_max_position_embeddings=32"),
    ):
        model(tokens(batch=1, seq=33), None, None)
    with pytest.raises(ValueError, match="original_max_position_embeddings=32"):
        generate([model], [list(range(1, 30))], Sampling(max_new_tokens=8, eos_id=-1, vocab_size=100), batch_size=1)


def test_unsupported_architecture_fails_before_building():
    with pytest.raises(ValueError, match="unsupported architecture .GPT2LMHeadModel.; supported: LlamaForCausalLM, "):
        build_gpt({**tiny_hf_model("llama")[1], "architectures": ["GPT2LMHeadModel"]}, parallel_cfg())


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"], ["--pp", "2", "--vp", "2"], ["--ep", "2"]], ids=["tp2", "pp2", "pp2-vp2", "ep2"])
def test_two_ranks_logits_and_greedy_generation_match_hf(layout):
    """Logits at TP2 / PP2 / PP2 with virtual chunks / EP2 (MoE models, Megatron's alltoall
    dispatcher on gloo); KV-cached greedy generation at TP2 and PP2."""
    generate = [] if "--vp" in layout or "--ep" in layout else ["--generate"]
    cases = EP_CASES if "--ep" in layout else TWO_RANK_CASES
    run = run_ranks(2, RANKS_SCRIPT, *layout, *generate, *cases)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    n = len(cases)
    assert run.stdout.count("max |logits - HF|") == n * (1 if "--pp" in layout else 2)  # each last-stage rank, every model
    assert run.stdout.count("max |logp - HF log_softmax over the real vocab|") == (0 if "--pp" in layout else 2 * n)
    assert run.stdout.count("0 greedy completions differ") == (2 * n if generate else 0)  # every rank, every model


def test_gemma_norm_and_embedding_scale_round_as_hfs_in_bf16():
    """Gemma's (1 + w) norm in fp32 cast back, and sqrt(hidden) cast to bf16 before it scales
    the embeddings (sqrt(3072) = 55.43 becomes 55.5), bit for bit as HF's modules."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm, Gemma2TextScaledWordEmbedding

    from alignflow.job.model.gemma import GemmaRMSNorm, embedding_scale

    hidden, generator = 3072, torch.Generator().manual_seed(0)
    hf_norm = Gemma2RMSNorm(hidden, eps=1e-6)
    hf_embedding = Gemma2TextScaledWordEmbedding(10, hidden, 0, embed_scale=hidden**0.5)
    ours = GemmaRMSNorm(SimpleNamespace(params_dtype=torch.float32, sequence_parallel=False), hidden, eps=1e-6)
    with torch.no_grad():
        for weight in (hf_norm.weight, hf_embedding.weight):
            weight.normal_(0.0, 0.5, generator=generator)
        ours.weight.copy_(hf_norm.weight)
    hf_norm, hf_embedding, ours = hf_norm.to(torch.bfloat16), hf_embedding.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(5, hidden, generator=generator).to(torch.bfloat16)
    assert torch.equal(ours(x), hf_norm(x))
    ids = torch.tensor([1, 7, 3])
    embedded = F.embedding(ids, hf_embedding.weight)
    assert embedding_scale(hidden, embedded).item() == 55.5 and torch.equal(embedded * embedding_scale(hidden, embedded), hf_embedding(ids))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2", "--ep", "2"], ["--pp", "2", "--ep", "2"]], ids=["ep2xtp2", "ep2xpp2"])
def test_four_ranks_ep_times_tp_and_pp_logits_match_hf(layout):
    """EP2 x TP2 (experts split over EP, each expert over TP) and EP2 x PP2 on 4 ranks."""
    run = run_ranks(4, RANKS_SCRIPT, *layout, "mixtral")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("max |logits - HF|") == (2 if "--pp" in layout else 4)  # each last-stage rank
