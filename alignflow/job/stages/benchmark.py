"""The benchmark stage: lm-evaluation-harness tasks on each model of the pipeline, run as
lm-eval's own `hf` model runs them on our HF export.

For each model of `inputs["models"]` (named by its stage instance): its checkpoint written as an
HF folder in the job's scratch (`alignflow.job.convert.hf_folder`, the export stage's writer; a
LoRA output with its adapter merged), then `lm_eval.simple_evaluate(model="hf", ...)` with
`benchmark`'s settings, offline: HF_HUB_OFFLINE and HF_DATASETS_OFFLINE are set before datasets
is imported, so task data come from local files or the local datasets cache, never the network.
Its numbers are those of `lm_eval run --model hf --model_args pretrained=<export>,dtype=<dtype>`
with the same flags (tests/test_benchmark.py runs both).

Metrics are `{model}.{task}.{metric}`, the metric as lm-eval names it, `@{filter}` where the task
filters answers (gsm8k's `exact_match@strict-match`), with `{...}_stderr` where lm-eval gives one
(the nightly gate weighs a drop by it). Writes benchmark.json (per model x task: the metrics with
their stderr, n-samples, the task's version and shots; lm-eval's version) and lm_eval/<model>.json
(lm-eval's results, its samples left out).

With `benchmark.generation_engine: vllm` the export is served by vLLM (its own environment,
`alignflow.job.engine.vllm_server`, its log in the job folder under the model's name) and
lm-eval runs its `local-completions` model against it, the way lm-eval drives any
OpenAI-compatible server: the numbers agree with the `hf` model's (tests/test_engine_stages.py).

Simplified: one process on this rank's device (no TP/PP/DP: lm-eval's hf model holds the whole
model); each model is written to HF once per run, not cached across runs.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets and huggingface_hub read them at import
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import contextlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402

import fsspec  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.utils import handle_non_serializable  # noqa: E402

from alignflow.job.model_files import ModelOutput  # noqa: E402
from alignflow.job.convert.hf_folder import write_hf_folder  # noqa: E402
from alignflow.job.device import device  # noqa: E402
from alignflow.job.engine.vllm_server import EngineSettings, VLLMServer, job_folder  # noqa: E402
from alignflow.job.forward.models import cache_dir  # noqa: E402
from alignflow.orchestrator.kinds.benchmark import STDERR, task_manager  # noqa: E402

log = logging.getLogger("alignflow.benchmark")
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_SHARD_BYTES = 2 * 10**9


def run(cfg, inputs: dict, out: str) -> dict:
    section = cfg.benchmark
    # lm-eval bootstraps some standard errors (perplexity's) in a pool of forked workers; they would
    # inherit submitit's handler that ignores SIGTERM, and the pool's terminate() wait on them forever.
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    tasks = offline_tasks(section)
    summary, metrics = {"lm_eval": version("lm-eval"), "models": {}}, {}
    fs, root = fsspec.core.url_to_fs(out)
    root = root.rstrip("/")
    fs.makedirs(f"{root}/lm_eval", exist_ok=True)
    for uri in inputs["models"]:
        name = uri.rstrip("/").split("/")[-2]  # `{root}/{stage}/{fingerprint}`
        results = evaluate(ModelOutput(uri), section, tasks, cache_dir(cfg), job_folder(Path(f"{out}-engine")) / name)
        fs.pipe(f"{root}/lm_eval/{name}.json", json.dumps(results, indent=2, default=handle_non_serializable).encode())
        summary["models"][name] = {"uri": uri, "tasks": per_task(results)}
        metrics |= {
            f"{name}.{task}.{metric}": value for task, row in summary["models"][name]["tasks"].items() for metric, value in row["metrics"].items()
        }
        log.info("%s: %s", name, {k: v for k, v in metrics.items() if k.startswith(f"{name}.")})
    fs.pipe(f"{root}/benchmark.json", json.dumps(summary, indent=2).encode())
    return metrics


def offline_tasks(section):
    """lm-eval's task manager for `section.tasks`, each task's data read once (then cached) offline
    before any model is written; a task whose data is not here fails naming benchmark.tasks."""
    if offline := [name for name in OFFLINE if os.environ[name] not in ("1", "true", "True")]:
        raise RuntimeError(f"benchmark: {', '.join(offline)} is not 1 in this job's environment; benchmarks run offline")
    tasks = task_manager(section.include_path, list(section.tasks))
    try:
        tasks.load(list(section.tasks))
    except Exception as err:
        raise RuntimeError(
            f"benchmark.tasks: {', '.join(section.tasks)}: a task's data could not be read offline ({type(err).__name__}: {err}); "
            "point its data_files at local files or put its dataset into this machine's HF datasets cache"
        ) from err
    return tasks


def evaluate(model: ModelOutput, section, tasks, scratch, engine_folder: Path) -> dict:
    """lm-eval's results (samples left out) of `model`, written as an HF folder under `scratch`."""
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="benchmark-hf-", dir=scratch) as folder:
        write_hf_folder(model, model, folder, section.dtype, _SHARD_BYTES)
        with lm_of(folder, section, engine_folder) as (lm, args):
            results = lm_eval.simple_evaluate(
                model=lm,
                model_args=args,
                tasks=list(section.tasks),
                num_fewshot=section.num_fewshot,
                limit=_limit(section.limit),
                batch_size=section.batch_size,
                device=str(device()),
                apply_chat_template=section.apply_chat_template,
                fewshot_as_multiturn=section.apply_chat_template if section.fewshot_as_multiturn is None else section.fewshot_as_multiturn,
                system_instruction=section.system_instruction,
                gen_kwargs=dict(section.gen_kwargs) or None,
                task_manager=tasks,
                log_samples=False,
            )
    return {k: v for k, v in results.items() if k != "samples"}


@contextlib.contextmanager
def lm_of(folder: str, section, engine_folder: Path) -> Iterator[tuple[str, dict]]:
    """lm-eval's model type and arguments for the HF model in `folder`: its `hf` model, or with
    `generation_engine: vllm` a vLLM server of the folder while the block runs, behind lm-eval's
    `local-completions` (OpenAI completions: log-likelihoods from the echoed prompt's log-probs,
    generations as completions; token ids sent, so both sides tokenize alike)."""
    if section.generation_engine != "vllm":
        yield "hf", {"pretrained": folder, "dtype": str(section.dtype)}
        return
    length = json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]
    settings = EngineSettings(
        python=section.vllm.python,
        tensor_parallel_size=section.vllm.tensor_parallel_size,
        max_model_len=section.vllm.max_model_len or length,
        kv_cache_gib=section.vllm.kv_cache_gib,
        dtype=str(section.dtype),
        logprobs_mode="raw_logprobs",  # the model's own log-probs, as the hf model scores
    )
    with VLLMServer(settings, folder, engine_folder) as server:
        yield (
            "local-completions",
            {
                "model": "policy",
                "base_url": f"{server.url}/v1/completions",
                "tokenizer": folder,
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "max_length": settings.max_model_len,
                "num_concurrent": 4,
                "max_retries": 1,
            },
        )


def _limit(limit: float | None) -> int | float | None:
    """lm-eval's: a count of docs when >= 1, a fraction of them below."""
    return int(limit) if limit is not None and limit >= 1 else limit


def per_task(results: dict) -> dict:
    """{task: {metrics: {name: value}, n_samples, version, n_shot}} from lm-eval's results, a
    metric `name` as `{metric}[@{filter}][_stderr]` (lm-eval's key: `{metric}[_stderr],{filter}`)."""
    rows = {}
    for task, values in results["results"].items():
        found = {}
        for key, value in values.items():
            metric, comma, kept = key.partition(",")
            if not comma or not isinstance(value, (int, float)):  # alias, sample_len; "N/A" stderr
                continue
            base, stderr = metric.removesuffix(STDERR), metric.endswith(STDERR)
            found[f"{base}{'' if kept == 'none' else f'@{kept}'}{STDERR if stderr else ''}"] = float(value)
        rows[task] = {
            "metrics": found,
            "n_samples": results.get("n-samples", {}).get(task),
            "version": results.get("versions", {}).get(task),
            "n_shot": results.get("n-shot", {}).get(task),
        }
    return rows
