"""The engine's scale features on CPU, each against an independent reference: bf16 mixed
precision against fp32, the distributed optimizer (with overlapped communication, as on GPU)
against plain data parallelism, activation recompute against none, and a run checkpointed at
DP2 resumed at TP2, PP2 and DP1 against the run that went on at DP2."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import tensor_parallel

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import LAYOUT_TOLERANCE, convert_demo, metrics_lines, prep_demo, run_sft, sft_cfg, on_ranks, weights  # noqa: E402


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scale-inputs")
    return {"data": str(prep_demo(demo_dir, root / "data")), "model": str(convert_demo(demo_dir, root / "model"))}


def losses(out: Path) -> list[float]:
    return [line["loss"] for line in metrics_lines(out)]


def test_bf16_tracks_fp32_for_20_steps(demo_dir, inputs, tmp_path):
    """bf16 weights and activations with fp32 main weights: every step's loss within 2% of fp32's,
    the loss goes down, and the checkpoint holds bf16 weights."""
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = sft_cfg(demo_dir, precision=precision, trainer={"max_steps": 20, "val_check_interval": 20}, optim={"lr": 3e-3, "warmup_steps": 2})
        run_sft(cfg, inputs, tmp_path / precision)
        runs[precision] = losses(tmp_path / precision)
    deltas = [abs(b - a) / a for a, b in zip(runs["fp32"], runs["bf16"])]
    print(f"bf16 vs fp32 over 20 steps: max relative loss delta {max(deltas):.2e}, final {runs['fp32'][-1]:.4f} vs {runs['bf16'][-1]:.4f}")
    assert len(deltas) == 20 and max(deltas) < 0.02
    assert runs["bf16"][-1] < runs["bf16"][0] - 0.5
    assert weights(tmp_path / "bf16" / "model")["output_layer.weight"].dtype == torch.bfloat16


def test_activation_recompute_gives_the_same_steps(demo_dir, inputs, tmp_path, monkeypatch):
    """Selective and full (uniform, block) recompute re-run the forward in the backward pass with the
    RNG states of the first run (dropout on, and it matters): the same losses and weights as none."""
    settings = {
        "none": {},
        "selective": {"recompute_granularity": "selective"},
        "full-uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        "full-block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    }
    recomputed = {}
    for name, knobs in settings.items():
        calls = []
        monkeypatch.setattr(
            tensor_parallel, "checkpoint", lambda *args, checkpoint=tensor_parallel.checkpoint, calls=calls: calls.append(1) or checkpoint(*args)
        )
        cfg = sft_cfg(demo_dir, precision="bf16", hidden_dropout=0.1, attention_dropout=0.1, trainer={"max_steps": 3}, **knobs)
        run_sft(cfg, inputs, tmp_path / name)
        monkeypatch.undo()
        recomputed[name] = len(calls)
    run_sft(sft_cfg(demo_dir, precision="bf16", trainer={"max_steps": 3}), inputs, tmp_path / "no-dropout")
    assert recomputed["none"] == 0 and all(recomputed[name] > 0 for name in settings if name != "none"), recomputed
    assert losses(tmp_path / "no-dropout") != losses(tmp_path / "none")
    reference = weights(tmp_path / "none" / "model")
    for name in settings:
        assert losses(tmp_path / name) == losses(tmp_path / "none"), name
        got = weights(tmp_path / name / "model")
        assert all(torch.equal(got[k], reference[k]) for k in reference), name


@pytest.mark.slow
def test_distributed_optimizer_at_dp2_matches_plain_dp2(demo_dir, inputs, tmp_path):
    """ZeRO-1 (reduce-scatter of fp32 gradients, each rank stepping its shard of the fp32 main
    weights, all-gather of the weights) with the gradient reduction overlapped with the backward
    pass and the weight gather with the next forward, as on GPU: the same steps as all-reduce DP.
    Clipping off: the grad norm sums its squares shard by shard, in another order (its last
    bits differ), and a clipped step scales by it, so whether a bf16 weight's rounding flips
    would be luck."""
    runs = {}
    for name, parallel in (
        ("plain", {}),
        ("distributed", {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}),
    ):
        cfg = sft_cfg(
            demo_dir,
            precision="bf16",
            resources={"tasks_per_node": 2},
            parallel=parallel,
            trainer={"max_steps": 5, "val_check_interval": 5, "gradient_clip_val": 0.0},
        )
        on_ranks(2, cfg, inputs, tmp_path / name)
        runs[name] = metrics_lines(tmp_path / name)
    plain, distributed = weights(tmp_path / "plain" / "model"), weights(tmp_path / "distributed" / "model")
    weight_delta = max((plain[k].float() - distributed[k].float()).abs().max().item() for k in plain)
    loss_delta = max(abs(a["loss"] - b["loss"]) for a, b in zip(runs["plain"], runs["distributed"], strict=True))
    print(f"distributed optimizer vs plain DP2: max |loss delta| {loss_delta:.2e}, max |weight delta| {weight_delta:.2e}")
    for a, b in zip(runs["plain"], runs["distributed"]):  # the grad norm sums its squares shard by shard
        assert [a["loss"], a.get("val_loss")] == [b["loss"], b.get("val_loss")] and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert weight_delta == 0


@pytest.mark.slow
def test_a_run_checkpointed_at_dp2_resumes_at_another_layout(demo_dir, inputs, tmp_path):
    """bf16 with the distributed optimizer at DP2, checkpointed at step 3 of 6, resumed from that
    checkpoint at TP2, PP2 and DP1 (weights, fp32 main weights and Adam states resharded; RNG
    states not needed: no dropout): steps 4-6 continue the DP2 run's losses within bf16's
    layout tolerance (as a bf16 run at TP2 tracks one at TP1); resumed at DP2 again they and
    the final weights are bit-exact."""
    base = dict(
        precision="bf16",
        parallel={"use_distributed_optimizer": True},
        trainer={"max_steps": 6, "val_check_interval": 6},
        checkpoint={"every_n_steps": 3, "save_top_k": -1},
    )
    first = tmp_path / "dp2"
    on_ranks(2, sft_cfg(demo_dir, resources={"tasks_per_node": 2}, **base), inputs, first)
    expected = losses(first)
    for name, (tp, pp, ranks) in {"tp2": (2, 1, 2), "pp2": (1, 2, 2), "dp1": (1, 1, 1), "dp2-again": (1, 1, 2)}.items():
        out = tmp_path / name
        shutil.copytree(first, out)
        shutil.rmtree(out / "checkpoints" / "step-00000006")
        cfg = sft_cfg(demo_dir, tp=tp, pp=pp, resources={"tasks_per_node": ranks}, **base)
        on_ranks(ranks, cfg, inputs, out) if ranks > 1 else run_sft(cfg, inputs, out)
        got = losses(out)
        print(f"resumed at {name}: max |loss - dp2| over steps 4-6 = {max(abs(a - b) for a, b in zip(expected[3:], got[3:])):.2e}")
        assert len(got) == 6 and got[:3] == expected[:3]
        if name == "dp2-again":
            assert got == expected
            final, resumed = weights(first / "model"), weights(out / "model")
            assert all(torch.equal(final[k], resumed[k]) for k in final)
        else:
            assert got[3:] == pytest.approx(expected[3:], abs=LAYOUT_TOLERANCE["bf16"])
