"""Rank script for tests/test_refit.py: every rank holds its share of a converted HF model at
--tp/--pp/--ep, all take part in `hf_weights`, and rank 0 compares what it gathers with the HF
model's own tensors (exact)."""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from megatron_ranks import CASES, converted_chunks, parallel_cfg, saved_state, tiny_hf_model

from alignflow.job.convert.families import model_shape
from alignflow.job.engine.refit import hf_weights
from alignflow.job.model import runtime


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:  # saved before init: HF saves on rank 0 only once distributed
        models = {case: tiny_hf_model(case) for case in args.cases}
        states = {case: saved_state(model, Path(workdir) / case) for case, (model, _) in models.items()}
    parallel = parallel_cfg(args.tp, args.pp, None, args.ep)
    runtime.init_parallel(parallel)
    failed = False
    for case, (_, config) in models.items():
        sent = dict(hf_weights(converted_chunks(config, parallel, states[case]), model_shape(config)))
        if dist.get_rank() == 0:
            wrong = sorted(set(sent) ^ set(states[case])) + [n for n in states[case] if n in sent and not torch.equal(sent[n], states[case][n])]
            print(f"{case} tp={args.tp} pp={args.pp} ep={args.ep}: refit tensors {len(sent)}, differing from HF's: {wrong}", flush=True)
            failed |= bool(wrong)
        elif sent:
            print(f"rank {dist.get_rank()} yielded tensors", flush=True)
            failed = True
    runtime.teardown()
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
