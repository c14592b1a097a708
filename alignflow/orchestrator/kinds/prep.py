"""The `prep` kind: tokenized, packed data from the configured sources (`alignflow.job.stages.prep`)."""

import fsspec
from omegaconf import DictConfig

from alignflow.orchestrator.config import schema
from alignflow.job.data.formats import FORMATS
from alignflow.orchestrator.kinds.spec import StageKind, optional
from alignflow.orchestrator.store import options_for
from alignflow.orchestrator.verify import Need, OutputFormat, json_file, parquet

_DATA_SOURCES = tuple(f"data.{kind}.{split}" for kind in ("sft", "preference", "prompts") for split in ("train", "val"))


def checks(stage, key: str, check_paths: bool) -> list[str]:
    return _check_data(stage.cfg, key if stage.name != stage.kind else "", check_paths)


def _check_data(cfg: DictConfig, instance_key: str, check_paths: bool) -> list[str]:
    """A prep instance's data (`cfg` is the root config as it sees it)."""
    data, problems = cfg.data, []
    at = f"{instance_key}.data" if instance_key else "data"
    if data.seq_length < 2:
        problems.append(f"{at}.seq_length: must be >= 2, got {data.seq_length}")
    if not 0 < data.max_prompt_length < data.seq_length:
        problems.append(f"{at}.max_prompt_length: {data.max_prompt_length} must be in [1, data.seq_length={data.seq_length})")
    if check_paths and not _exists(cfg.model.tokenizer, cfg):
        problems.append(f"model.tokenizer: {cfg.model.tokenizer} does not exist (for the demo tokenizer run `align demo` first)")
    kinds = [kind for kind in ("sft", "preference", "prompts") if data[kind] is not None]
    if not kinds:
        problems.append(f"{at}: prep needs at least one of data.sft, data.preference, data.prompts")
    for kind in kinds:
        spec = data[kind]
        if not 0 <= spec.val_fraction < 1:
            problems.append(f"{at}.{kind}.val_fraction: must be in [0, 1)")
        if spec.format != "auto" and spec.format not in FORMATS[kind]:
            problems.append(f"{at}.{kind}.format: {spec.format} is not a {kind} format; use auto or one of {', '.join(FORMATS[kind])}")
        for split in ("train", "val"):
            if check_paths and spec[split] is not None and (problem := _data_problem(spec[split], cfg)):
                problems.append(f"{at}.{kind}.{split}: {spec[split]} {problem}")
    return problems


def _data_problem(uri: str, cfg: DictConfig) -> str | None:
    """Why a data source cannot be read, or None: missing, an empty folder, an empty file."""
    fs, path = fsspec.core.url_to_fs(uri, **options_for(uri, cfg))
    if any(c in path for c in "*?["):
        files = fs.glob(path)
        return None if files else "matches no file"
    if not fs.exists(path):
        return "does not exist"
    if fs.isdir(path):
        return None if any(fs.info(f)["size"] for f in fs.find(path)) else "is a folder with no data file in it"
    return None if fs.info(path)["size"] else "is an empty file"


def _exists(uri: str, cfg: DictConfig) -> bool:
    fs, path = fsspec.core.url_to_fs(uri, **options_for(uri, cfg))
    return bool(fs.glob(path)) if any(c in path for c in "*?[") else fs.exists(path)


KIND = StageKind(
    schema=schema.PrepConfig,
    output="prep",
    inputs={"generated": optional("scored")},  # a score output: the sft and preference train splits (alignflow.job.stages.prep.with_generated)
    resumable=False,
    output_format=OutputFormat(
        "Parquet token tables + metadata.json (alignflow.job.data.prepared)", (Need("metadata.json", json_file), Need("*/*.parquet", parquet))
    ),
    headline=("*.train.rows", "*.train.packing_efficiency", "*.train.tokens"),
    reads=("data", "model.tokenizer", "model.chat_template"),
    sources=(*_DATA_SOURCES, "model.tokenizer"),
    checks=checks,
)
