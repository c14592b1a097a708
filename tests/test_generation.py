"""KV-cached sampling on a Megatron model: HF's greedy tokens (mixed prompt lengths in one batch),
seeded sampling, top-k / top-p, both log-probs, refusal of models the decoder does not implement.
(TP2 and PP2 generation: `test_megatron_model.py::test_two_ranks_logits_and_greedy_generation_match_hf`;
EP2 against EP1: tests/generation_ranks.py.)"""

import re
from pathlib import Path

import pytest
import torch
from megatron_ranks import CASES, greedy_mismatches, saved_state, tiny_hf_model
from ranks import run_ranks

from reference_convert import hf_to_megatron
from alignflow.job.device import device
from alignflow.job.generation import Completion, Sampling, generate, sample
from alignflow.job.model.gpt import build_gpt, load_megatron_state
from alignflow.job.stages.grpo import FILTERED, UNFILTERED, Rollouts, nll_forward

PROMPTS = [[5, 9, 42, 7], [8, 8, 30, 2, 11, 6], [5, 9, 42, 7], [3, 3, 3, 3], [1, 2]]


@pytest.fixture(scope="module")
def llama(one_rank, tmp_path_factory):
    hf_model, config = tiny_hf_model("llama")
    [model] = build_gpt(config, one_rank)
    load_megatron_state(model, hf_to_megatron(saved_state(hf_model, tmp_path_factory.mktemp("llama")), config, 0, 1, 0, 1))
    return model.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_equals_hf_generate(one_rank, case, tmp_path):
    assert greedy_mismatches(case, one_rank, saved_state(tiny_hf_model(case)[0], tmp_path)) == 0


def test_sampling_is_reproducible_under_a_seed(llama):
    sampling = Sampling(max_new_tokens=10, eos_id=-1, vocab_size=100, temperature=1.0, top_p=0.95, top_k=40)
    first = generate([llama], PROMPTS, sampling, 2, seed=7)
    other = generate([llama], PROMPTS, sampling, 2, seed=8)
    assert [c.tokens for c in first] != [c.tokens for c in other]
    assert [c.tokens for c in first] == [c.tokens for c in generate([llama], PROMPTS, sampling, 2, seed=7)]
    assert all(len(c.tokens) == 10 and c.truncated for c in first)


def test_top_k_1_and_a_tiny_top_p_are_greedy(llama):
    greedy = [c.tokens for c in generate([llama], PROMPTS, Sampling(8, -1, 100), 4)]
    for sampling in (Sampling(8, -1, 100, temperature=1.0, top_k=1), Sampling(8, -1, 100, temperature=0.7, top_p=1e-6)):
        assert [c.tokens for c in generate([llama], PROMPTS, sampling, 4, seed=1)] == greedy


def test_completions_stop_after_eos(llama):
    greedy = generate([llama], PROMPTS, Sampling(8, -1, 100), 4)
    eos = greedy[0].tokens[2]
    stopped = generate([llama], PROMPTS, Sampling(8, eos, 100), 4)
    assert stopped[0].tokens == greedy[0].tokens[: greedy[0].tokens.index(eos) + 1] and not stopped[0].truncated


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logps_are_the_models_and_sampling_logps_the_filtered_tempered_ones(llama, temperature):
    """Against a full forward of prompt + completion (no cache): logps = log_softmax(logits);
    sampling_logps are under the distribution drawn from, softmax(logits / temperature) renormalised
    over the top 20 tokens (vLLM's processed log-probs, as NeMo-RL v0.6 trains on); greedy: logps."""
    sampling = Sampling(8, -1, 100, temperature=temperature, top_k=20)
    for prompt, completion in zip(PROMPTS, generate([llama], PROMPTS, sampling, 3, seed=3)):
        with torch.no_grad():
            ids = torch.tensor([prompt + completion.tokens], device=device())
            logits = llama(ids, None, None, runtime_gather_output=True)[0, len(prompt) - 1 : -1, :100].cpu()
        chosen = torch.tensor(completion.tokens)[:, None]
        expected = logits.log_softmax(-1).gather(-1, chosen).squeeze(-1)
        tempered = (logits / (temperature or 1.0)).log_softmax(-1)
        kept_mass = tempered.exp().topk(20, dim=-1).values.sum(-1)
        filtered = tempered.gather(-1, chosen).squeeze(-1) - kept_mass.log() if temperature else expected
        assert torch.allclose(torch.tensor(completion.logps), expected, atol=1e-5)
        assert torch.allclose(torch.tensor(completion.sampling_logps), filtered, atol=1e-5)
    assert Completion([1], [-0.5], truncated=True).sampling_logps == [-0.5]


def test_sample_draws_from_the_filtered_tempered_distribution():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(0)).expand(20000, -1).contiguous()
    logits = torch.cat([logits, torch.full((20000, 4), 50.0)], dim=1)  # padded vocab rows: never drawn
    generator = torch.Generator().manual_seed(0)
    tokens, _, _ = sample(logits, Sampling(1, -1, vocab_size=12, temperature=0.5, top_k=5), torch.rand(20000, 1, generator=generator))
    allowed = logits[0, :12].topk(5).indices
    assert torch.isin(tokens, allowed).all()
    expected = (logits[0, allowed] / 0.5).softmax(-1)
    observed = torch.stack([(tokens == t).float().mean() for t in allowed])
    assert torch.allclose(observed, expected, atol=0.02)
    probs = logits[0, :12].softmax(-1)
    ordered = probs.sort(descending=True)
    nucleus = ordered.indices[: int((ordered.values.cumsum(0) < 0.6).sum()) + 1]  # the fewest tokens reaching 0.6
    tokens, _, _ = sample(logits, Sampling(1, -1, vocab_size=12, temperature=1.0, top_p=0.6), torch.rand(20000, 1, generator=generator))
    assert set(tokens.unique().tolist()) == set(nucleus.tolist())


def test_virtual_pipeline_chunks_are_refused(llama):
    with pytest.raises(NotImplementedError, match="virtual pipeline"):
        generate([llama, llama], PROMPTS, Sampling(4, -1, 100), 2)


def test_models_outside_the_llama_family_are_refused(one_rank):
    [model] = build_gpt(tiny_hf_model("llama")[1], one_rank, apply_residual_connection_post_layernorm=True)
    with pytest.raises(NotImplementedError, match="apply_residual_connection_post_layernorm"):
        generate([model], PROMPTS, Sampling(4, -1, 100), 2)


def test_grpo_trains_on_the_log_probs_it_sampled_from(llama):
    """With top_k / top_p, GRPO's training log-probs of the rollouts (`nll_forward`, FILTERED)
    are the sampler's: under the filtered, renormalised distribution (NeMo-RL v0.6), not the
    full one the KL reads (UNFILTERED)."""
    sampling = Sampling(6, -1, 100, temperature=0.7, top_p=0.8, top_k=30)
    completions = generate([llama], PROMPTS, sampling, 3, seed=5)
    rollouts = Rollouts(PROMPTS, completions, torch.zeros(len(PROMPTS)), torch.ones(len(PROMPTS), dtype=torch.bool), pad_id=0)
    batch = rollouts.collate(range(len(PROMPTS)))
    with torch.no_grad():
        nll = nll_forward(sampling, (FILTERED, UNFILTERED))(llama, batch)
    trained = batch["loss_mask"] > 0
    assert torch.allclose(-nll[..., 0][trained], batch["generation_logp"][trained], atol=1e-5)
    assert (-nll[..., 1][trained] < batch["generation_logp"][trained] - 1e-3).any()  # the full distribution spreads its mass wider


@pytest.mark.slow
def test_ep2_ranks_with_different_prompts_generate_what_each_would_at_ep1():
    """A Qwen3-MoE's experts split over 2 ranks that generate different prompt sets (different
    numbers of batches; a rank with none; batches ending by EOS at different steps; greedy and
    sampled, the EOS check every step and every 3): every completion is EP1's, tokens exactly,
    log-probs within 1e-6 (tests/generation_ranks.py)."""
    run = run_ranks(2, Path(__file__).with_name("generation_ranks.py"), "qwen3_moe")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 * 2 * 3 * 2 and all(", 0 differ from EP1," in line for line in lines)  # ranks, samplings, sets, checks
    ended = {rank: sum(int(n) for n in re.findall(rf"^rank {rank} .*\((\d+) ended by EOS\)", run.stdout, re.M)) for rank in (0, 1)}
    assert ended[0] > 0 and ended[1] > 0, run.stdout  # rows end early on both ranks, so the ranks' batches end at different steps
