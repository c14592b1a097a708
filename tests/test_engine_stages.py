"""The grpo and eval stages on vLLM (`generation_engine: vllm`, alignflow.job.engine): in grpo the
engine samples from the policy being trained at every step (the trainer's and the engine's
log-probs of the sampled tokens agree), a refit that leaves one tensor stale fails the stage by
its bound, and a SIGKILLed engine fails the stage with its log, after which the rerun resumes
from the checkpoint and samples what the uninterrupted run sampled; eval's greedy completions
on the engine are the decoder's."""

import json
import math
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from alignflow import PROJECT_ROOT
from alignflow.job.engine.vllm_server import EngineDied
from alignflow.job.stages import benchmark, eval as eval_stage, grpo
from alignflow.job.worker import typed

sys.path.insert(0, str(Path(__file__).parent))
from test_grpo import STEP_METRICS, grpo_cfg  # noqa: E402
from test_eval import prep_cfg  # noqa: E402
from train_ranks import briefly_tuned, convert_demo, metrics_lines, prep_demo, weights  # noqa: E402

pytestmark = pytest.mark.slow  # each test starts a vLLM server (about 30 s here)
ENGINE_PYTHON = PROJECT_ROOT / ".venv-vllm" / "bin" / "python"
ENGINE_METRICS = STEP_METRICS | {"refit_s", "refit_bytes"}
SERVER = "vllm.entrypoints.openai.api_server"


@pytest.fixture(scope="module")
def inputs(demo_dir, tmp_path_factory):
    """Prep with prompts and the demo Qwen3 (head size 32, which vLLM's CPU attention serves)
    fine-tuned briefly, as tests/test_grpo.py's Llama: it answers with numbers, some right."""
    root = tmp_path_factory.mktemp("engine-inputs")
    data, base = str(prep_demo(demo_dir, root / "data", prompts=True)), str(convert_demo(demo_dir, root / "base", "tiny-qwen3"))
    model = briefly_tuned(demo_dir, data, base, root / "sft" / "s1", "tiny-qwen3")
    return {"data": data, "model": model, "ref_model": model, "base": base}


def grpo_inputs(inputs: dict) -> dict:
    return {k: inputs[k] for k in ("data", "model", "ref_model")}


def engine_cfg(demo_dir, python: Path = ENGINE_PYTHON, **section) -> dict:
    cfg = grpo_cfg(
        demo_dir,
        generation_engine="vllm",
        vllm={"python": str(python), "kv_cache_gib": 1, "bucket_mb": 1},
        precision="fp32",
        trainer={"max_steps": 4, "log_every_n_steps": 1},
        checkpoint={"every_n_steps": 2},
        **section,
    )
    cfg["model"]["source"] = str(demo_dir / "tiny-qwen3")
    return cfg


def servers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if SERVER in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def uninterrupted(demo_dir, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "grpo" / "out"
    return out, grpo.run(typed(engine_cfg(demo_dir), "grpo"), grpo_inputs(inputs), str(out))


def test_the_engine_samples_from_the_policy_being_trained(demo_dir, inputs, uninterrupted):
    """Four steps, each refit before its rollouts: every step's token_mult_prob_error (the
    trainer's log-probs of the engine's samples against the engine's own) is 1 within fp32
    noise, each refit carries the whole model, the policy moved, and no engine outlives the stage."""
    out, result = uninterrupted
    lines = metrics_lines(out)
    assert [line["step"] for line in lines] == [1, 2, 3, 4] and all(set(line) == ENGINE_METRICS for line in lines), lines
    assert all(1.0 <= line["token_mult_prob_error"] < 1.0 + 1e-3 for line in lines), [line["token_mult_prob_error"] for line in lines]
    with safe_open(demo_dir / "tiny-qwen3" / "model.safetensors", "pt") as f:  # each HF tensor once, in fp32
        hf_bytes = sum(math.prod(f.get_slice(name).get_shape()) * 4 for name in f.keys())
        hf_bytes += math.prod(f.get_slice("model.embed_tokens.weight").get_shape()) * 4  # tied: sent again as the engine's lm_head
    assert all(line["refit_bytes"] == hf_bytes and line["refit_s"] > 0 for line in lines)
    assert 0 < lines[0]["response_length"] <= 4 and result["steps"] == 4
    final, initial = weights(out / "model"), weights(Path(inputs["model"]) / "model")
    assert any(not torch.equal(final[k], initial[k]) for k in initial)
    log = (Path(f"{out}-engine") / "vllm.log").read_text()
    assert log.count("Application startup complete") == 1 and not servers()


def stale_environment(folder: Path, name: str) -> Path:
    """An engine environment whose refit leaves the tensor `name` as the engine started (dummy
    weights): .venv-vllm's packages behind a python that loads a sitecustomize which drops it
    from every load_weights of the refit's receiving side (alignflow.job.engine.vllm_side)."""
    real = ENGINE_PYTHON.parent.parent
    (folder / "bin").mkdir(parents=True)
    (folder / "lib").symlink_to(real / "lib")
    (folder / "plant").mkdir()
    (folder / "plant" / "sitecustomize.py").write_text(
        f"""
import importlib.abc, importlib.util, sys
STALE, SIDE = {name!r}, "alignflow.job.engine.vllm_side"

class Plant(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != SIDE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            receive = module.FilesEngine.receive_weights
            def stale(engine, info):
                load = engine.model.load_weights
                engine.model.load_weights = lambda weights: load([(n, t) for n, t in weights if n != STALE])
                try:
                    receive(engine, info)
                finally:
                    del engine.model.load_weights
            module.FilesEngine.receive_weights = stale
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Plant())
"""
    )
    python = folder / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{folder / "plant"}:$PYTHONPATH" exec {ENGINE_PYTHON} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def test_a_refit_that_leaves_one_tensor_stale_fails_the_stage_by_its_bound(demo_dir, inputs, tmp_path):
    """One MLP's down projection never refit (the engine keeps its dummy weights, near 0: that
    MLP is all but cut out) puts the metric at about 1.02-1.07 against 1.0000005 when the refit is
    whole (fp32), so fp32's bound of 1.01 stops the stage at its first step."""
    python = stale_environment(tmp_path / "env", "model.layers.1.mlp.down_proj.weight")
    cfg = engine_cfg(demo_dir, python, max_token_mult_prob_error=1.01)
    said = r"grpo.max_token_mult_prob_error: at step 1 the sampler's log-probs are [\d.]+x off the trainer's \(bound 1.01\)"
    with pytest.raises(ValueError, match=said):
        grpo.run(typed(cfg, "grpo"), grpo_inputs(inputs), str(tmp_path / "out"))
    assert not servers() and not (tmp_path / "out" / "model").exists()


def test_a_killed_engine_fails_the_stage_and_the_rerun_resumes_to_the_uninterrupted_run(demo_dir, inputs, uninterrupted, tmp_path):
    """SIGKILL of the engine's server once the step-2 checkpoint is complete: the stage fails
    with EngineDied and the engine's log, its checkpoint kept; the rerun resumes at step 3 with a
    new engine and samples, scores and trains as the uninterrupted run did (per-sample seeds)."""
    out, cfg = tmp_path / "out", engine_cfg(demo_dir)
    checkpoint, killed = out / "checkpoints" / "step-00000002" / "complete", []

    def kill_after_the_checkpoint() -> None:
        deadline = time.monotonic() + 300
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for server in servers():
            os.kill(server.pid, signal.SIGKILL)
            killed.append(server.pid)

    killer = threading.Thread(target=kill_after_the_checkpoint, daemon=True)
    killer.start()
    with pytest.raises(EngineDied, match=r"the vLLM server (exited \(-9\)|did not answer)"):
        grpo.run(typed(cfg, "grpo"), grpo_inputs(inputs), str(out))
    killer.join()
    assert killed and checkpoint.exists() and not servers()

    resumed = grpo.run(typed(cfg, "grpo"), grpo_inputs(inputs), str(out))
    assert resumed["steps"] == 4 and (Path(f"{out}-engine") / "vllm.log").read_text().count("Application startup complete") == 2
    reference, _ = uninterrupted
    timing = ("tokens_per_s", "generation_tokens_per_s", "refit_s")
    strip = lambda lines: [{k: v for k, v in line.items() if k not in timing} for line in lines]  # noqa: E731
    assert strip(metrics_lines(out)) == strip(metrics_lines(reference))
    expected, got = weights(reference / "model"), weights(out / "model")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_eval_on_the_engine_gives_the_decoders_greedy_completions(demo_dir, inputs, uninterrupted, tmp_path):
    """The GRPO model and its SFT baseline (one shape: one engine, refit to each) evaluated on
    24 held-out prompts: the same greedy completions of each, so the same accuracy, as the
    decoder's."""
    grpo_out, _ = uninterrupted
    models = {"data": inputs["data"], "model": str(grpo_out), "baselines": [inputs["model"]]}
    cfg = OmegaConf.merge(prep_cfg(demo_dir), {"model": {"source": str(demo_dir / "tiny-qwen3")}, "eval": {"num_examples_shown": 24}})
    engine = {"eval": {"generation_engine": "vllm", "vllm": {"python": str(ENGINE_PYTHON), "kv_cache_gib": 1}}}
    decoder = eval_stage.run(typed(cfg, "eval"), models, str(tmp_path / "decoder"))
    served = eval_stage.run(typed(OmegaConf.merge(cfg, engine), "eval"), models, str(tmp_path / "engine"))
    print({k: v for k, v in served.items() if "accuracy" in k})
    for name in ("grpo", "sft"):
        assert served[f"{name}.accuracy"] == decoder[f"{name}.accuracy"]
    samples = lambda folder: json.loads((tmp_path / folder / "eval.json").read_text())["samples"]  # noqa: E731
    served_rows, decoded_rows = samples("engine"), samples("decoder")
    assert served_rows == decoded_rows and all(len(rows) == 24 and all(row["completion"] for row in rows) for rows in served_rows.values())
    assert [row["completion"] for row in served_rows["grpo"]] != [row["completion"] for row in served_rows["sft"]]  # two models, refit between
    assert (tmp_path / "engine-engine" / "vllm.log").read_text().count("Application startup complete") == 1 and not servers()


def test_benchmark_on_the_engine_gives_lm_evals_hf_numbers(demo_dir, inputs, tmp_path):
    """lm-eval on the SFT model through a vLLM server (`local-completions`) against lm-eval's own
    `hf` model on the same export (fp32): the generated answers' exact match equal, the
    perplexity from the echoed prompt log-probs within fp32 noise."""
    base = {"benchmark": {"tasks": ["arithmetic_demo", "gsm8k_demo"], "include_path": str(demo_dir / "benchmarks"), "apply_chat_template": True}}
    engine = {"benchmark": {"generation_engine": "vllm", "vllm": {"python": str(ENGINE_PYTHON), "kv_cache_gib": 1}}}
    models = {"models": [inputs["model"]]}
    hf = benchmark.run(typed(base, "benchmark"), models, str(tmp_path / "hf"))
    served = benchmark.run(typed(OmegaConf.merge(base, engine), "benchmark"), models, str(tmp_path / "engine"))
    print(hf, served)
    assert set(served) == set(hf)
    for key, value in hf.items():
        assert served[key] == (value if "exact_match" in key else pytest.approx(value, rel=1e-4)), key
    assert (tmp_path / "engine-engine" / "sft" / "vllm.log").read_text().count("Application startup complete") == 1 and not servers()
