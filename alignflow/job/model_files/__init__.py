"""Checkpoint files: streaming HF safetensors (`safetensors_io`) and Megatron torch_dist
(`dist_io`), read without running code from them (`untrusted`), plus the layout every
model-producing stage's output shares, and its reader:

    {out}/model/       the torch_dist checkpoint (global tensors, any TP/PP loads it)
    {out}/hf/          config.json and generation_config.json of the HF model it came from
    {out}/tokenizer/   the tokenizer files

A LoRA output (`finetuning_type: lora`) has no model/ but, beside hf/ and tokenizer/:

    {out}/adapter/     torch_dist: the adapter matrices only (`alignflow.job.convert.lora.adapter_key`)
    {out}/lora.json    {"base": URI of the model output it adapts (itself possibly a LoRA
                       output), "adapter_dim", "alpha", "adapter_dropout", "target_modules"}

Its weights are the base's with the adapter merged in (`alignflow.job.model.lora.load_output`).
"""

import json
from dataclasses import dataclass
from functools import cached_property

import fsspec

MODEL_DIR = "model"
HF_DIR = "hf"
TOKENIZER_DIR = "tokenizer"
ADAPTER_DIR = "adapter"
LORA_FILE = "lora.json"
HF_CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ModelOutput:
    """A model stage output by URI (a local folder for what needs a filesystem: see
    `alignflow.job.forward.models.local_model`)."""

    uri: str

    @property
    def weights(self) -> str:
        return f"{self.uri.rstrip('/')}/{MODEL_DIR}"

    @property
    def hf(self) -> str:
        return f"{self.uri.rstrip('/')}/{HF_DIR}"

    @property
    def tokenizer(self) -> str:
        return f"{self.uri.rstrip('/')}/{TOKENIZER_DIR}"

    @property
    def adapter(self) -> str:
        return f"{self.uri.rstrip('/')}/{ADAPTER_DIR}"

    @cached_property
    def lora(self) -> dict | None:
        """A LoRA output's lora.json (see the top); None for full weights."""
        return _read_json(f"{self.uri.rstrip('/')}/{LORA_FILE}", missing_ok=True)

    @cached_property
    def hf_config(self) -> dict:
        return _read_json(f"{self.hf}/config.json")


def _read_json(uri: str, missing_ok: bool = False) -> dict | None:
    fs, path = fsspec.core.url_to_fs(uri)
    if missing_ok and not fs.exists(path):
        return None
    return json.loads(fs.cat_file(path))


def copy_files(src: str, names: tuple[str, ...], dest: str, required: tuple[str, ...] = ()) -> list[str]:
    """Copy the named files that exist in `src` to `dest` (any fsspec URIs)."""
    src_fs, src_root = fsspec.core.url_to_fs(src)
    dest_fs, dest_root = fsspec.core.url_to_fs(dest)
    dest_fs.makedirs(dest_root, exist_ok=True)
    copied = []
    for name in names:
        path = f"{src_root.rstrip('/')}/{name}"
        if src_fs.exists(path):
            dest_fs.pipe(f"{dest_root.rstrip('/')}/{name}", src_fs.cat_file(path))
            copied.append(name)
        elif name in required:
            raise FileNotFoundError(f"{src}: no {name}")
    return copied
