"""The SFT stage end to end on the demo task: TP2 and PP2 reproduce TP1, a job killed with
SIGKILL resumes to the same weights as an uninterrupted one, and the val loss goes down."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from alignflow import PROJECT_ROOT

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import (
    LAYOUT_TOLERANCE,
    SEQ_LENGTH,
    assert_hardware_use,
    assert_same_steps,
    convert_demo,
    job_args,  # noqa: E402
    job_env,
    metrics_lines,
    prep_demo,
    run_sft,
    sft_cfg,
    on_ranks,
    weights,
)


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-inputs")
    return {"data": str(prep_demo(demo_dir, root / "data")), "model": str(convert_demo(demo_dir, root / "model"))}


@pytest.fixture(scope="module")
def other_models(inputs, demo_dir, tmp_path_factory):
    """The same data with a 4-layer model (PP2 VP2: 2 chunks of 1 layer per stage) or a tied one
    (PP2: the embedding's copy on the last stage gets the first stage's gradient too)."""
    root = tmp_path_factory.mktemp("sft-models")
    return {
        "4-layers": {**inputs, "model": str(convert_demo(demo_dir, root / "four-layers", num_hidden_layers=4))},
        "tied": {**inputs, "model": str(convert_demo(demo_dir, root / "tied", tie_word_embeddings=True))},
    }


def test_sft_writes_the_model_layout_and_metrics(demo_dir, inputs, tmp_path):
    out = tmp_path / "out"
    metrics = run_sft(sft_cfg(demo_dir, trainer={"max_steps": 3, "val_check_interval": 2}), inputs, out)
    assert metrics["steps"] == 3 and metrics["tokens"] > 0 and metrics["tokens_per_s"] > 0
    assert_hardware_use(metrics, Path(inputs["model"]), SEQ_LENGTH, passes=3)
    assert {p.name for p in out.iterdir()} >= {"model", "hf", "tokenizer", "metrics.jsonl", "checkpoints"}
    assert (out / "hf" / "config.json").exists() and (out / "tokenizer" / "tokenizer.json").exists()
    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert set(lines[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"}
    assert [("val_loss" in line) for line in lines] == [False, True, True]
    assert lines[-1]["loss"] == pytest.approx(metrics["train_loss"]) and lines[-1]["val_loss"] == pytest.approx(metrics["val_loss"])
    final, initial = weights(out / "model"), weights(Path(inputs["model"]) / "model")
    assert final.keys() == initial.keys() and not torch.equal(final["output_layer.weight"], initial["output_layer.weight"])
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,dp,vp,model,precision",
    [
        (2, 1, 1, None, None, "fp32"),
        (1, 2, 1, None, None, "fp32"),
        (1, 1, 2, None, None, "fp32"),
        (1, 2, 1, 2, "4-layers", "fp32"),
        (1, 2, 1, None, "tied", "fp32"),
        (2, 1, 1, None, None, "bf16"),
        (1, 2, 1, None, None, "bf16"),
        (1, 1, 2, None, None, "bf16"),
    ],
    ids=["tp2", "pp2", "dp2", "pp2-vp2", "pp2-tied", "tp2-bf16", "pp2-bf16", "dp2-bf16"],
)
def test_two_ranks_match_one_rank(demo_dir, inputs, other_models, tmp_path, tp, pp, dp, vp, model, precision):
    """Same losses, grad norms and val loss over 5 steps as TP1 at the same precision, within
    LAYOUT_TOLERANCE (4 micro batches of 2 rows per step: PP2 pipelines them, interleaved with
    virtual PP on a 4-layer model, DP2 splits them and reduces the gradients; with tied
    embeddings PP2 also ties the two copies' grads)."""
    inputs = other_models[model] if model else inputs
    reference = tmp_path / "tp1"
    run_sft(sft_cfg(demo_dir, precision=precision, trainer={"val_check_interval": 5}), inputs, reference)
    parallel = tmp_path / f"tp{tp}pp{pp}dp{dp}"
    cfg = sft_cfg(
        demo_dir,
        tp=tp,
        pp=pp,
        precision=precision,
        resources={"tasks_per_node": tp * pp * dp},
        trainer={"val_check_interval": 5},
        parallel={"virtual_pipeline_model_parallel_size": vp},
    )
    on_ranks(tp * pp * dp, cfg, inputs, parallel)
    assert_same_steps(reference, parallel, LAYOUT_TOLERANCE[precision])
    assert json.loads((parallel / "result.json").read_text())["steps"] == 5


@pytest.mark.slow
def test_moe_at_ep2_matches_ep1(demo_dir, inputs, tmp_path):
    """A random Qwen3-MoE of the demo's shape (4 experts, top 2) with output_router_logits on, on
    2 ranks: its experts split over EP2 (Megatron's forward: the alltoall dispatcher on gloo,
    expert grads reduced over the expert-data-parallel group) give EP1's (the lean forward)
    losses, HF's load-balancing aux losses (each rank's routers see the same tokens at both),
    grad norms and val loss over 5 steps within 1e-5 (both DP2: the same data split)."""
    model = convert_demo(demo_dir, tmp_path / "moe", "tiny-qwen3-moe", output_router_logits=True, router_aux_loss_coef=0.5)
    moe = {**inputs, "model": str(model)}
    runs = {}
    for ep in (1, 2):
        runs[ep] = tmp_path / f"ep{ep}"
        on_ranks(
            2,
            sft_cfg(demo_dir, resources={"tasks_per_node": 2}, trainer={"val_check_interval": 5}, parallel={"expert_model_parallel_size": ep}),
            moe,
            runs[ep],
        )
    assert_same_steps(runs[1], runs[2], 1e-5, keys=("loss", "aux_loss", "grad_norm", "val_loss", "val_aux_loss"))
    assert min(line["aux_loss"] for line in metrics_lines(runs[1])) > 1.0  # top 2 of 4: at least 2 (HF's), x 0.5 in the loss
    assert weights(runs[2] / "model").keys() == weights(Path(moe["model"]) / "model").keys()


@pytest.mark.slow
def test_killed_job_resumes_to_the_uninterrupted_weights(demo_dir, inputs, tmp_path, caplog):
    """SIGKILL after the first checkpoint, a half-written later checkpoint left behind, and the
    retry on the same `out` ends with bit-identical weights and the same metrics (dropout on,
    so the RNG states must be restored too)."""
    cfg = sft_cfg(
        demo_dir,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        trainer={"max_steps": 8, "val_check_interval": 2, "log_every_n_steps": 1},
        checkpoint={"every_n_steps": 3, "save_top_k": 1},
    )
    reference = tmp_path / "uninterrupted"
    run_sft(cfg, inputs, reference)

    out = tmp_path / "killed"
    job = subprocess.Popen(
        [sys.executable, *job_args(cfg, inputs, out), "--pause-after-checkpoint", "60"],
        cwd=PROJECT_ROOT,
        env=job_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    first = out / "checkpoints" / "step-00000003" / "complete"
    deadline = time.time() + 120
    while not first.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGKILL)  # the job and the checkpoint writer it may have spawned
    job.wait(timeout=30)
    assert first.exists() and job.returncode == -signal.SIGKILL, job.stdout.read().decode()[-3000:]
    assert not (out / "model").exists()
    (out / "checkpoints" / ".tmp-step-00000006" / "model").mkdir(parents=True)  # as if killed while writing step 6
    (out / "checkpoints" / "step-00000006").mkdir()  # renamed, but never marked complete
    with (out / "metrics.jsonl").open("a") as f:  # a line logged after the checkpoint, before the kill
        f.write(json.dumps({"step": 4, "loss": 0.0}) + "\n")

    with caplog.at_level(logging.INFO, logger="alignflow"):
        resumed = run_sft(cfg, inputs, out)
    assert f"resumed from {out / 'checkpoints' / 'step-00000003'} (step 3 of 8)" in caplog.text
    assert resumed["steps"] == 8
    expected, got = weights(reference / "model"), weights(out / "model")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    strip = lambda lines: [{k: v for k, v in line.items() if k != "tokens_per_s"} for line in lines]  # noqa: E731
    assert strip(metrics_lines(out)) == strip(metrics_lines(reference))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == sorted(p.name for p in (reference / "checkpoints").iterdir())


def as_a_gpu_job_writes_it(rank_file: Path) -> None:
    """A rank file of this CPU run rewritten as a GPU job writes it: Megatron's tracker holds
    CUDA generator states (Philox: 8 bytes of seed, 8 of offset) and CUDA's own state is
    beside the host's (python, numpy, torch: kept as drawn here)."""
    saved = torch.load(rank_file, weights_only=True)
    philox = lambda seed: torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)  # noqa: E731
    assert set(saved["rng"]) == {"python", "numpy", "torch", "tracker"} and saved["rng"]["tracker"]
    saved["rng"]["tracker"] = {name: philox(3952 + i) for i, name in enumerate(saved["rng"]["tracker"])}
    saved["rng"]["cuda"] = philox(1234)
    torch.save(saved, rank_file)


def test_a_checkpoint_written_on_gpu_resumes_on_cpu(demo_dir, inputs, tmp_path, caplog):
    """With dropout on (attention dropout draws from Megatron's tracker), a CPU job resumes the
    checkpoint a GPU job wrote, re-seeding the device's RNG states and saying so; it used to
    crash at the first forward ("Expected a CPUGeneratorImplState of size 5056 ... 16")."""
    cfg = sft_cfg(
        demo_dir, hidden_dropout=0.1, attention_dropout=0.1, trainer={"max_steps": 2, "val_check_interval": 2}, checkpoint={"every_n_steps": 2}
    )
    out = tmp_path / "out"
    run_sft(cfg, inputs, out)
    as_a_gpu_job_writes_it(out / "checkpoints" / "step-00000002" / "rank-00000.pt")
    cfg["sft"]["trainer"]["max_steps"] = 4
    with caplog.at_level(logging.INFO, logger="alignflow"):
        assert run_sft(cfg, inputs, out)["steps"] == 4
    assert (
        f"{out / 'checkpoints' / 'step-00000002'} was written on cuda, this job runs on cpu: RNG states tracker, cuda "
        "re-seeded (as this job's start seeded them from trainer.seed), python, numpy and torch restored"
    ) in caplog.text
    assert [line["step"] for line in metrics_lines(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_sft_lowers_the_val_loss_on_the_demo_task(demo_dir, inputs, tmp_path):
    cfg = sft_cfg(
        demo_dir,
        micro_batch_size=4,
        global_batch_size=16,
        trainer={"max_steps": 80, "val_check_interval": 10, "limit_val_batches": 4, "log_every_n_steps": 10},
        optim={"lr": 3e-3, "warmup_steps": 5, "min_lr": 3e-4},
        checkpoint={"every_n_steps": 40, "save_top_k": 1},
    )
    started = time.time()
    metrics = run_sft(cfg, inputs, tmp_path / "out")
    val = [line["val_loss"] for line in metrics_lines(tmp_path / "out") if "val_loss" in line]
    print(f"val loss {val[0]:.3f} -> {val[-1]:.3f} in {time.time() - started:.1f} s")
    assert len(val) == 8 and metrics["val_loss"] == pytest.approx(val[-1])
    assert val[-1] < val[0] - 1.0 and val[-1] < 2.5


def test_early_stopping_ends_the_run_and_a_retry_does_not_continue_it(demo_dir, inputs, tmp_path):
    cfg = sft_cfg(
        demo_dir,
        trainer={
            "max_steps": 20,
            "val_check_interval": 2,
            "early_stopping_patience": 1,
            "early_stopping_min_delta": 100.0,
        },  # no validation can improve by that much
        checkpoint={"every_n_steps": 10},
    )
    first = run_sft(cfg, inputs, tmp_path / "out")
    assert first["stopped_early"] and first["steps"] == 4  # validations at 2 (best) and 4 (no improvement)
    again = run_sft(cfg, inputs, tmp_path / "out")
    assert again["stopped_early"] and again["steps"] == 4 and again["val_loss"] == first["val_loss"]


def test_wandb_offline_run_continues_after_a_retry(demo_dir, inputs, tmp_path):
    cfg = sft_cfg(demo_dir, trainer={"max_steps": 2}, checkpoint={"every_n_steps": 1})
    cfg["logging"]["wandb"].update(enabled=True, project="alignflow-test")
    out = tmp_path / "out"
    run_sft(cfg, inputs, out)
    run_id = (out / "checkpoints" / "wandb-run-id").read_text()
    cfg["sft"]["trainer"]["max_steps"] = 3
    run_sft(cfg, inputs, out)  # a longer run on the same out resumes at step 2, same wandb run
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)
    assert (out / "checkpoints" / "wandb-run-id").read_text() == run_id


@pytest.mark.parametrize(
    "sft_override,message",
    [
        ({"parallel": {"context_parallel_size": 2}}, "context_parallel_size > 1"),
        ({"parallel": {"sequence_parallel": True}}, "sequence_parallel needs Transformer Engine"),
    ],
    ids=["cp", "sp"],
)
def test_unsupported_settings_fail_before_training(demo_dir, inputs, tmp_path, sft_override, message):
    with pytest.raises(NotImplementedError, match=message):
        run_sft(sft_cfg(demo_dir, **sft_override), inputs, tmp_path / "out")


@pytest.mark.slow
def test_a_two_rank_submitit_job_trains_through_the_worker(demo_dir, inputs, tmp_path):
    """The production path: `alignflow.orchestrator.launch` submits `alignflow.job.worker.run_stage_job` on 2 local
    ranks (TP2); rank 0 returns the metrics and prints the progress lines."""
    from alignflow.orchestrator.config.schema import LauncherConfig
    from alignflow.orchestrator.launch import make_executor, wait
    from alignflow.job.worker import job_record, run_stage_job

    cfg = sft_cfg(demo_dir, tp=2, trainer={"max_steps": 3, "val_check_interval": 3})
    launcher = OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": str(tmp_path / "jobs")})
    job = make_executor(launcher, OmegaConf.create(cfg["sft"]), "sft").submit(run_stage_job, "sft", cfg, inputs, str(tmp_path / "out"), {})
    lines = []
    metrics = wait(job, lines.append, poll_s=0.5)
    assert metrics["steps"] == 3 and metrics["val_loss"] is not None
    assert [r["train_loss"] for r in job.results()] == [metrics["train_loss"]] * 2
    steps = [record["event"] for line in lines if (record := job_record(line)) and record["logger"] == "alignflow.job.train" and "event" in record]
    assert steps[-1]["step"] == steps[-1]["total"] == 3 and "loss" in steps[-1], lines[-20:]
    assert len(metrics_lines(tmp_path / "out")) == 3
