"""Memory per rank of one training step, in bytes per parameter, beside Megatron's theory.

A Llama-shaped model of 134M parameters (hidden 768, 12 layers, 12 heads, FFN 2048, vocab
32000, untied embeddings) trains at DP=2: two local ranks (torch.multiprocessing, gloo, CPU),
each with one micro batch of 2 x 256 tokens, through the engine's pieces (Megatron's DDP and
optimizer as `alignflow.job.train.engine` builds them, the sft stage's objective `SFT` with
each row one document, Megatron's schedule) in four settings:
fp32; bf16; bf16 + distributed optimizer; bf16 + distributed optimizer + full recompute.

Method (CPU, so RSS): per rank, from /proc/self/status. `baseline` is the RSS after imports
and the process group, before the model is built. A first step creates the Adam states; then
freed heap goes back to the OS (malloc_trim) and the peak is reset (/proc/self/clear_refs 5)
before each part of a second step: forward-backward, gradient reduction (`finalize_model_grads`,
which the schedule otherwise runs; gloo's reduce-scatter copies the buffer) and optimizer
step. `state` = RSS after it - baseline (weights, gradient buffers, optimizer state: what the
theory counts), `activations` = peak over forward-backward - RSS before it, `peak` = highest
peak of the three - baseline. Bytes per parameter divide by the parameters a rank holds (all of
them at DP).

Theory (Megatron's distributed-optimizer docs), bytes per parameter without activations:
fp32 4 weight + 4 grad + 8 Adam = 16; bf16 2 weight + 4 grad (reduced in fp32:
grad_reduce_in_fp32) + 4 fp32 main weight + 8 Adam = 18; with the distributed optimizer the
main weights and Adam states are sharded over DP: 6 + 12 / DP (bf16 grads would give 4 + 16 / DP).

Each rank takes its share of the cores: with torch's default (every core per rank) the two
ranks' threads oversubscribe 2 cores and a forward-backward took 2-3x as long (37-50 s against
11-19 s, measured beside other jobs); the whole bench then took 545 s, and did not finish in
900 s on a fresh machine beside CI.

Run: .venv/bin/python bench/memory.py [--tiny]   (about 10 GB of RAM at peak; 164 s on 2 cores shared with other jobs;
--tiny: a 0.2M-parameter model on rows of 32 tokens, every setting, so CI runs it end to end)
"""

import argparse
import ctypes
import os
import re
import socket

import numpy as np
import torch
import torch.multiprocessing as mp

DP, MICRO = 2, 2
LLAMA = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, tie_word_embeddings=False)
SIZES = {  # name: (vocab, hidden, FFN, layers, heads, tokens per row)
    "full": (32000, 768, 2048, 12, 12, 256),
    "tiny": (1024, 64, 128, 2, 4, 32),
}
SETTINGS = {  # name: (precision, distributed optimizer, recompute, theory in bytes per parameter)
    "fp32": ("fp32", False, "none", 16.0),
    "bf16": ("bf16", False, "none", 18.0),
    "bf16+distopt": ("bf16", True, "none", 6 + 12 / DP),
    "bf16+distopt+recompute": ("bf16", True, "full", 6 + 12 / DP),
}


def kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def fresh_peak() -> int:
    """Return freed heap to the OS, reset the peak (VmHWM); the RSS now."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    open("/proc/self/clear_refs", "w").write("5")
    return kb("VmRSS")


def llama(size: str) -> tuple[dict, int]:
    """The HF config of a size and its row length."""
    vocab, hidden, ffn, layers, heads, seq = SIZES[size]
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads)
    return LLAMA | shape | dict(num_key_value_heads=heads, max_position_embeddings=seq), seq


def rank_main(rank: int, setting: str, size: str, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(DP), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(len(os.sched_getaffinity(0)) // DP, 1))  # torch's default, every core per rank, oversubscribes them
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from omegaconf import OmegaConf

    from alignflow.job.forward.objectives import SFT
    from alignflow.job.forward.passes import resolve_precision
    from alignflow.job.model import runtime
    from alignflow.job.model.gpt import build_gpt
    from alignflow.job.train.data import packed_rows
    from alignflow.job.train.engine import build_optimizer, ddp_config, recompute_settings, set_lr, wrap_ddp

    precision, distributed, recompute, _ = SETTINGS[setting]
    config, seq = llama(size)
    cfg = OmegaConf.create(
        {
            "parallel": {
                "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1,
                "virtual_pipeline_model_parallel_size": None,
                "context_parallel_size": 1,
                "expert_model_parallel_size": 1,
                "sequence_parallel": False,
                "use_distributed_optimizer": distributed,
                "overlap_grad_reduce": None,
                "overlap_param_gather": None,
            },
            "optim": {"name": "adamw", "lr": 1e-4, "min_lr": 1e-5, "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_eps": 1e-8},
            "trainer": {"gradient_clip_val": 1.0},
            "recompute_granularity": recompute,
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    )
    runtime.init_parallel(cfg.parallel, seed=1)
    baseline = kb("VmRSS")
    [chunk] = build_gpt(config, cfg.parallel, params_dtype=resolve_precision(precision), calculate_per_token_loss=True, **recompute_settings(cfg))
    model = wrap_ddp([chunk], ddp_config(cfg.parallel))
    chunk.config.finalize_model_grads_func = None  # run apart, below
    optimizer = build_optimizer(model, cfg, resolve_precision(precision))
    ids = np.random.default_rng(rank).integers(0, config["vocab_size"], (MICRO, seq))
    batch = vars(packed_rows([(row, np.ones(seq), [0, seq]) for row in ids], seq, pad_id=0))  # each row one document, as the sft stage collates

    def forward_step(data, model):  # the sft stage's objective (`SFT`: the rows' documents, no mask)
        batch = next(data)

        def loss(out):
            terms = SFT.loss(out, batch)
            return terms.total, terms.count.to(torch.int), {}

        return SFT.forward(model, batch), loss

    def step() -> list[int]:
        """One step; the peaks of its forward-backward, gradient reduction and optimizer step."""
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        fresh_peak()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=model[0],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=MICRO,
            forward_only=False,
        )
        forward_backward = kb("VmHWM")
        fresh_peak()
        finalize_model_grads(model, torch.tensor(MICRO * seq, dtype=torch.int))
        reduction = kb("VmHWM")
        fresh_peak()
        set_lr(optimizer, 1e-4, 0.01)
        optimizer.step()
        return [forward_backward, reduction, kb("VmHWM")]

    step()  # creates the Adam states
    before = fresh_peak()
    peaks = step()
    state = fresh_peak() - baseline
    params = sum(p.numel() for p in chunk.parameters())
    results.put((rank, params, state, peaks[0] - before, max(peaks) - baseline))
    runtime.teardown()


def measure(setting: str, size: str) -> tuple[int, int, int, int]:
    """(parameters, state, activations, peak) in bytes of the rank with the highest peak."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(setting, size, results), nprocs=DP)
    ranks = [results.get() for _ in range(DP)]
    return max((r[1:] for r in ranks), key=lambda r: r[3])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny size: every setting end to end in seconds (CI)")
    size = "tiny" if parser.parse_args().tiny else "full"
    print(f"{'setting':<24} {'params':>7} {'state B/param':>13} {'theory':>6} {'activations MB':>14} {'peak B/param':>12}")
    figures = {}
    for name, (_, _, _, theory) in SETTINGS.items():
        params, state, activations, peak = figures[name] = measure(name, size)
        print(
            f"{name:<24} {params / 1e6:>6.1f}M {state / params:>13.2f} {theory:>6.1f} {activations / 2**20:>14.0f} {peak / params:>12.2f}", flush=True
        )
    params, state, activations, _ = figures["bf16+distopt"]
    saves = 1 - figures["bf16+distopt+recompute"][2] / activations
    print(f"memory: bf16+distopt {state / params:.2f} B/param (theory {6 + 12 / DP:.2f}), recompute saves {100 * saves:.0f}%")
