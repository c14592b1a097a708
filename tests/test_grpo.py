"""The grpo stage on the demo task: per-step metrics, off-policy steps, overlong filtering,
resume after SIGKILL to the same weights, and TP2 / PP2 against TP1."""

import json
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
from alignflow.job.generation import Completion
from alignflow.job.stages import grpo
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import (
    briefly_tuned,
    assert_hardware_use,
    convert_demo,
    job_args,
    job_env,
    metrics_lines,
    prep_demo,
    stage_cfg,  # noqa: E402
    on_ranks,
    weights,
)

STEP_METRICS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length",
    "truncation_rate",
    "kl",
    "clip_fraction",
    "ratio",
    "token_mult_prob_error",
    "generation_tokens_per_s",
}


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    """Prep with prompts, and a briefly fine-tuned demo model (it answers with numbers, some right)."""
    root = tmp_path_factory.mktemp("grpo-inputs")
    data = str(prep_demo(demo_dir, root / "data", prompts=True))
    base = str(convert_demo(demo_dir, root / "base"))
    model = briefly_tuned(demo_dir, data, base, root / "sft")
    return {"data": data, "model": model, "ref_model": model}


def grpo_cfg(demo_dir, tp: int = 1, pp: int = 1, **section) -> dict:
    defaults = {
        "num_prompts_per_step": 4,
        "num_generations_per_prompt": 4,
        "micro_batch_size": 8,
        "generation_batch_size": 16,
        "max_new_tokens": 4,
        "environment": [{"name": "exact_match"}, {"name": "closeness"}],
        "trainer": {"max_steps": 3},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "weight_decay": 0.0},
    }
    merged = OmegaConf.to_container(OmegaConf.merge(defaults, section))
    return stage_cfg("grpo", demo_dir, tp, pp, **merged)


def run_grpo(cfg: dict, inputs: dict, out: Path) -> dict:
    return grpo.run(typed(cfg), inputs, str(out))


def test_grpo_trains_and_logs_every_metric(demo_dir, inputs, tmp_path):
    out = tmp_path / "out"
    result = run_grpo(grpo_cfg(demo_dir), inputs, out)
    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2, 3] and all(set(line) == STEP_METRICS for line in lines)
    assert list(result)[:4] == ["reward_first_tenth", "reward_last_tenth", "reward_mean", "accuracy"] and result["steps"] == 3
    assert result["reward_first_tenth"] == lines[0]["reward_mean"] and result["reward_last_tenth"] == lines[-1]["reward_mean"]
    assert_hardware_use(result, Path(inputs["model"]), 32 + 4, passes=1 + 1 + 3)  # prompt + completion; generation, reference, update
    assert 0 < result["generation_s"] < result["compute_s"]  # what `align plan` times by the decoding step (alignflow.orchestrator.cost)
    first = lines[0]
    assert first["kl"] == 0.0 and first["ratio"] == pytest.approx(1.0) and first["clip_fraction"] == 0.0  # on-policy, policy = reference
    assert all(line["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4) for line in lines)  # the decoder samples from the trained weights
    assert lines[-1]["kl"] > 0  # the policy moved away from the reference
    assert 0 < first["response_length"] <= 4 and 0 <= first["truncation_rate"] <= 1 and first["generation_tokens_per_s"] > 0
    assert 0 <= first["accuracy"] <= 1 and first["reward_mean"] >= first["accuracy"]  # exact match + closeness
    assert {p.name for p in out.iterdir()} >= {"model", "hf", "tokenizer", "metrics.jsonl", "checkpoints"}
    final, initial = weights(out / "model"), weights(Path(inputs["model"]) / "model")
    assert not torch.equal(final["output_layer.weight"], initial["output_layer.weight"])


def test_kl_to_the_reference_is_0_at_step_1_in_bf16(demo_dir, inputs, tmp_path):
    """The reference's log-probs (a forward-only pass in eval mode) and the policy's (the
    training forward) come from one attention kernel: at step 1, policy = reference, the KL is
    exactly 0 in bf16 too (3.4e-6 on main, where training took Megatron's unfused attention)."""
    run_grpo(grpo_cfg(demo_dir, precision="bf16", trainer={"max_steps": 1}), inputs, tmp_path / "out")
    first = metrics_lines(tmp_path / "out")[0]
    assert first["kl"] == 0.0 and first["clip_fraction"] == 0.0


def test_several_optimizer_steps_per_batch_are_off_policy_and_clipped(demo_dir, inputs, tmp_path):
    cfg = grpo_cfg(demo_dir, num_optimizer_steps_per_batch=2, loss={"ratio_clip_min": 0.01, "ratio_clip_max": 0.01}, trainer={"max_steps": 2})
    run_grpo(cfg, inputs, tmp_path / "out")
    lines = metrics_lines(tmp_path / "out")
    assert all(line["ratio"] != pytest.approx(1.0, abs=1e-7) for line in lines)  # the second update sees a moved policy
    assert any(line["clip_fraction"] > 0 for line in lines)


def test_overlong_filtering_keeps_truncated_samples_out_of_the_gradient(demo_dir, inputs, tmp_path):
    """With one new token nearly every sample is truncated (no EOS): filtered, those steps do
    not train at all, while the same rollouts unfiltered do."""
    cfg = grpo_cfg(demo_dir, max_new_tokens=1, trainer={"max_steps": 2})
    run_grpo(cfg, inputs, tmp_path / "kept")
    assert any(line["grad_norm"] > 0 for line in metrics_lines(tmp_path / "kept"))
    run_grpo({**cfg, "grpo": {**cfg["grpo"], "overlong_filtering": True}}, inputs, tmp_path / "filtered")
    lines = metrics_lines(tmp_path / "filtered")
    assert [line["truncation_rate"] for line in lines] == [line["truncation_rate"] for line in metrics_lines(tmp_path / "kept")]
    all_truncated = [line for line in lines if line["truncation_rate"] == 1.0]
    assert all_truncated and all(line["loss"] == 0.0 and line["grad_norm"] == 0.0 for line in all_truncated)


def test_dynamic_sampling_trains_only_groups_whose_rewards_differ(demo_dir, inputs, tmp_path):
    """DAPO's dynamic sampling with a reward that is 1 for one-digit answers: groups that all
    agree are dropped and further batches drawn, so every trained group teaches something:
    no step's advantages are all 0 (grad_norm > 0), and the draws are logged."""
    cfg = grpo_cfg(
        demo_dir,
        use_dynamic_sampling=True,
        dynamic_sampling_max_gen_batches=8,
        num_prompts_per_step=2,
        environment=[{"name": "test_grpo:single_digit"}],
        loss={"ref_policy_kl_penalty": 0.0},
        trainer={"max_steps": 3},
    )
    run_grpo(cfg, inputs, tmp_path / "out")
    lines = metrics_lines(tmp_path / "out")
    assert all(line["grad_norm"] > 0 for line in lines)
    assert all(1 <= line["dynamic_sampling_num_gen_batches"] <= 8 for line in lines)


def test_dynamic_sampling_stops_naming_its_key_when_no_group_differs(demo_dir, inputs, tmp_path):
    cfg = grpo_cfg(
        demo_dir,
        use_dynamic_sampling=True,
        dynamic_sampling_max_gen_batches=2,
        environment=[{"name": "test_grpo:constant"}],
        trainer={"max_steps": 1},
    )
    with pytest.raises(ValueError, match=r"grpo.dynamic_sampling_max_gen_batches: 2 batches gave fewer than num_prompts_per_step = 4 groups"):
        run_grpo(cfg, inputs, tmp_path / "out")


def test_overlong_penalty_lowers_the_reward_of_long_completions(demo_dir, inputs, tmp_path):
    """A constant reward of 1 less DAPO's overlong penalty (buffer 4 of max_new_tokens 4: -L/4):
    the logged mean reward is 1 - mean length / 4."""
    cfg = grpo_cfg(demo_dir, overlong_buffer_length=4, environment=[{"name": "test_grpo:constant"}], trainer={"max_steps": 1})
    run_grpo(cfg, inputs, tmp_path / "out")
    line = metrics_lines(tmp_path / "out")[0]
    assert line["reward_mean"] == pytest.approx(1 - line["response_length"] / 4)


@pytest.mark.parametrize(
    "loss",
    [
        {"loss_type": "dr_grpo", "kl_type": "k2"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "bnpo", "kl_type": "none", "ratio_clip_max": 0.28},
    ],
    ids=["dr_grpo-k2", "gspo", "bnpo-no-kl"],
)
def test_loss_variants_train_with_top_p_top_k_sampling(demo_dir, inputs, tmp_path, loss):
    """Each variant trains on filtered sampling; at step 1 the policy is the sampler, so the
    training log-probs (filtered) give ratio 1 and, with a KL, KL 0."""
    cfg = grpo_cfg(demo_dir, generation_top_p=0.9, generation_top_k=20, loss=loss, trainer={"max_steps": 2})
    run_grpo(cfg, inputs, tmp_path / "out")
    first = metrics_lines(tmp_path / "out")[0]
    assert first["ratio"] == pytest.approx(1.0) and first["kl"] == pytest.approx(0.0, abs=1e-7) and first["grad_norm"] > 0


def test_rollouts_train_only_completion_tokens_of_kept_samples():
    completions = [
        Completion([7, 2], [-0.4, -0.2], truncated=False, sampling_logps=[-0.5, -0.25]),  # drawn at a temperature
        Completion([9, 9, 9], [-1.0, -2.0, -3.0], truncated=True),
    ]
    rollouts = grpo.Rollouts([[1, 5, 6], [1, 5]], completions, torch.tensor([1.0, -1.0]), torch.tensor([True, False]), pad_id=0)
    batch = rollouts.collate([0, 1])
    assert batch["tokens"].tolist() == [[1, 5, 6, 7, 2], [1, 5, 9, 9, 9]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]  # position t predicts token t + 1
    assert batch["generation_logp"].tolist() == [[0, 0, -0.5, -0.25, 0], [0, -1.0, -2.0, -3.0, 0]]  # what each token was drawn from
    assert batch["advantages"].tolist() == [1.0, -1.0]


@pytest.mark.slow
def test_killed_grpo_job_resumes_to_the_uninterrupted_weights(demo_dir, inputs, tmp_path):
    """Rollouts are seeded by (seed, step, DP rank): a job killed after its first checkpoint
    and retried samples, scores and trains exactly as an uninterrupted one."""
    cfg = grpo_cfg(demo_dir, trainer={"max_steps": 6, "log_every_n_steps": 1}, checkpoint={"every_n_steps": 2})
    reference = tmp_path / "uninterrupted"
    run_grpo(cfg, inputs, reference)

    out = tmp_path / "killed"
    args = [*job_args(cfg, inputs, out), "--stage", "grpo", "--ref-model", inputs["ref_model"], "--pause-after-checkpoint", "60"]
    job = subprocess.Popen(
        [sys.executable, *args], cwd=PROJECT_ROOT, env=job_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    first = out / "checkpoints" / "step-00000002" / "complete"
    deadline = time.time() + 120
    while not first.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    assert first.exists() and job.returncode == -signal.SIGKILL, job.stdout.read().decode()[-3000:]

    resumed = run_grpo(cfg, inputs, out)
    assert resumed["steps"] == 6
    expected, got = weights(reference / "model"), weights(out / "model")
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    timing = ("tokens_per_s", "generation_tokens_per_s")
    strip = lambda lines: [{k: v for k, v in line.items() if k not in timing} for line in lines]  # noqa: E731
    assert strip(metrics_lines(out)) == strip(metrics_lines(reference))


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_ranks_match_one_rank(demo_dir, inputs, tmp_path, tp, pp):
    """Same rollouts (TP ranks draw the same tokens; PP stages pass hidden states and broadcast
    the tokens), rewards and losses as TP1 over 3 steps."""
    cfg = grpo_cfg(demo_dir, trainer={"log_every_n_steps": 1})
    run_grpo(cfg, inputs, tmp_path / "tp1")
    parallel = tmp_path / f"tp{tp}pp{pp}"
    ranks_cfg = grpo_cfg(demo_dir, tp=tp, pp=pp, trainer={"log_every_n_steps": 1})
    on_ranks(tp * pp, ranks_cfg, inputs, parallel, "--stage", "grpo", "--ref-model", inputs["ref_model"])
    for a, b in zip(metrics_lines(tmp_path / "tp1"), metrics_lines(parallel), strict=True):
        for key in ("reward_mean", "accuracy", "response_length", "loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-4), (key, a, b)
    assert json.loads((parallel / "result.json").read_text())["steps"] == 3


def single_digit(prompt: str, completion: str, answer: str, **_) -> float:
    """A reward the briefly fine-tuned demo model earns on some of its answers (one-digit numbers)."""
    text = completion.strip()
    return float(len(text) == 1 and text.isdigit())


def test_grpo_learns_to_earn_its_reward(demo_dir, inputs, tmp_path):
    """The mean reward rises within 30 steps: the policy gradient points the right way."""
    cfg = grpo_cfg(
        demo_dir,
        num_prompts_per_step=8,
        num_generations_per_prompt=8,
        micro_batch_size=64,
        generation_batch_size=64,
        generation_temperature=1.0,
        environment=[{"name": "test_grpo:single_digit"}],
        trainer={"max_steps": 30},
        loss={"ref_policy_kl_penalty": 0.0},
        optim={"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
    )
    run_grpo(cfg, inputs, tmp_path / "out")
    rewards = [line["reward_mean"] for line in metrics_lines(tmp_path / "out")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.2, rewards


def constant(prompt: str, completion: str, answer: str, **_) -> float:
    return 1.0


def nan_reward(prompt: str, completion: str, answer: str, **_) -> float:
    return float("nan")


def test_a_reward_that_is_not_a_number_stops_the_stage_naming_it(demo_dir, inputs, tmp_path):
    cfg = grpo_cfg(demo_dir, environment=[{"name": "test_grpo:nan_reward"}], trainer={"max_steps": 2})
    with pytest.raises(ValueError, match=r"grpo.environment: test_grpo.nan_reward returned nan \(not a finite number\) for prompt"):
        run_grpo(cfg, inputs, tmp_path / "out")
    assert not list((tmp_path / "out").glob("checkpoints/step-*/complete"))  # it stopped before its first step ended


@pytest.mark.slow
def test_a_moe_at_ep2_rolls_out_and_trains_as_at_ep1(demo_dir, tmp_path):
    """The demo Qwen3-MoE on 2 ranks (DP2), each rolling out its own prompts in 2 generation
    batches: with its experts split over EP2 (generation in step across the ranks, training
    through Megatron's alltoall dispatcher) the rewards, KL and losses are EP1's."""
    model = str(convert_demo(demo_dir, tmp_path / "moe", "tiny-qwen3-moe"))
    moe = {"data": str(prep_demo(demo_dir, tmp_path / "data", prompts=True)), "model": model, "ref_model": model}
    runs = {}
    for ep in (1, 2):
        runs[ep] = tmp_path / f"ep{ep}"
        cfg = grpo_cfg(
            demo_dir,
            generation_batch_size=4,
            resources={"tasks_per_node": 2},
            parallel={"expert_model_parallel_size": ep},
            trainer={"max_steps": 2, "log_every_n_steps": 1},
        )
        on_ranks(2, cfg, moe, runs[ep], "--stage", "grpo", "--ref-model", model)
    for a, b in zip(metrics_lines(runs[1]), metrics_lines(runs[2]), strict=True):
        assert b["response_length"] == a["response_length"] and b["reward_mean"] == a["reward_mean"], (a, b)
        for key in ("loss", "kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (key, a, b)
