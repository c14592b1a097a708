"""Tiny random HF models for the conversion tests, and the per-rank check for TP2 / PP2.

The tests import the helpers; `test_megatron_model` also runs this file on 2 ranks:
    torchrun --standalone --nproc-per-node 2 tests/megatron_ranks.py --tp 2 llama qwen2
Each rank builds the same HF models (same seed), converts its share with `hf_to_megatron`,
builds its Megatron stage and runs one forward through Megatron's pipeline schedule; the
last stage compares logits with HF's and the script exits non-zero on a mismatch.
"""

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from safetensors.torch import load_file
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from reference_convert import hf_to_megatron
from alignflow.job.device import device
from alignflow.job.generation import Sampling, generate
from alignflow.job.model import runtime
from alignflow.job.model.gpt import build_gpt, load_megatron_state, token_nll

TOLERANCE = 1e-5  # fp32, max abs over all logits
TINY = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    initializer_range=0.1,  # large enough that attention is peaked: a layout error shows in the logits
)
PHI3_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # Phi3Config's defaults (32000) lie outside vocab 100

# case -> (config class, model class, what differs from TINY)
CASES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama_tied": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "mistral_window": (MistralConfig, MistralForCausalLM, {"sliding_window": 4}),
    "llama3_rope": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "max_position_embeddings": 16384,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "llama3_rope_other": (
        LlamaConfig,
        LlamaForCausalLM,
        {  # constants Megatron-Core's rope_scaling cannot take
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 2.0,
                "high_freq_factor": 8.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama_biases": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
    "llama_attention_bias": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 32}),  # head_dim != hidden / heads, as Qwen3's real sizes
    "qwen3_tied_bias": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True, "attention_bias": True}),
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {}),  # post-norm, q/k norms over the whole projection
    "olmo2_tied_bias": (Olmo2Config, Olmo2ForCausalLM, {"tie_word_embeddings": True, "attention_bias": True}),
    "phi3_window": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 4, **PHI3_TOKENS}),  # fused qkv_proj, gate_up_proj; a window
    "phi3_longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        {  # Phi-3-*-128k's RoPE within original_max_position_embeddings
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 32,  # Phi3Config's own key wins over rope_parameters'
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.3, 1.7, 2.2, 2.9, 3.4, 4.1, 5.0],
                "long_factor": [2.0] * 8,
            },
            **PHI3_TOKENS,
        },
    ),
    "phi4_partial_tied": (
        Phi3Config,
        Phi3ForCausalLM,
        {  # Phi-4-mini's shape: RoPE on 3/4 of each head, tied
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
            **PHI3_TOKENS,
        },
    ),
    "phi4_mini_longrope": (
        Phi3Config,
        Phi3ForCausalLM,
        {  # Phi-4-mini: longrope on 3/4 of each head (12 of 16 dims: 6 factors), tied
            "tie_word_embeddings": True,
            "max_position_embeddings": 64,
            "original_max_position_embeddings": 32,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.4, 1.9, 2.6, 3.3, 4.5],
                "long_factor": [2.0] * 6,
            },
            **PHI3_TOKENS,
        },
    ),
    # Sliding (4 tokens) and full layers alternating, head_dim != hidden / heads != query_pre_attn_scalar,
    # soft-caps small enough to bend the scores and logits.
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 4,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {  # its own RoPE base on sliding layers, linear scaling on full ones
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    # mixture of experts: 4 experts, top 2, renormalized over the top 2 (Mixtral's router) or not
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True, "head_dim": 32},
    ),
    "qwen3_moe_unnormed": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": False, "tie_word_embeddings": True},
    ),
}


def tiny_hf_model(case: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, dict]:
    """A random HF model (norms and biases random too, so their mapping matters) and its config dict."""
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides}, attn_implementation="eager")).eval()
    centered = model_cls.__name__.startswith("Gemma")  # its norms scale by 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5) if centered else param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model, {**model.config.to_dict(), "architectures": [model_cls.__name__]}


def saved_state(model: torch.nn.Module, folder: Path) -> dict[str, torch.Tensor]:
    """The state as HF saves it (tied weights once): what the converter reads from disk."""
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))


def megatron_logits(chunks: list, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocab logits on the last pipeline stage (None elsewhere), through Megatron's
    schedule with one sequence per micro batch (virtual PP needs several micro batches)."""

    def step(data_iterator, chunk):
        return chunk(next(data_iterator), None, None, runtime_gather_output=True), None

    micro_batches = list(ids.to(device()).split(1))
    outputs = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=[iter(micro_batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(micro_batches),
        seq_length=ids.shape[1],
        micro_batch_size=1,
        forward_only=True,
    )
    return torch.cat(outputs).cpu() if parallel_state.is_pipeline_last_stage() else None


def max_logit_error(case: str, parallel: dict, hf_state: dict) -> Optional[float]:
    """Convert `case` for this rank, run it, and return max |Megatron - HF| (None off the last stage)."""
    hf_model, hf_config = tiny_hf_model(case)
    chunks = converted_chunks(hf_config, parallel, hf_state)
    ids = tokens()
    with torch.no_grad():
        logits = megatron_logits(chunks, ids)
        if logits is None:
            return None
        return (logits[..., : hf_config["vocab_size"]] - hf_model(ids).logits).abs().max().item()


def max_logprob_error(case: str, parallel: dict, hf_state: dict) -> Optional[float]:
    """max |our per-token log-prob - HF's log_softmax over its real vocab| through `token_nll`
    (torch's cross entropy at TP1, Megatron's vocab-parallel one under TP) on a model whose vocab
    Megatron pads (100 -> 128, or 256 at TP2: the second rank's whole slice is padding)."""
    hf_model, hf_config = tiny_hf_model(case)
    chunk = converted_chunks(hf_config, parallel, hf_state)[0]
    ids = tokens()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        nll = token_nll(chunk, ids[:, :-1], positions[:, :-1], None, ids[:, 1:])
        expected = hf_model(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return (-nll - expected).abs().max().item()


def greedy_mismatches(case: str, parallel: dict, hf_state: dict) -> int:
    """Prompts whose KV-cached greedy completion, in left-padded batches of mixed lengths, differs
    from HF's `generate` on that prompt alone (every rank checks)."""
    hf_model, hf_config = tiny_hf_model(case)
    chunks = converted_chunks(hf_config, parallel, hf_state)
    rows = tokens(batch=6, seq=14).tolist()
    # Lengths 3 to 14 in batches of 4 (left-padded), the same prompt twice (prefilled once).
    prompts = [row[:n] for row, n in zip(rows, (6, 14, 3, 9, 11, 5))] + [rows[5][:5]]
    eos = prompts[0][-1]  # a token the model is likely to produce, so some completions stop early
    sampling = Sampling(max_new_tokens=12, eos_id=eos, vocab_size=hf_config["vocab_size"])
    ours = generate(chunks, prompts, sampling, batch_size=4)
    mismatches = 0
    for prompt, completion in zip(prompts, ours):
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        mismatches += theirs[0, len(prompt) :].tolist() != completion.tokens
    return mismatches


def converted_chunks(hf_config: dict, parallel: dict, hf_state: dict) -> list:
    """This rank's Megatron chunks with its share of the converted HF weights, in eval mode."""
    chunks = build_gpt(hf_config, parallel)
    vp_size = parallel["virtual_pipeline_model_parallel_size"]
    for vp_stage, chunk in enumerate(chunks):
        load_megatron_state(
            chunk.eval(),
            hf_to_megatron(
                hf_state,
                hf_config,
                parallel_state.get_tensor_model_parallel_rank(),
                parallel["tensor_model_parallel_size"],
                parallel_state.get_pipeline_model_parallel_rank(),
                parallel["pipeline_model_parallel_size"],
                vp_stage=vp_stage if vp_size else None,
                vp_size=vp_size,
                ep_rank=parallel_state.get_expert_model_parallel_rank(),
                ep_size=parallel["expert_model_parallel_size"],
            ),
        )
    return chunks


def parallel_cfg(tp: int = 1, pp: int = 1, vp: Optional[int] = None, ep: int = 1) -> dict:
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vp,
        "context_parallel_size": 1,
        "expert_model_parallel_size": ep,
        "sequence_parallel": False,
        "use_distributed_optimizer": False,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--generate", action="store_true", help="also compare KV-cached greedy generation with HF's")
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:  # saved before init: HF saves on rank 0 only once distributed
        hf_states = {case: saved_state(tiny_hf_model(case)[0], Path(workdir) / case) for case in args.cases}
    parallel = parallel_cfg(args.tp, args.pp, args.vp, args.ep)
    runtime.init_parallel(parallel)
    failed = False
    for case, hf_state in hf_states.items():
        error = max_logit_error(case, parallel, hf_state)
        if error is not None:
            print(f"{case} tp={args.tp} pp={args.pp} vp={args.vp} ep={args.ep}: max |logits - HF| = {error:.2e}", flush=True)
            failed |= not error < TOLERANCE
        if args.pp == 1:
            error = max_logprob_error(case, parallel, hf_state)
            print(f"{case} tp={args.tp}: max |logp - HF log_softmax over the real vocab| = {error:.2e}", flush=True)
            failed |= not error < TOLERANCE
        if args.generate:
            mismatches = greedy_mismatches(case, parallel, hf_state)
            print(f"{case} tp={args.tp} pp={args.pp}: {mismatches} greedy completions differ from HF's", flush=True)
            failed |= mismatches > 0
    runtime.teardown()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
