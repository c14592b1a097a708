"""Committed training outputs hold the weights, not the optimizer state, unless the config asks
(`checkpoint.keep_optimizer`), and every consumer of one loads it.

sft_dpo, plus a LoRA sft on the sft model with its export and a distillation teacher pass, is
run through the real runner and local jobs: sft and lora commit without their checkpoints;
ref_logprobs, dpo (its init), eval, lora (its base), export_lora (the merge) and teacher read
those commits; dpo keeps its final checkpoint (weights, optimizer, RNG and trainer state) and
nothing else, and `align gc` leaves it."""

import json
import sys
from pathlib import Path

import pytest
import torch

from alignflow.orchestrator.config.compose import compose
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage
from alignflow.orchestrator.store import MANIFEST, TRAINING_STATE, store_of
from flows.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import weights  # noqa: E402

pytestmark = pytest.mark.slow
FAST = [
    "sft.trainer.max_steps=2",
    "sft.optim.warmup_steps=1",
    "sft.trainer.val_check_interval=1",
    "sft.trainer.limit_val_batches=1",
    "sft.checkpoint.every_n_steps=1",
    "dpo.trainer.max_steps=2",
    "dpo.optim.warmup_steps=1",
    "dpo.trainer.val_check_interval=1",
    "dpo.trainer.limit_val_batches=1",
    "dpo.checkpoint.every_n_steps=1",
    "dpo.checkpoint.keep_optimizer=true",
    "eval.num_generation_samples=4",
    "eval.limit_batches=1",
    "data.preference.dev_choose_samples=64",
    # more consumers of the committed sft: a LoRA run on it (whose export merges its adapter into it) and a distillation teacher
    "pipeline.stages.lora={kind: sft, inputs: {data: prep, model: sft}, finetuning_type: lora, trainer: {max_steps: 1}}",
    "pipeline.stages.export_lora={kind: export, inputs: {model: lora}}",
    "pipeline.stages.teacher={kind: teacher_logprobs, inputs: {data: prep, teacher: sft}}",
]


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_training_outputs_commit_weights_and_only_the_optimizer_state_asked_for(base_overrides, capsys):
    overrides = [*base_overrides, *FAST]
    cfg = compose("sft_dpo", overrides)
    results = {}
    for stage in Pipeline.build(cfg):
        results[stage.name] = run_stage(stage, {name: results[name] for name in stage.upstream()}, log=lambda line: None)
    store = store_of(cfg)

    outputs = {name: Path(store.output_path(name, results[name].fingerprint)) for name in ("sft", "dpo", "lora")}
    for name, out in outputs.items():
        manifest = json.loads((out / MANIFEST).read_text())
        assert {f["path"]: f["size"] for f in manifest["files"]} == {p: s for p, s in files(out).items() if p != MANIFEST}
        assert not Path(store.staging_path(name, results[name].fingerprint)).exists()
    sft, dpo, lora = (json.loads((out / MANIFEST).read_text()) for out in outputs.values())
    assert not (outputs["sft"] / "checkpoints").exists() and TRAINING_STATE not in sft
    assert {"model", "hf", "tokenizer", "metrics.jsonl"} <= {p.name for p in outputs["sft"].iterdir()}
    assert not (outputs["lora"] / "checkpoints").exists() and TRAINING_STATE not in lora
    assert {"adapter", "lora.json", "hf", "tokenizer"} <= {p.name for p in outputs["lora"].iterdir()}

    final = outputs["dpo"] / "checkpoints" / "step-00000002"
    assert dpo[TRAINING_STATE] == "checkpoints/step-00000002" and [p.name for p in final.parent.iterdir()] == [final.name]
    assert {p.name for p in final.iterdir()} == {"model", "optimizer", "trainer.json", "rank-00000.pt", "complete"}
    assert json.loads((final / "trainer.json").read_text())["step"] == 2
    published, checkpointed = weights(outputs["dpo"] / "model"), weights(final / "model")
    assert published.keys() == checkpointed.keys() and all(torch.equal(published[k], checkpointed[k]) for k in published)

    assert results["dpo"].metrics["steps"] == 2 and results["ref_logprobs"].metrics["train.pairs"] > 0
    assert {"sft.val_loss", "dpo.val_loss", "convert.val_loss"} <= set(results["eval"].metrics)
    assert json.loads((Path(results["export"].uri) / "_SUCCESS.json").read_text())["inputs"]["dpo"]["uri"] == results["dpo"].uri
    assert list((Path(results["export_lora"].uri) / "adapter").glob("*.safetensors")) and results["teacher"].metrics["train.rows"] > 0

    capsys.readouterr()
    assert main(["gc", "--json", *overrides]) == 0
    assert json.loads(capsys.readouterr().out)["reclaim"]["checkpoints"]["count"] == 0
