"""Per-rank checks of converted checkpoints, run by `test_convert` under torchrun:

    torchrun --standalone --nproc-per-node N tests/checkpoint_ranks.py logits CKPT HF_DIR OUT.pt --tp T --pp P [--ep E]
    torchrun --standalone --nproc-per-node N tests/checkpoint_ranks.py resave CKPT DEST --tp T --pp P [--ep E]

`logits` builds the Megatron model at the layout, loads the torch_dist checkpoint CKPT
(an `alignflow.job.model_files` directory), and on the last stage saves full-vocab logits of
fixed tokens and their max error against the HF model in HF_DIR. `resave` loads CKPT and
saves it again with Megatron-Core's own writer at that layout (a TP- or PP-sharded checkpoint).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM

from alignflow.job.model_files import HF_DIR, MODEL_DIR
from alignflow.job.model import sharded_state, runtime
from alignflow.job.model.gpt import build_gpt

sys.path.insert(0, str(Path(__file__).parent))
from megatron_ranks import megatron_logits, parallel_cfg, tokens  # noqa: E402


def build(ckpt: Path, tp: int, pp: int, ep: int = 1) -> tuple[list, dict]:
    hf_config = json.loads((ckpt / HF_DIR / "config.json").read_text())
    parallel = parallel_cfg(tp, pp, ep=ep)
    runtime.init_parallel(parallel)
    chunks = [c.eval() for c in build_gpt(hf_config, parallel)]
    sharded_state.load(chunks, str(ckpt / MODEL_DIR))
    return chunks, hf_config


def logits(args) -> int:
    reference = AutoModelForCausalLM.from_pretrained(args.hf_dir, attn_implementation="eager").eval()  # before init: see megatron_ranks
    chunks, hf_config = build(Path(args.ckpt), args.tp, args.pp, args.ep)
    ids = tokens(seq=12)
    with torch.no_grad():
        got = megatron_logits(chunks, ids)
        if got is not None and parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0:
            got = got[..., : hf_config["vocab_size"]]
            error = (got - reference(ids).logits).abs().max().item()
            torch.save({"logits": got, "error": error}, args.out)
            print(f"tp={args.tp} pp={args.pp} ep={args.ep}: max |logits - HF| = {error:.2e}", flush=True)
    runtime.teardown()
    return 0


def resave(args) -> int:
    chunks, _ = build(Path(args.ckpt), args.tp, args.pp, args.ep)
    dest = Path(args.dest)
    sharded_state.save(chunks, str(dest / MODEL_DIR))
    if torch.distributed.get_rank() == 0:
        shutil.copytree(Path(args.ckpt) / HF_DIR, dest / HF_DIR, dirs_exist_ok=True)
    runtime.teardown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["logits", "resave"])
    parser.add_argument("ckpt")
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    if args.mode == "logits":
        args.hf_dir, args.out = args.paths
        return logits(args)
    (args.dest,) = args.paths
    return resave(args)


if __name__ == "__main__":
    sys.exit(main())
