"""Prep at data-set scale: the prep stage vs TRL's SFTTrainer data preparation.

N generated chats (messages format: a user and an assistant turn of lognormal length made of
the demo's words) in one jsonl file, tokenized with the demo's tokenizer and chat template and
packed best-fit-decreasing into rows of 2048 tokens.
- ours: `alignflow.job.stages.prep.run` called directly, with 1 rank and with 2 (processes with a
  gloo group, as a job's ranks), writing Parquet shards; it also finds the assistant-only loss
  mask and holds out nothing.
- TRL: `load_dataset("json")` then `SFTTrainer(...)` with `dataset_num_proc=2`,
  `packing_strategy="bfd"`, `max_length=2048`, on the demo's tiny Llama; building the trainer
  is its data preparation (tokenize with the chat template, labels, pack). Its defaults train on
  the whole sequence (an assistant-only mask needs `{% generation %}` markup in the template).
Each run is a fresh process tree, timed from its first row to its last write (imports and the
model excluded); memory is the peak of the tree's summed RSS, and of its summed PSS (shared
pages counted once, so forked workers are not counted twice), sampled every 0.2 s. Ours runs
again at 10N rows, 2 ranks, to show that its memory does not follow the data set.

Run: .venv/bin/python bench/prep.py [N]   (default 200000; needs the bench extra: trl, datasets; --tiny: N = 200,
every run in seconds after its imports, so CI runs it end to end)
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

SEQ, SEED = 2048, 0
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_chats(path: Path, n: int) -> None:
    from alignflow.orchestrator.demo import SENTENCES

    rng, words = np.random.default_rng(SEED), np.array(" ".join(SENTENCES).split())
    with open(path, "w") as f:
        for lengths in np.clip(rng.lognormal(3.6, 0.8, (n, 2)), 1, 1500).astype(int):
            user, reply = (" ".join(words[rng.integers(0, len(words), k)]) for k in lengths)
            f.write(json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}) + "\n")


def ours(rank: int, world: int, data: str, demo: str, out: str) -> None:
    """One rank of the prep stage, as `alignflow.job.worker` sets it up."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from alignflow.orchestrator.config.schema import DataConfig, DatasetConfig, PrepConfig
    from alignflow.job.stages import prep

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dist.barrier()
    cfg = OmegaConf.create(
        {
            "prep": PrepConfig(),
            "data": DataConfig(sft=DatasetConfig(train=data), seq_length=SEQ, seed=SEED),
            "model": {"tokenizer": f"{demo}/tokenizer", "chat_template": None},
        }
    )
    start = time.perf_counter()
    metrics = prep.run(cfg, {}, out)
    if rank == 0:
        print(json.dumps({"seconds": time.perf_counter() - start, "tokens": metrics["sft.train.tokens"], "packs": metrics["sft.train.packs"]}))


def trl(data: str, demo: str, work: str) -> None:
    from datasets import load_dataset
    from datasets.utils.logging import disable_progress_bar
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    disable_progress_bar()
    tokenizer, model = AutoTokenizer.from_pretrained(f"{demo}/tokenizer"), AutoModelForCausalLM.from_pretrained(f"{demo}/tiny-llama")
    args = SFTConfig(
        output_dir=f"{work}/trainer",
        max_length=SEQ,
        packing=True,
        packing_strategy="bfd",
        dataset_num_proc=2,
        report_to="none",
        seed=SEED,
        use_cpu=True,
    )
    start = time.perf_counter()
    dataset = load_dataset("json", data_files=data, split="train", cache_dir=f"{work}/cache")
    packed = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer).train_dataset
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": sum(map(sum, packed["seq_lengths"])), "packs": packed.num_rows}))


def measure(commands: list[list[str]]) -> dict:
    """Run the commands as one process tree; their result (rank 0's) with the tree's peak memory
    and the CPU time it used (it is the figure a loaded machine changes least)."""
    env = {**os.environ, **OFFLINE, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "LOCAL_WORLD_SIZE": str(len(commands))}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, text=True) for c in commands]
    peak_rss = peak_pss = 0
    while any(p.poll() is None for p in procs):
        tree = [q for p in procs if p.poll() is None for q in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]]
        rss = pss = 0
        for q in tree:
            try:
                info = q.memory_full_info()
                rss, pss = rss + info.rss, pss + info.pss
            except psutil.Error:
                pass
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.2)
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return json.loads(procs[0].stdout.read().strip().splitlines()[-1]) | {"rss": peak_rss / 2**20, "pss": peak_pss / 2**20, "cpu": cpu}


def main(n: int, work: Path) -> None:
    from alignflow.orchestrator import demo

    assets = str(demo.build(work / "demo"))
    print(f"{os.cpu_count()} cores; load: the load average at the start of each run (1 min); CPU s: the run's, imports included")
    print(
        f"{'run':<24}{'rows':>11}{'tokens':>13}{'packs':>8}{'load':>6}{'seconds':>9}{'rows/s':>8}{'CPU s':>7}{'peak RSS MB':>13}{'peak PSS MB':>13}"
    )
    results = {}
    for label, rows, kind, world in (
        ("alignflow, 1 rank", n, "ours", 1),
        ("alignflow, 2 ranks", n, "ours", 2),
        ("TRL SFTTrainer, 2 procs", n, "trl", 2),
        ("alignflow, 2 ranks", 10 * n, "ours", 2),
    ):
        data = work / f"chats-{rows}.jsonl"
        if not data.exists():
            write_chats(data, rows)
        me, load = [sys.executable, __file__, kind], os.getloadavg()[0]
        with tempfile.TemporaryDirectory(dir=work) as out:
            commands = (
                [[*me, str(r), str(world), str(data), assets, out] for r in range(world)] if kind == "ours" else [[*me, str(data), assets, out]]
            )
            r = results[label, rows] = measure(commands)
        print(
            f"{label:<24}{rows:>11,}{r['tokens']:>13,}{r['packs']:>8,}{load:>6.2f}{r['seconds']:>9.1f}{rows / r['seconds']:>8,.0f}"
            f"{r['cpu']:>7.0f}{r['rss']:>13,.0f}{r['pss']:>13,.0f}",
            flush=True,
        )
    ours2, theirs, big = results["alignflow, 2 ranks", n], results["TRL SFTTrainer, 2 procs", n], results["alignflow, 2 ranks", 10 * n]
    print(f"prep: ratio {theirs['seconds'] / ours2['seconds']:.2f} peak {ours2['rss']:.0f} MB at {n} rows, peak {big['rss']:.0f} MB at {10 * n} rows")


if __name__ == "__main__" and sys.argv[1:2] == ["ours"]:
    ours(*map(int, sys.argv[2:4]), *sys.argv[4:])
elif __name__ == "__main__" and sys.argv[1:2] == ["trl"]:
    trl(*sys.argv[2:])
elif __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=200_000, help="chats (default 200000)")
    parser.add_argument("--tiny", action="store_true", help="N = 200")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-prep-") as tmp:
        main(200 if args.tiny else args.n, Path(tmp))
