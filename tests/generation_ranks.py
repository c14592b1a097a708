"""EP2 generation against EP1, run by tests/test_generation.py on 2 ranks:
    torchrun --standalone --nproc-per-node 2 tests/generation_ranks.py qwen3_moe
(`--tp 2` or `--pp 2` on 4 ranks: EP2 x TP2 against EP1 x TP2, EP2 x PP2 against EP1 x PP2.)

The two ranks of the EP group generate different prompt sets (rank 0: 7 prompts, 4 batches of
at most 2; rank 1: 3 prompts, 2 batches; then both the 7 with their own seeds; then rank 1
none at all), greedy and sampled at temperature 1, with an EOS the model draws often so
batches end at different steps on the two ranks, and with the
EOS check every step and every 3 steps (the GPU's stretch with its rewind). Then the same
ranks re-initialise at EP1 (each rank holding every expert) and generate the same prompts
alone; every completion must be the same tokens with log-probs within 1e-6. Exits non-zero
on a mismatch; prints one line per rank and run.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

from alignflow.job import generation
from alignflow.job.generation import Sampling, generate
from alignflow.job.model import runtime
from megatron_ranks import converted_chunks, parallel_cfg, saved_state, tiny_hf_model, tokens

TOLERANCE = 1e-6


def prompt_sets(rank: int) -> list[list[list[int]]]:
    """This rank's prompts of each run: different counts (and so batches) on the two ranks."""
    rows = tokens(batch=10, seq=12).tolist()
    lengths = (5, 12, 3, 9, 7, 4, 11, 6, 8, 10)
    prompts = [row[:n] for row, n in zip(rows, lengths)]
    first = prompts[:7]
    return [first if rank == 0 else prompts[7:], first, first if rank == 0 else []]


def runs(case: str, rank: int) -> list[tuple[str, Sampling, list[list[int]], int]]:
    """(name, sampling, prompts, seed) of each run."""
    eos = 82  # a token the tiny model draws often: rows end early, at different steps
    vocab = tiny_hf_model(case)[1]["vocab_size"]
    samplings = {
        "greedy": Sampling(max_new_tokens=12, eos_id=eos, vocab_size=vocab),
        "sampled": Sampling(max_new_tokens=12, eos_id=eos, vocab_size=vocab, temperature=1.0),
    }
    return [
        (f"{name} set {i}", sampling, prompts, 11 + i + rank) for name, sampling in samplings.items() for i, prompts in enumerate(prompt_sets(rank))
    ]


def generate_all(chunks: list, planned: list) -> list[list]:
    return [generate(chunks, prompts, sampling, batch_size=2, seed=seed) for _, sampling, prompts, seed in planned]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("case")
    args = parser.parse_args()
    case, layout = args.case, {"tp": args.tp, "pp": args.pp}
    with tempfile.TemporaryDirectory() as workdir:  # saved before init: HF saves on rank 0 only once distributed
        hf_state = saved_state(tiny_hf_model(case)[0], Path(workdir) / case)
    hf_config = tiny_hf_model(case)[1]
    got = {}
    runtime.init_parallel(parallel_cfg(**layout, ep=2))
    rank = parallel_state.get_data_parallel_rank()
    planned = runs(case, rank)
    chunks = converted_chunks(hf_config, parallel_cfg(**layout, ep=2), hf_state)
    for every in (1, 3):
        generation.EOS_CHECK_EVERY["cpu"] = every
        got[every] = generate_all(chunks, planned)
    parallel_state.destroy_model_parallel()
    runtime.init_parallel(parallel_cfg(**layout, ep=1))
    generation.EOS_CHECK_EVERY["cpu"] = 1
    expected = generate_all(converted_chunks(hf_config, parallel_cfg(**layout, ep=1), hf_state), planned)
    failed = False
    for every, completions in got.items():
        for (name, *_), ours, theirs in zip(planned, completions, expected, strict=True):
            same = [a.tokens == b.tokens and a.truncated == b.truncated for a, b in zip(ours, theirs, strict=True)]
            error = max(
                (abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logps + a.sampling_logps, b.logps + b.sampling_logps)), default=0.0
            )
            lengths = [len(c.tokens) for c in theirs]
            print(
                f"rank {rank} (global {dist.get_rank()}) {name} check every {every}: {len(theirs)} completions of lengths {lengths} "
                f"({sum(not c.truncated for c in theirs)} ended by EOS), {same.count(False)} differ from EP1, "
                f"max |logp - EP1| = {error:.1e}",
                flush=True,
            )
            failed |= not all(same) or not error <= TOLERANCE
    runtime.teardown()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
