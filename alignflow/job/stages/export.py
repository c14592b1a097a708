"""The export stage: a model stage's torch_dist checkpoint -> an HF safetensors directory.

Supported: any checkpoint in the `alignflow.job.model_files` layout (convert, and the training
stages), whatever TP/PP/EP wrote it, for every architecture of `alignflow.job.convert.families`. Tensors
stream one layer at a time into safetensors shards (+ index.json past `max_shard_size`);
`config.json` (dtype set to `export.dtype`), `generation_config.json` and the tokenizer
files go beside them, so `AutoModelForCausalLM.from_pretrained(out)` loads it with no missing
or unexpected keys. With `export.destination` the finished directory is also published
there (local path or s3://), never as a mix of two exports and never over files it did not
publish there (`publish`, `alignflow.orchestrator.config.destinations`).

A LoRA output (`finetuning_type: lora`) exports as its base model, HF weights as above (a base
that is itself a LoRA output merged in), plus `adapter/`: an HF PEFT LoRA adapter
(`alignflow.job.convert.peft`) that `PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(out), f"{out}/adapter")` loads onto it. A `lora_merged` output is an ordinary
model: its merged weights export as any other.
"""

import contextlib
import json
import logging
import os
import re
import shutil
import time
import uuid

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from alignflow.job.model_files import ADAPTER_DIR, ModelOutput
from alignflow.orchestrator.config.destinations import MARKER, destination_key, open_destination, previous_export
from alignflow.job.convert.hf_folder import write_hf_folder
from alignflow.job.convert.peft import write_adapter
from alignflow.orchestrator.store import staging_owner

log = logging.getLogger("alignflow.export")

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def run(cfg, inputs: dict, out: str) -> dict:
    started = time.time()
    model = ModelOutput(inputs["model"])
    dtype_name = cfg.export.dtype
    weights = model if model.lora is None else ModelOutput(model.lora["base"])  # a LoRA output exports its base + adapter/
    shape, specs, files = write_hf_folder(model, weights, out, dtype_name, parse_size(cfg.export.max_shard_size))
    adapter = {}
    if model.lora is not None:
        adapter = write_adapter(f"{out.rstrip('/')}/{ADAPTER_DIR}", model, shape, getattr(torch, dtype_name), cfg.export.destination)
    if cfg.export.destination:
        instance, fingerprint = staging_owner(out)
        publish(
            out,
            cfg.export.destination,
            destination_key("export", instance),
            {"instance": instance, "fingerprint": fingerprint, "model": inputs["model"]},
        )
    return {
        "architecture": shape.architecture,
        "dtype": dtype_name,
        "shards": len(files),
        "megabytes": round(sum(s.nbytes for s in specs) / 1e6, 3),
        "destination": cfg.export.destination or out,
        "seconds": round(time.time() - started, 3),
        **adapter,
    }


def parse_size(size: str) -> int:
    """HF's shard size strings: "2GB" = 2e9 bytes, "500MiB" = 500 * 2**20."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", size.upper())
    if not match:
        raise ValueError(f"export.max_shard_size: cannot read {size!r} (e.g. 2GB, 500MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def publish(src: str, dest: str, key: str = "export.destination", origin: dict | None = None) -> None:
    """Publish the export at `dest` so that a reader never loads a mix of two exports, and delete
    nothing there but the files the previous export's marker lists (`alignflow.orchestrator.config.destinations`;
    DestinationError naming `key`, nothing touched, if `dest` holds anything else). The new marker
    records `origin` (what produced it) and the files published. On a filesystem: copy beside it,
    then swap the folders by two renames (a reader sees the old export, the new one, or for an
    instant none). On an object store: take config.json away first (loaders then fail clearly
    instead of mixing), remove the old listed files, upload the new ones, config.json last."""
    src_fs, src_root = fsspec.core.url_to_fs(src)
    dest_fs, dest_root = open_destination(dest, {})
    src_root = src_root.rstrip("/")
    previous = previous_export(dest_fs, dest_root, key, dest)  # before copying anything
    names = sorted((p[len(src_root) + 1 :] for p in src_fs.find(src_root) if p != f"{src_root}/{MARKER}"), key=lambda n: n == "config.json")
    marker = {**(origin or {}), "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": sorted(names)}
    if isinstance(dest_fs, LocalFileSystem):
        _publish_local(src_fs, src_root, names, marker, dest_root, (key, dest))  # checks again right before its swap
    else:
        _publish_object_store(src_fs, src_root, names, marker, dest_fs, dest_root, previous)
    log.info("published %s", dest)


def _publish_local(src_fs, src_root: str, names: list[str], marker: dict, dest: str, named: tuple[str, str]) -> None:
    parent, tag = os.path.dirname(dest), uuid.uuid4().hex[:8]
    os.makedirs(parent, exist_ok=True)
    staged, old = f"{dest}.tmp-{tag}", f"{dest}.old-{tag}"
    local = LocalFileSystem()
    try:
        for name in names:
            _copy(src_fs, f"{src_root}/{name}", local, f"{staged}/{name}")
        local.pipe(f"{staged}/{MARKER}", json.dumps(marker, indent=2).encode())
        previous = previous_export(local, dest, *named)  # again: the copy took a while
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if os.path.exists(dest):
        os.rename(dest, old)
    os.rename(staged, dest)
    _remove_listed(old, previous)


def _remove_listed(folder: str, names: list[str]) -> None:
    """Delete the files `names` in `folder`, then its folders left empty; a file that appeared
    there meanwhile stays, with the folder, and is said."""
    if not os.path.exists(folder):
        return
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{folder}/{name}")
    for path, _, _ in sorted(os.walk(folder), key=lambda entry: -entry[0].count("/")):
        with contextlib.suppress(OSError):  # not empty
            os.rmdir(path)
    if os.path.exists(folder):
        log.warning("kept %s: files appeared in the destination during the publish that the previous export did not list", folder)


def _publish_object_store(src_fs, src_root: str, names: list[str], marker: dict, fs, root: str, previous: list[str]) -> None:
    if "config.json" in previous:
        fs.rm_file(f"{root}/config.json")
    # Until the end the marker lists the old files and the new: a publish cut short leaves a folder still only ours.
    fs.pipe(f"{root}/{MARKER}", json.dumps({**marker, "files": sorted({*previous, *names} - {MARKER})}, indent=2).encode())
    for stale in sorted(set(previous) - {*names, MARKER}):
        fs.rm_file(f"{root}/{stale}")
    for name in names[:-1]:
        _copy(src_fs, f"{src_root}/{name}", fs, f"{root}/{name}")
    fs.pipe(f"{root}/{MARKER}", json.dumps(marker, indent=2).encode())
    for name in names[-1:]:  # config.json
        _copy(src_fs, f"{src_root}/{name}", fs, f"{root}/{name}")


def _copy(src_fs, src: str, dest_fs, dest: str) -> None:
    dest_fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
    with src_fs.open(src, "rb") as f_in, dest_fs.open(dest, "wb") as f_out:
        while block := f_in.read(64 << 20):
            f_out.write(block)
