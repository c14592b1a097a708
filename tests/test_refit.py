"""The live policy in HF names for an engine refit (`alignflow.job.engine.refit`): exactly the HF
model's own tensors, each once, for models converted from HF weights."""

from pathlib import Path

import pytest
import torch
from megatron_ranks import converted_chunks, saved_state, tiny_hf_model
from ranks import run_ranks

from alignflow.job.convert.families import model_shape
from alignflow.job.engine.refit import hf_weights

RANKS_SCRIPT = Path(__file__).with_name("refit_ranks.py")


@pytest.mark.parametrize("case", ["llama", "llama_tied", "qwen2", "qwen3_moe"])
def test_one_rank_refit_tensors_are_the_hf_models(one_rank, case, tmp_path):
    model, config = tiny_hf_model(case)
    state = saved_state(model, tmp_path)
    sent = dict(hf_weights(converted_chunks(config, one_rank, state), model_shape(config)))
    assert sorted(sent) == sorted(state)
    for name, tensor in state.items():
        torch.testing.assert_close(sent[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "nproc, layout, cases",
    [
        (2, ["--tp", "2"], ["llama", "qwen2", "llama_tied"]),
        (2, ["--pp", "2"], ["llama", "llama_tied"]),
        (4, ["--tp", "2", "--pp", "2"], ["llama"]),
        (2, ["--ep", "2"], ["mixtral"]),
    ],
    ids=["tp2", "pp2", "tp2pp2", "ep2"],
)
def test_refit_gathers_every_layout_into_the_hf_models_tensors(nproc, layout, cases):
    """TP slices (SwiGLU's interleaved fc1 shards, the padded vocab), PP stages (a tied
    embedding's copy on the last stage is not sent twice) and EP experts, gathered to rank 0."""
    run = run_ranks(nproc, RANKS_SCRIPT, *layout, *cases)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.count("differing from HF's: []") == len(cases), run.stdout
