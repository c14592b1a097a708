"""A training job's rollouts on vLLM (`generation_engine: vllm`): one engine for the job, the
child of global rank 0, refit from the live policy before each step's rollouts.

The engine starts from the policy's HF config and tokenizer with dummy weights (vLLM's
`--load-format dummy`) and the first refit gives it the policy's, so no HF copy of the model
is written. Each refit streams the policy in HF names (`alignflow.job.engine.refit`) at
whatever TP/PP/EP it trains in; the engine's layout is its own (`vllm.tensor_parallel_size`).
Every rank sends its prompts to rank 0, which has the engine sample them all at once (vLLM
batches them continuously) and sends each rank its completions. Each sample has its own seed,
so a completion depends on its prompt, the weights and its seed only: not on the DP layout,
not on what else was in flight, and a resumed run samples what an uninterrupted one would.
"""

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist

from alignflow.job.convert.families import model_shape
from alignflow.job.engine.refit import hf_weights
from alignflow.job.engine.vllm_server import EngineDied, EngineSettings, VLLMServer, job_folder
from alignflow.job.generation import Completion, Sampling

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class PolicyEngine:
    """The job's vLLM engine seen from every rank (the server itself lives on rank 0)."""

    def __init__(self, server: VLLMServer | None, hf_config: dict):
        self.server, self.shape, self.rank = server, model_shape(hf_config), dist.get_rank()

    def refit(self, chunks: list, version: int) -> dict:
        """The policy's current weights into the engine (every rank takes part); its metrics."""
        weights = _untied(hf_weights(chunks, self.shape)) if self.shape.tied_embeddings else hf_weights(chunks, self.shape)
        if self.server is None:
            for _ in weights:  # nothing on this rank: it sends its shards as rank 0 asks
                pass
            return _from_rank0(None)

        def refit() -> dict:
            try:
                return self.server.refit(weights, str(version))
            finally:
                for _ in weights:  # an engine that failed mid-refit: receive the rest, so no rank waits in a send
                    pass

        return _from_rank0(refit)

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int], dp_rank: int) -> list[Completion]:
        """This rank's completions; ranks of one DP rank pass the same prompts (one of them is sampled)."""
        asked: list = [None] * dist.get_world_size()
        dist.all_gather_object(asked, (dp_rank, prompts, seeds))

        def answers() -> dict[int, list[Completion]]:
            distinct = dict((d, (p, s)) for d, p, s in asked)
            flat = [(d, p, s) for d, (ps, ss) in sorted(distinct.items()) for p, s in zip(ps, ss)]
            done = self.server.generate([p for _, p, _ in flat], sampling, [s for _, _, s in flat]) if flat else []
            by_rank = {d: [] for d in distinct}
            for (d, _, _), completion in zip(flat, done):
                by_rank[d].append(completion)
            return by_rank

        return _from_rank0(answers if self.server is not None else None)[dp_rank]


@contextlib.contextmanager
def policy_engine(
    section, hf_config: dict, tokenizer: str, dtype: torch.dtype, max_model_len: int, seed: int, log_folder: Path
) -> Iterator[PolicyEngine | None]:
    """The job's engine while the block runs (None with `generation_engine: decoder`), stopped after it."""
    if section.generation_engine != "vllm":
        yield None
        return
    server = None
    if dist.get_rank() == 0:
        folder = job_folder(fallback=log_folder)
        settings = EngineSettings(
            python=section.vllm.python,
            tensor_parallel_size=section.vllm.tensor_parallel_size,
            max_model_len=section.vllm.max_model_len or max_model_len,
            kv_cache_gib=section.vllm.kv_cache_gib,
            dtype=DTYPE_NAMES[dtype],
            bucket_bytes=section.vllm.bucket_mb * 2**20,
            load_format="dummy",
        )
        server = VLLMServer(settings, _model_folder(folder / "engine-model", hf_config, tokenizer, settings.dtype), folder, seed)
    try:
        _from_rank0(server.start if server is not None else None)  # the others wait while rank 0 starts it
        yield PolicyEngine(server, hf_config)
    finally:
        if server is not None:
            server.stop()


def _model_folder(folder: Path, hf_config: dict, tokenizer: str, dtype: str) -> Path:
    """What the engine starts from: the policy's HF config and its tokenizer (no weights), its
    embeddings untied (see `_untied`)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    untied = {"tie_word_embeddings": False} if hf_config.get("tie_word_embeddings") else {}
    (folder / "config.json").write_text(json.dumps(hf_config | {"torch_dtype": dtype, "dtype": dtype} | untied, indent=1))
    fs, root = fsspec.core.url_to_fs(tokenizer)
    for path in fs.ls(root, detail=False):
        fs.get(path, str(folder / Path(path).name))
    return folder


def _untied(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A tied model's weights with its output layer spelled out: vLLM 0.32's in-place reload
    leaves a tied `lm_head` as the engine started ("ParallelLMHead: Failed to load weights": its
    load_weights skips `lm_head.` when tied), so the engine runs untied and gets the embedding twice."""
    for name, tensor in weights:
        yield name, tensor
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor.clone()  # its own storage: a bucket file holds each tensor once


def _from_rank0(work):
    """What `work()` returns on rank 0 (others pass None), on every rank; an error there (the
    engine died) is raised on every rank, so none waits for an answer that never comes."""
    box = [None]
    if work is not None:
        try:
            box = [(True, work())]
        except Exception as err:
            box = [(False, f"{type(err).__name__}: {err}")]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise EngineDied(f"on the job's first rank: {value}")
    return value
