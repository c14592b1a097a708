"""Knowledge distillation: the top-k KL on worked examples and against torch's kl_div, the
teacher's top-k against HF transformers', the student's held-out KL falling, tokenizers
checked at compose, and teacher_logprobs at TP2 / PP2 equal to TP1."""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from alignflow.orchestrator.config.compose import ConfigError, compose
from alignflow.orchestrator.config.schema import DistillationLossConfig
from alignflow.job.data import teacher_topk
from alignflow.job.data.prepared import Prepared
from alignflow.job.losses.distillation import topk_kl
from alignflow.job.model import runtime
from alignflow.job.model.vocab_parallel import logprobs_at, topk_logprobs
from alignflow.job.stages import convert, distillation, eval as eval_stage, sft, teacher_logprobs
from alignflow.job.train.datasets import DistillRows, PackedSFT
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import assert_hardware_use, convert_demo, metrics_lines, prep_demo, stage_cfg, on_ranks  # noqa: E402

K = 8

# ------------------------------------------------------------------ the loss on worked examples

# Full-vocab teacher and student probabilities over 5 tokens; the teacher's top-3 are ids 0, 1, 2.
TEACHER = torch.tensor([0.4, 0.24, 0.16, 0.12, 0.08])
STUDENT = torch.tensor([0.2, 0.2, 0.4, 0.1, 0.1])
TOP = torch.tensor([0, 1, 2])
# By hand: renormalised over the top-3, p = [0.5, 0.3, 0.2] and q = [0.25, 0.25, 0.5].
WORKED = {
    "forward": 0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4),  # sum p log(p / q)
    "reverse": 0.25 * math.log(0.5) + 0.25 * math.log(0.25 / 0.3) + 0.5 * math.log(2.5),  # sum q log(q / p)
    "forward_full": 0.5 * math.log(2.5) + 0.3 * math.log(1.5) + 0.2 * math.log(0.5),  # q = the student's full-vocab [0.2, 0.2, 0.4]
}


@pytest.mark.parametrize(
    "kl_type, zero_outside_topk, expected",
    [
        ("forward", False, WORKED["forward"]),
        ("reverse", False, WORKED["reverse"]),
        ("mixed", False, 0.3 * WORKED["forward"] + 0.7 * WORKED["reverse"]),
        ("forward", True, WORKED["forward_full"]),
    ],
)
def test_topk_kl_on_a_worked_example(kl_type, zero_outside_topk, expected):
    cfg = DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=0.3, zero_outside_topk=zero_outside_topk)
    got = topk_kl(STUDENT.log()[TOP], TEACHER.log()[TOP], cfg)
    assert got.item() == pytest.approx(expected, abs=1e-6)


def test_topk_kl_equals_torch_kl_div_on_random_distributions():
    """Forward and reverse KL on the renormalised top-k against torch.nn.functional.kl_div
    (kl_div(input=log q, target=log p) = sum p (log p - log q))."""
    torch.manual_seed(0)
    teacher, student = torch.randn(3, 7, 50).log_softmax(-1), torch.randn(3, 7, 50).log_softmax(-1)
    top = teacher.topk(K, dim=-1).indices
    t, s = teacher.gather(-1, top), student.gather(-1, top)
    p, q = t.log_softmax(-1), s.log_softmax(-1)
    forward = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    reverse = F.kl_div(p, q, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(topk_kl(s, t, DistillationLossConfig(kl_type="forward")), forward, atol=1e-6)
    assert torch.allclose(topk_kl(s, t, DistillationLossConfig(kl_type="reverse")), reverse, atol=1e-6)
    full = F.kl_div(s, p, log_target=True, reduction="none").sum(-1)  # the student's mass outside the top-k counts
    assert torch.allclose(topk_kl(s, t, DistillationLossConfig(zero_outside_topk=True)), full, atol=1e-6)


@pytest.fixture
def one_rank():
    runtime.init_parallel(eval_stage.SINGLE_RANK)
    yield
    runtime.teardown()


def test_vocab_parallel_logprobs_on_one_rank_are_log_softmax_without_the_padded_rows(one_rank):
    torch.manual_seed(0)
    logits, vocab = torch.randn(2, 5, 16), 13  # 3 padded rows, whose logits a softmax must not see
    expected = logits[..., :vocab].log_softmax(-1)
    ids = torch.randint(0, vocab, (2, 5, 4))
    assert torch.allclose(logprobs_at(logits, ids, vocab), expected.gather(-1, ids), atol=1e-6)
    logits[..., vocab:] = 100.0
    logp, top = topk_logprobs(logits, K, vocab)
    assert torch.equal(top, expected.topk(K, dim=-1).indices) and torch.allclose(logp, expected.topk(K, dim=-1).values, atol=1e-6)


def test_the_stage_loss_is_kl_and_nll_from_explicit_distributions(one_rank):
    """The distillation objective on a batch: sums of (1 - w) x KL + w x NLL over the loss
    positions, against kl_div and cross_entropy on the explicit softmax."""
    torch.manual_seed(1)
    b, s, v = 2, 6, 20
    logits, teacher = torch.randn(b, s, v, requires_grad=True), torch.randn(b, s, v).log_softmax(-1)
    t_logp, t_ids = teacher.topk(K, dim=-1)
    batch = {"labels": torch.randint(0, v, (b, s)), "teacher_ids": t_ids, "teacher_logp": t_logp, "loss_mask": (torch.rand(b, s) < 0.6).float()}
    cfg = DistillationLossConfig(sft_loss_weight=0.25)
    terms = distillation.distillation_objective(cfg, v).loss(logits, batch)
    student = logits.log_softmax(-1)
    kl = F.kl_div(student.gather(-1, t_ids).log_softmax(-1), t_logp.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    nll = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    mask = batch["loss_mask"]
    assert terms.count.item() == mask.sum().item()
    assert terms.total.item() == pytest.approx(((0.75 * kl + 0.25 * nll) * mask).sum().item(), abs=1e-5)
    assert terms.metrics["kl"].item() == pytest.approx((kl * mask).sum().item(), abs=1e-5)
    assert terms.metrics["sft_loss"].item() == pytest.approx((nll * mask).sum().item(), abs=1e-5)
    terms.total.backward()
    assert logits.grad[mask == 0].abs().max() == 0 and logits.grad[mask == 1].abs().max() > 0


# ------------------------------------------------------------------ the stages on the demo


def convert_model(source: Path, tokenizer: Path, out: Path) -> Path:
    convert.run(
        typed(
            {
                "model": {"source": str(source), "hf_config": None, "tokenizer": str(tokenizer), "make_vocab_size_divisible_by": 128},
                "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
            }
        ),
        {},
        str(out),
    )
    return out


def topk_cfg(k: int = K, **section) -> dict:
    return {
        "teacher_logprobs": {"micro_batch_size": 7, "topk_logits_k": k, "parallel": eval_stage.SINGLE_RANK, **section},
        "model": {"make_vocab_size_divisible_by": 128},
    }


@pytest.fixture(scope="module")
def demo(demo_dir, tmp_path_factory):
    """The demo's SFT rows, its Llama after a short SFT as the teacher (a teacher worth
    imitating), the teacher's top-k on the rows, and the smaller student Llama."""
    root = tmp_path_factory.mktemp("distill")
    data = prep_demo(demo_dir, root / "prep")
    base = convert_demo(demo_dir, root / "base")
    cfg = stage_cfg(
        "sft",
        demo_dir,
        micro_batch_size=4,
        global_batch_size=16,
        trainer={"max_steps": 60, "val_check_interval": 60},
        optim={"lr": 3e-3, "warmup_steps": 5},
    )
    sft.run(typed(cfg), {"data": str(data), "model": str(base)}, str(root / "teacher"))
    teacher_logprobs.run(typed(topk_cfg()), {"data": str(data), "teacher": str(root / "teacher")}, str(root / "topk"))
    student = convert_model(demo_dir / "tiny-llama-student", demo_dir / "tokenizer", root / "student")
    return {"root": root, "data": str(data), "base": str(base), "teacher": str(root / "teacher"), "topk": str(root / "topk"), "student": str(student)}


def test_teacher_topk_equal_hf_transformers_topk(demo, demo_dir, tmp_path):
    """The stage on the demo's HF Llama: at every loss position of sampled val rows (packed
    documents), its top-k log-probs equal HF's top-k of each document run alone, and HF's
    log-probs of the stage's ids are the stage's (so near-ties may swap places, nothing else)."""
    metrics = teacher_logprobs.run(typed(topk_cfg(precision="fp32")), {"data": demo["data"], "teacher": demo["base"]}, str(tmp_path / "topk"))
    rows = PackedSFT(Prepared(demo["data"]), "val")
    got = teacher_topk.read(str(tmp_path / "topk"), "val", len(rows))
    assert metrics["val.rows"] == len(rows) and metrics["val.positions"] == len(got.positions) > 0
    assert_hardware_use(metrics, Path(demo["base"]), rows.seq_length, passes=1)
    hf = AutoModelForCausalLM.from_pretrained(demo_dir / "tiny-llama", dtype=torch.float32).eval()
    tolerance = 3e-4 if torch.cuda.is_available() else 1e-4  # CUDA: the stage's fp32 matmuls take TF32 (1.5e-4 seen on an H100)
    checked = 0
    for i in range(0, len(rows), max(len(rows) // 6, 1)):
        ids, _, cu = rows.row(i)
        positions, top_ids, top_logp = got.row(i)
        for a, b in zip(cu[:-1], cu[1:]):
            inside = (positions >= a) & (positions < b)
            if not inside.any():
                continue
            with torch.no_grad():
                logp = hf(torch.from_numpy(ids[a:b].astype(np.int64))[None]).logits[0].log_softmax(-1)
            at = torch.from_numpy(positions[inside] - a)
            expected = logp[at].topk(K, dim=-1).values.numpy()
            picked = logp[at].gather(-1, torch.from_numpy(top_ids[inside].astype(np.int64))).numpy()
            assert np.abs(top_logp[inside] - expected).max() < tolerance
            assert np.abs(top_logp[inside] - picked).max() < tolerance
            checked += int(inside.sum())
    assert checked > 20


def test_distill_rows_align_the_teacher_topk_to_the_packed_loss_positions(demo):
    rows = DistillRows(Prepared(demo["data"]), "train", demo["topk"])
    batch = rows.collate([3, 0, 5])
    mask = batch["loss_mask"].bool()
    assert batch["teacher_ids"].shape == (*batch["tokens"].shape, K)
    assert (batch["teacher_logp"][mask] < 0).all() and (batch["teacher_logp"][~mask] == 0).all()
    assert (batch["teacher_logp"][mask][:, :-1] >= batch["teacher_logp"][mask][:, 1:]).all()  # best first
    # a trained teacher's top-1 is mostly the label it was trained on
    top1 = (batch["teacher_ids"][mask][:, 0] == batch["labels"][mask]).float().mean().item()
    print(f"teacher top-1 = label at {top1:.2f} of the loss positions")
    assert top1 > 0.3


def test_the_students_heldout_kl_to_the_teacher_falls(demo, demo_dir, tmp_path):
    cfg = stage_cfg(
        "distillation",
        demo_dir,
        micro_batch_size=4,
        global_batch_size=16,
        loss={"sft_loss_weight": 0.25},
        trainer={"max_steps": 30, "val_check_interval": 5, "log_every_n_steps": 1, "limit_val_batches": 4},
        optim={"lr": 3e-3, "warmup_steps": 3},
    )
    inputs = {"data": demo["data"], "model": demo["student"], "teacher_logprobs": demo["topk"]}
    metrics = distillation.run(typed(cfg), inputs, str(tmp_path / "out"))
    lines = metrics_lines(tmp_path / "out")
    val = [line["val_kl"] for line in lines if "val_kl" in line]
    print("held-out KL to the teacher every 5 steps:", [round(v, 4) for v in val], "train kl", lines[0]["kl"], "->", lines[-1]["kl"])
    assert metrics["steps"] == 30 and (tmp_path / "out" / "model" / ".metadata").exists()
    assert_hardware_use(metrics, Path(demo["student"]), Prepared(demo["data"]).seq_length, passes=3)
    assert len(val) == 6 and val[-1] < 0.8 * val[0] and val[-1] == min(val)
    assert lines[-1]["kl"] < 0.5 * lines[0]["kl"]
    for line in lines:
        assert line["loss"] == pytest.approx(0.75 * line["kl"] + 0.25 * line["sft_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_teacher_logprobs_at_tp2_and_pp2_equal_tp1(demo, tmp_path, tp, pp):
    layout = {
        "resources": {"tasks_per_node": 2},
        "parallel": {**eval_stage.SINGLE_RANK, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
    }
    inputs = {"data": demo["data"], "model": demo["teacher"]}
    on_ranks(2, topk_cfg(**layout), inputs, tmp_path / "two", "--stage", "teacher_logprobs")
    for split in ("train", "val"):
        n = len(PackedSFT(Prepared(demo["data"]), split))
        one, two = teacher_topk.read(demo["topk"], split, n), teacher_topk.read(str(tmp_path / "two"), split, n)
        assert np.array_equal(one.positions, two.positions) and np.array_equal(one.off, two.off)
        assert np.abs(one.logprobs - two.logprobs).max() < 1e-4
        assert (one.ids == two.ids).mean() > 0.999  # near-ties may swap neighbours
    assert json.loads((tmp_path / "two" / "result.json").read_text())["train.rows"] == len(PackedSFT(Prepared(demo["data"]), "train"))


# ------------------------------------------------------------------ compose-time checks


def other_tokenizer(demo_dir: Path, dest: Path, swap: bool) -> Path:
    """A copy of the demo tokenizer, with the ids of two tokens swapped when `swap` (another
    vocabulary) and a different chat template either way (which does not change token ids)."""
    shutil.copytree(demo_dir / "tokenizer", dest)
    spec = json.loads((dest / "tokenizer.json").read_text())
    if swap:
        vocab = spec["model"]["vocab"]
        vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
        (dest / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages }}"}))
    return dest


def test_student_and_teacher_with_different_tokenizers_are_refused_at_compose(base_overrides, demo_dir, tmp_path):
    other = other_tokenizer(demo_dir, tmp_path / "other-tokenizer", swap=True)
    with pytest.raises(ConfigError) as err:
        compose("distill", [*base_overrides, f"pipeline.stages.convert_student.model.tokenizer={other}"])
    message = str(err.value)
    assert "pipeline.stages.distillation.inputs" in message and str(other) in message and str(demo_dir / "tokenizer") in message
    assert "'convert_student'" in message and "sft" in message and "convert" in message


def test_a_copy_of_the_same_tokenizer_is_the_same_tokenizer(base_overrides, demo_dir, tmp_path):
    copy = other_tokenizer(demo_dir, tmp_path / "copy", swap=False)
    cfg = compose("distill", [*base_overrides, f"pipeline.stages.convert_student.model.tokenizer={copy}"])
    assert cfg.pipeline.stages.convert_student.model.tokenizer == str(copy)


def test_distillation_data_must_be_what_the_teacher_ran_on(base_overrides):
    with pytest.raises(ConfigError, match="pipeline.stages.distillation.inputs.data: 'prep_other' is not the data 'prep'"):
        compose("distill", [*base_overrides, "pipeline.stages.prep_other={kind: prep}", "pipeline.stages.distillation.inputs.data=prep_other"])


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_distillation_losses_at_tp2_and_pp2_match_tp1(demo, demo_dir, tmp_path, tp, pp):
    """The student's log-probs from vocab-parallel logits (the softmax normaliser and the picks
    at the label and the teacher's ids summed over TP ranks, with their gradients) train as one
    rank does: losses, KL and val KL agree to 1e-4 (fp32)."""

    def cfg(tp: int = 1, pp: int = 1) -> dict:
        return stage_cfg(
            "distillation",
            demo_dir,
            tp,
            pp,
            precision="fp32",
            loss={"sft_loss_weight": 0.25, "zero_outside_topk": True},
            trainer={"max_steps": 4, "val_check_interval": 4, "log_every_n_steps": 1, "limit_val_batches": 2},
        )

    inputs = {"data": demo["data"], "model": demo["student"], "teacher_logprobs": demo["topk"]}
    distillation.run(typed(cfg()), inputs, str(tmp_path / "one"))
    on_ranks(2, cfg(tp, pp), inputs, tmp_path / "two", "--stage", "distillation", "--teacher-logprobs", demo["topk"])
    expected, got = metrics_lines(tmp_path / "one"), metrics_lines(tmp_path / "two")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    for a, b in zip(expected, got):
        for key in ("loss", "kl", "sft_loss", "grad_norm", "val_kl"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-4), (key, a, b)
