"""The live policy in HF names for an engine refit (`alignflow.job.engine.refit`): exactly the HF
model's own tensors, each once, for models converted from HF weights; and a vLLM engine refit
from a live policy samples what the decoder samples on the same weights."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM
from megatron_ranks import converted_chunks, saved_state, tiny_hf_model
from ranks import run_ranks

from alignflow import PROJECT_ROOT
from alignflow.job.convert.families import model_shape
from alignflow.job.engine.refit import hf_weights

RANKS_SCRIPT = Path(__file__).with_name("refit_ranks.py")
ENGINE_SCRIPT = Path(__file__).with_name("engine_ranks.py")
ENGINE_PYTHON = str(PROJECT_ROOT / ".venv-vllm" / "bin" / "python")


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


@pytest.fixture(scope="module")
def served_model(demo_dir, tmp_path_factory):
    """The demo's tiny Llama at a head size the engine serves (32), random weights, with the demo tokenizer."""
    folder = tmp_path_factory.mktemp("engine-model")
    config = json.loads((demo_dir / "tiny-llama" / "config.json").read_text()) | {"head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 2}
    torch.manual_seed(0)
    LlamaForCausalLM(AutoConfig.for_model(**config)).save_pretrained(folder)
    for file in (demo_dir / "tiny-llama").iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, folder / file.name)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, tp, pp, model",
    [(1, 1, 1, "llama"), (1, 1, 1, "tiny-qwen3"), (2, 2, 1, "llama"), (2, 1, 2, "llama"), (2, 1, 1, "llama")],
    ids=["tp1", "tp1-qwen3-tied", "tp2", "pp2", "dp2"],
)
def test_the_engine_refit_from_the_live_policy_samples_the_decoders_greedy_tokens(served_model, demo_dir, nproc, tp, pp, model, tmp_path):
    """An engine started on dummy weights and refit from a policy moved off its checkpoint gives,
    for every rank's prompts (DP2: each DP rank its half), the decoder's greedy tokens on the same
    weights and their log-probs within 1e-4 (fp32); also for the demo Qwen3, whose embeddings are
    tied (the engine runs untied: vLLM's in-place reload leaves a tied lm_head as it started)."""
    folder = served_model if model == "llama" else demo_dir / model
    layout = ["--tp", str(tp), "--pp", str(pp)]
    run = run_ranks(nproc, ENGINE_SCRIPT, *layout, "--python", ENGINE_PYTHON, "--log-folder", str(tmp_path), str(folder), timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    dp = nproc // (tp * pp)
    assert run.stdout.count("engine tokens == decoder's") == 4 * nproc // dp, run.stdout  # each rank its DP rank's share of the 4 prompts
    assert (tmp_path / "vllm.log").read_text().count("Application startup complete") == 1
