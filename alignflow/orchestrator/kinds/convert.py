"""The `convert` kind: an HF (or Megatron/NeMo) checkpoint as a Megatron model (`alignflow.job.stages.convert`)."""

import fsspec
from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.orchestrator.kinds.spec import StageKind
from alignflow.orchestrator.store import options_for
from alignflow.orchestrator.verify import safetensors, why_not


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return _check_safetensors(stage.cfg) + _check_not_pickled(stage.cfg) if check_paths else []


def _check_safetensors(cfg: DictConfig) -> list[str]:
    """Every safetensors file of `model.source` as long as its header says (a cut-short copy or
    download fails here, not half-way through a conversion)."""
    fs, path = fsspec.core.url_to_fs(cfg.model.source, **options_for(cfg.model.source, cfg))
    problems = []
    for file in fs.glob(f"{path.rstrip('/')}/*.safetensors") if fs.isdir(path) else []:
        if why := why_not(safetensors, fs, file):
            problems.append(f"model.source: {cfg.model.source.rstrip('/')}/{file.rsplit('/', 1)[-1]} is {why}")
    return problems


PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _check_not_pickled(cfg: DictConfig) -> list[str]:
    """A `model.source` with pickled weights only (`pytorch_model.bin`): alignflow reads
    safetensors or torch_dist and never unpickles a source (README: trust boundary)."""
    source = cfg.model.source.rstrip("/")
    fs, path = fsspec.core.url_to_fs(source, **options_for(source, cfg))
    names = {name.rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)} if fs.isdir(path) else set()
    pickled = sorted(name for name in names if name.endswith(PICKLED_WEIGHTS))
    if not pickled or any(name.endswith(".safetensors") for name in names) or {"metadata.json", ".metadata"} <= names:
        return []
    return [
        f"model.source: {source} holds pickled weights only ({', '.join(pickled)}), which alignflow never loads: unpickling "
        "runs any code a file holds. Re-save the model as safetensors (save_pretrained(..., safe_serialization=True)) "
        "on a machine where you trust it (see README: trust boundary)"
    ]


KIND = StageKind(
    schema=schema.ConvertConfig,
    output="model",
    inputs={},
    resumable=False,
    headline=("architecture", "parameters", "megabytes", "mb_per_s"),
    reads=("model",),
    sources=("model.source", "model.hf_config", "model.tokenizer"),
    checks=checks,
)
