"""vLLM as a job's generation engine (alignflow.job.engine): its server in its own environment
(.venv-vllm, built by install.sh), against HF transformers on the same weights; its weight refit
over vLLM's own protocol; its death. The models: the demo's shape at head_dim 32 (vLLM's CPU
attention refuses the demo's 16), two seeds."""

import ast
import contextlib
import json
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from alignflow import PROJECT_ROOT
from alignflow.job.engine.vllm_server import EngineDied, EngineSettings, VLLMServer
from alignflow.job.generation import Sampling
from alignflow.orchestrator import orphans

ENGINE = EngineSettings(python=str(PROJECT_ROOT / ".venv-vllm" / "bin" / "python"), bucket_bytes=64 * 2**10)  # buckets of 64 KiB: a refit of several
TEXTS = ["12+7=", "What is 5+6?", "3", "Add 20 and 22, then say the sum."]
EOS = 2


@pytest.fixture(scope="module")
def models(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-models")
    config = json.loads((demo_dir / "tiny-llama" / "config.json").read_text()) | {"head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        LlamaForCausalLM(AutoConfig.for_model(**config)).save_pretrained(root / name)
        for file in (demo_dir / "tiny-llama").iterdir():
            if file.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(file, root / name / file.name)
    return root


@pytest.fixture(scope="module")
def prompts(models) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(models / "a")
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with VLLMServer(ENGINE, models / "a", tmp_path_factory.mktemp("engine-job")) as engine:
        yield engine


def greedy(new_tokens: int = 24) -> Sampling:
    return Sampling(max_new_tokens=new_tokens, eos_id=EOS, vocab_size=512)


def hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int = 24) -> list[tuple[list[int], list[float]]]:
    """HF transformers' greedy tokens (to EOS or the limit) and their log-probs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in prompts:
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        tokens = gen.sequences[0, len(ids) :].tolist()
        logps = [torch.log_softmax(score[0], -1)[t].item() for score, t in zip(gen.scores, tokens)]
        out.append((tokens, logps))
    return out


@pytest.mark.slow
def test_greedy_completions_and_logprobs_equal_hf_transformers(server, models, prompts):
    got = server.generate(prompts, greedy(), seeds=[0] * len(prompts))
    for completion, (tokens, logps) in zip(got, hf_greedy(models / "a", prompts)):
        assert completion.tokens == tokens
        assert completion.truncated == (EOS not in tokens)
        assert completion.logps == pytest.approx(logps, abs=1e-4)
    assert (server.folder / "vllm.log").read_text().count("Application startup complete") == 1


@pytest.mark.slow
def test_a_refit_serves_the_new_weights_and_a_stale_tensor_shows(server, models, prompts):
    """After a refit with b's weights (in several buckets) the engine's greedy tokens are HF's for
    b; with one tensor left out (a's stays) they are not."""
    a, b = (AutoModelForCausalLM.from_pretrained(models / n, dtype=torch.float32).state_dict() for n in "ab")
    want = [tokens for tokens, _ in hf_greedy(models / "b", prompts)]
    try:
        stale = "model.layers.1.mlp.down_proj.weight"
        server.refit(((k, v) for k, v in b.items() if k != stale), version="planted")
        assert [c.tokens for c in server.generate(prompts, greedy(), [0] * len(prompts))] != want
        metrics = server.refit(b.items(), version="step-1")
        assert [c.tokens for c in server.generate(prompts, greedy(), [0] * len(prompts))] == want
        assert metrics["refit_buckets"] > 1 and metrics["refit_bytes"] == sum(v.nbytes for v in b.values()) and metrics["refit_s"] > 0
        assert not list(server.transfer.iterdir())  # each bucket deleted once loaded
    finally:
        server.refit(a.items(), version="a")


@pytest.mark.slow
def test_a_completion_depends_on_its_seed_not_on_its_batch(server, prompts):
    sampling = Sampling(max_new_tokens=16, eos_id=EOS, vocab_size=512, temperature=1.0, top_p=0.9)
    alone = server.generate(prompts[:1], sampling, seeds=[7])
    batched = server.generate(prompts, sampling, seeds=[7, 1, 2, 3])
    again = server.generate([prompts[0]] * 4, sampling, seeds=[7, 8, 9, 10])
    assert alone[0].tokens == batched[0].tokens == again[0].tokens
    assert len({tuple(c.tokens) for c in again}) > 1  # other seeds, other samples


@pytest.mark.slow
def test_an_engine_that_cannot_serve_the_model_says_why(demo_dir, tmp_path):
    """The demo model's head size (16) is refused by vLLM's CPU attention at its first forward:
    start() fails on its one-token completion with the engine's own error, from its log, and
    leaves no process behind."""
    engine = VLLMServer(ENGINE, demo_dir / "tiny-llama", tmp_path)
    with pytest.raises(EngineDied, match=r"(?s)answered /v1/completions with 500.*Unsupported CPU attention configuration: head_dim=16"):
        engine.start()
    assert engine.process.poll() is not None and not engine.transfer.exists()
    assert not [p for p in engine.tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_a_killed_engine_fails_with_its_log_and_leaves_no_process(server, prompts):
    """The module's server, SIGKILLed (this file's last test of it): its engine core and worker,
    which outlive it, are ended too."""
    started = server.tree
    assert len(started) > 1  # the server, its engine core and worker
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(timeout=30)
    with pytest.raises(EngineDied, match=r"exited \(-9\) during /v1/completions; its log .*vllm\.log ends: ") as died:
        server.generate(prompts, greedy(), [0] * len(prompts))
    assert str(died.value).endswith(server.log_path.read_text()[-500:])  # the log's tail, as the server left it
    assert not server.transfer.exists()
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


HOLDER = """
import sys, time
from alignflow.job.engine.vllm_server import EngineSettings, VLLMServer
from alignflow.orchestrator.orphans import reap_on_exit
reap_on_exit()  # as every job does (alignflow.job.worker)
server = VLLMServer(EngineSettings(python=sys.argv[1]), sys.argv[2], sys.argv[3])
server.start()
print(" ".join(str(p.pid) for p in server.tree), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_sigkilled_job_leaves_no_engine_process(models, tmp_path):
    """A job holding an engine is SIGKILLed (no `stop` runs): its orphan watcher ends the server,
    its engine core and worker within its grace period."""
    job = subprocess.Popen(
        [sys.executable, "-c", HOLDER, ENGINE.python, str(models / "a"), str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=PROJECT_ROOT
    )
    tree = []
    for pid in job.stdout.readline().split():
        with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived helper seen while the server started has ended already
            tree.append(psutil.Process(int(pid)))
    assert len(tree) > 1, (tmp_path / "vllm.log").read_text()[-3000:]
    job.kill()
    job.wait(timeout=30)
    _, alive = psutil.wait_procs(tree, timeout=orphans.GRACE_S + 10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_only_the_engine_side_module_imports_vllm_and_it_imports_nothing_of_alignflow():
    side = PROJECT_ROOT / "alignflow" / "job" / "engine" / "vllm_side.py"
    for folder in ("alignflow", "flows", "tasks"):
        for path in (PROJECT_ROOT / folder).rglob("*.py"):
            imported = {
                name.split(".")[0]
                for node in ast.walk(ast.parse(path.read_text()))
                for name in (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                )
            }
            if path == side:
                assert "vllm" in imported and "alignflow" not in imported, imported
            else:
                assert "vllm" not in imported, f"{path} imports vllm"
