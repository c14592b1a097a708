"""HF's load-balancing loss of a mixture-of-experts model whose config sets output_router_logits:
SFT's and DPO's objectives on one micro batch give HF's own model loss (its LM loss plus
router_aux_loss_coef x aux loss, HF's code on the same weights, fp32) within 1e-5, and the router
weights HF's gradients, on Megatron's forward and on the lean one. (EP2 = EP1 with the aux loss:
tests/test_sft.py `test_moe_at_ep2_matches_ep1`.)"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_ranks import tiny_hf_model

from alignflow.orchestrator.config.compose import compose
from alignflow.orchestrator.config.schema import DPOLossConfig
from alignflow.job.device import to_device
from alignflow.job.model.decoder import LeanForward
from alignflow.job.model.gpt import build_gpt
from alignflow.job.stages.dpo import dpo_objective
from alignflow.job.forward.objectives import SFT
from alignflow.job.train.objectives import with_load_balancing
from alignflow.job.train.data import packed_rows
from alignflow.job.forward.models import load_model_output, local_model

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_hf  # noqa: E402

COEF = 0.5  # large enough that the aux term moves the loss and the router's gradients well past the tolerance
LENGTH = 16


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def converted(request, demo_dir, tmp_path_factory):
    """A tiny random HF MoE model (4 layers, 4 experts, top 2) with output_router_logits on, and
    its conversion by the convert stage."""
    root = tmp_path_factory.mktemp(request.param)
    hf_model, config = tiny_hf_model(request.param, vocab_size=512, output_router_logits=True, router_aux_loss_coef=COEF)
    hf_model.save_pretrained(root / "hf")
    return hf_model, config, convert_hf(demo_dir, root / "hf", root / "model")


def megatron_model(config: dict, model_dir: Path, one_rank, cache: Path):
    [model] = build_gpt(config, one_rank)
    load_model_output([model], local_model(str(model_dir), cache), cache)
    return model


def rows_of(lengths: list[list[int]], seed: int = 0) -> list:
    """Packed rows of random tokens: each row its documents' lengths."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, 512, sum(row)), np.ones(sum(row)), np.cumsum([0, *row])) for row in lengths]


def hf_inputs(rows: list) -> dict:
    """HF's batch of the same rows: right padding under attention_mask where a row is short, else
    documents packed by position_ids (HF keeps them apart); labels -100 on padding and at each
    document's first token (never predicted across documents)."""
    ids = torch.zeros(len(rows), LENGTH, dtype=torch.long)
    labels, positions = torch.full_like(ids, -100), torch.zeros_like(ids)
    for i, (tokens, _, cu) in enumerate(rows):
        ids[i, : len(tokens)] = labels[i, : len(tokens)] = torch.as_tensor(tokens)
        labels[i, cu[1:-1]] = -100
        for a, b in zip(cu, cu[1:]):
            positions[i, a:b] = torch.arange(b - a)
    padded = any(len(tokens) < LENGTH for tokens, _, _ in rows)
    if padded:
        assert all(len(cu) == 2 for _, _, cu in rows)  # HF packs documents only without a mask
        return {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": (torch.arange(LENGTH) < torch.tensor([len(t) for t, _, _ in rows])[:, None]).long(),
        }
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}  # a cache turns packing off


ROWS = {"packed": [[7, 9], [5, 4, 7]], "padded": [[16], [11]]}


@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.parametrize("path", ["megatron", "lean"])
def test_sft_loss_and_router_gradients_are_hfs(one_rank, converted, rows, path, tmp_path):
    """One micro batch of two rows (packed documents, or one padded row): the SFT loss with the
    aux term and the aux loss itself are HF's, and every layer's router weight gets HF's gradient."""
    hf_model, config, model_dir = converted
    model = megatron_model(config, model_dir, one_rank, tmp_path)
    forward = model if path == "megatron" else LeanForward.of([model], LENGTH)
    assert forward is not None
    batch_rows = rows_of(ROWS[rows])
    batch = to_device(vars(packed_rows(batch_rows, LENGTH, pad_id=0)))
    objective = with_load_balancing(SFT, config)
    terms = objective.loss(objective.forward(forward, batch), batch)
    ours = terms.total / terms.count
    theirs = hf_model(**hf_inputs(batch_rows))
    assert COEF * theirs.aux_loss.item() > 0.1  # the term matters
    assert abs(ours.item() - theirs.loss.item()) < 1e-5
    assert abs(terms.metrics["aux_loss"].item() / terms.count.item() - theirs.aux_loss.item()) < 1e-5
    hf_model.zero_grad()  # the module's HF model serves every test
    ours.backward()
    theirs.loss.backward()
    for i, layer in enumerate(model.decoder.layers):
        mine, hf = layer.mlp.router.weight.grad, hf_model.model.layers[i].mlp.gate.weight.grad
        assert ((mine - hf).norm() / hf.norm()).item() < 1e-5, i


def test_dpo_adds_hfs_aux_loss_of_the_pairs(one_rank, converted, tmp_path):
    """DPO on a micro batch of 2 pairs, each pair's chosen and rejected sequences in one row:
    the preference loss plus coef x HF's aux loss of the pairs' sequences (TRL's concatenated
    [chosen; rejected] batch, right-padded)."""
    hf_model, config, model_dir = converted
    model = megatron_model(config, model_dir, one_rank, tmp_path)
    pairs = [(5, 6), (7, 4)]  # (chosen, rejected) lengths
    rows = rows_of([list(pair) for pair in pairs], seed=1)
    batch = vars(packed_rows(rows, LENGTH, pad_id=0))
    sequence = torch.full((2, LENGTH), -1)
    for j, (c, r) in enumerate(pairs):
        sequence[j, :c], sequence[j, c : c + r] = j, 2 + j
    batch |= {"sequence": sequence, "pairs": 2, "ref_chosen_logp": torch.tensor([-30.0, -40.0]), "ref_rejected_logp": torch.tensor([-35.0, -30.0])}
    batch = to_device(batch)
    plain = dpo_objective(DPOLossConfig())
    objective = with_load_balancing(plain, config)
    with torch.no_grad():
        terms = objective.loss(objective.forward(model, batch), batch)
        expected = plain.loss(plain.forward(model, batch), batch)
        sequences = [(tokens[:c], c) for (tokens, _, _), (c, _) in zip(rows, pairs)] + [
            (tokens[c:], r) for (tokens, _, _), (c, r) in zip(rows, pairs)
        ]
        ids = torch.zeros(4, max(n for _, n in sequences), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (tokens, n) in enumerate(sequences):
            ids[i, :n], mask[i, :n] = torch.as_tensor(tokens), 1
        aux = hf_model(input_ids=ids, attention_mask=mask).aux_loss
    assert COEF * aux.item() > 0.1
    assert abs(terms.total.item() / 2 - (expected.total.item() / 2 + COEF * aux.item())) < 1e-5


def test_sft_dpo_of_a_model_with_router_logits_composes(demo_dir, base_overrides, tmp_path):
    """The old refusal is gone where the loss is added: sft and dpo at the defaults compose."""
    shutil.copytree(demo_dir / "tiny-qwen3-moe", tmp_path / "moe")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    assert compose("sft_dpo", [*base_overrides, f"model.source={tmp_path / 'moe'}"]).model.source == str(tmp_path / "moe")
