"""Untrusted checkpoints run no code (`alignflow.job.model_files.untrusted`): hostile files built for
real (a pickle whose `__reduce__` creates a marker file, shown to do so when unpickled plainly),
handed in as a model source, a store output or a training checkpoint. Each is refused with an
error naming the file and the global it wanted, or never read; the marker never appears and
nothing is committed. Legitimate checkpoints, Megatron's own writer's included, still convert
exactly."""

import json
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from alignflow.job.model_files import HF_DIR, MODEL_DIR
from alignflow.job.model_files.dist_io import DistCheckpointReader
from alignflow.job.model_files.untrusted import MetadataUnpickler, refuse_code
from alignflow.orchestrator.config.compose import ConfigError, compose
from alignflow.orchestrator.launch import StageFailed
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import StageResult, run_stage
from alignflow.job.stages import convert

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_demo, prep_demo, run_sft, sft_cfg  # noqa: E402

REFUSED = "refused: a checkpoint may only hold tensors and plain data (see README: trust boundary)"


class RunsCode:
    """The hostile payload: unpickled by plain pickle, it creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.fixture
def marker(tmp_path):
    """A marker path, and proof that `RunsCode` does create it under a plain unpickler."""
    path = tmp_path / "code-ran"
    pickle.loads(pickle.dumps(RunsCode(path)))
    assert path.exists()
    path.unlink()
    return path


@pytest.fixture
def one_rank():
    """A single-rank Megatron runtime for one test (the SFT run below sets up its own)."""
    from megatron_ranks import parallel_cfg

    from alignflow.job.model import runtime

    parallel = parallel_cfg()
    runtime.init_parallel(parallel)
    yield parallel
    runtime.teardown()


@pytest.fixture(scope="module")
def converted(demo_dir, tmp_path_factory) -> Path:
    """The demo model as a convert output (model/ torch_dist, hf/, tokenizer/)."""
    return convert_demo(demo_dir, tmp_path_factory.mktemp("converted") / "ckpt")


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    reader = DistCheckpointReader(str(checkpoint))
    return {key: reader.read(key) for key in reader.keys()}


def hostile_metadata(checkpoint: Path, marker: Path) -> None:
    """Rewrite a checkpoint's `.metadata` as the real metadata with the payload inside it."""
    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file: trusted
    metadata.storage_meta.modules = [RunsCode(marker)]
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def hostile_torch_file(path: Path, marker: Path) -> None:
    """A torch.save file with the payload; torch.load(weights_only=False) would create the marker."""
    torch.save({"args": RunsCode(marker), "iteration": 7}, path)


def run_convert(base_overrides, demo_dir, source: Path, *overrides: str) -> StageResult:
    cfg = compose("convert", [*base_overrides, f"model.source={source}", f"model.tokenizer={demo_dir / 'tokenizer'}", *overrides])
    return run_stage(Pipeline.build(cfg)["convert"], {}, log=lambda line: None)


def committed(tmp_path) -> list[Path]:
    return list((tmp_path / "store" / "convert").glob("*/_SUCCESS.json"))


def test_a_source_whose_metadata_would_run_code_is_refused_by_the_convert_job(base_overrides, demo_dir, converted, marker, tmp_path):
    source = tmp_path / "megatron"
    shutil.copytree(converted / MODEL_DIR, source)
    hostile_metadata(source, marker)
    with pytest.raises(StageFailed) as err:
        run_convert(base_overrides, demo_dir, source, f"model.hf_config={converted / HF_DIR}")
    assert f"{source}/.metadata wants to import pathlib.Path.touch; {REFUSED}" in str(err.value).splitlines()[0]
    assert not marker.exists() and not committed(tmp_path)


def test_a_sources_common_pt_is_never_read(base_overrides, demo_dir, converted, marker, tmp_path, monkeypatch):
    source = tmp_path / "megatron"
    shutil.copytree(converted / MODEL_DIR, source)
    hostile_torch_file(source / "common.pt", marker)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)  # set by any earlier read in this process
    torch.load(source / "common.pt", weights_only=False)  # the file is real: an unguarded read runs it
    assert marker.exists()
    marker.unlink()
    result = run_convert(base_overrides, demo_dir, source, f"model.hf_config={converted / HF_DIR}")
    assert not marker.exists() and len(committed(tmp_path)) == 1
    out = Path(result.uri) / MODEL_DIR
    expected, got = tensors(converted / MODEL_DIR), tensors(out)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert torch.load(out / "common.pt", weights_only=True) == {}  # ours, not the source's


def test_an_hf_source_is_read_as_safetensors_only(base_overrides, demo_dir, converted, marker, tmp_path):
    source = tmp_path / "hf"
    shutil.copytree(demo_dir / "tiny-llama", source)
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        hostile_torch_file(source / name, marker)
    result = run_convert(base_overrides, demo_dir, source)
    assert not marker.exists() and len(committed(tmp_path)) == 1
    expected, got = tensors(converted / MODEL_DIR), tensors(Path(result.uri) / MODEL_DIR)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_an_hf_source_with_pickled_weights_only_is_refused_at_compose(base_overrides, demo_dir, marker, tmp_path):
    source = tmp_path / "hf-bin"
    source.mkdir()
    shutil.copy(demo_dir / "tiny-llama" / "config.json", source)
    hostile_torch_file(source / "pytorch_model.bin", marker)
    with pytest.raises(ConfigError) as err:
        compose("convert", [*base_overrides, f"model.source={source}", f"model.tokenizer={demo_dir / 'tokenizer'}"])
    assert f"model.source: {source} holds pickled weights only (pytorch_model.bin), which alignflow never loads" in str(err.value)
    assert not marker.exists() and not (tmp_path / "store").exists()


def test_a_tokenizer_that_needs_its_own_code_is_refused(demo_dir, tmp_path):
    from alignflow.job.data.tokenize import load_tokenizer

    marker, tokenizer = tmp_path / "code-ran", tmp_path / "tokenizer"
    shutil.copytree(demo_dir / "tokenizer", tokenizer)
    (tokenizer / "custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nfrom transformers import PreTrainedTokenizerFast as CustomTokenizer\n"
    )
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": [None, "custom.CustomTokenizer"]}}
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"The repository {tokenizer} contains custom code which must be executed")):
        load_tokenizer(str(tokenizer))
    assert not marker.exists()


@pytest.mark.parametrize("hostile", ["common.pt", ".metadata"])
def test_loading_a_model_output_that_would_run_code_is_refused(one_rank, converted, marker, tmp_path, hostile):
    """What every training and forward stage does with its model input (Megatron's
    dist_checkpointing: `common.pt` through torch.load, `.metadata` through DCP's reader)."""
    from alignflow.job.model import sharded_state
    from alignflow.job.model.gpt import build_gpt

    output = tmp_path / "output"
    shutil.copytree(converted, output)
    if hostile == "common.pt":
        hostile_torch_file(output / MODEL_DIR / "common.pt", marker)
        wanted, error = "builtins.getattr, pathlib.Path", pickle.UnpicklingError
    else:
        hostile_metadata(output / MODEL_DIR, marker)
        wanted, error = "pathlib.Path.touch", CheckpointException  # DCP wraps what a rank raised
    chunks = build_gpt(json.loads((output / HF_DIR / "config.json").read_text()), one_rank)
    with pytest.raises(error) as err:
        sharded_state.load(chunks, str(output / MODEL_DIR))
    assert f"{output / MODEL_DIR / hostile} wants to import {wanted}; {REFUSED}" in str(err.value)
    assert not marker.exists()


def test_a_sharded_object_that_would_run_code_is_refused(one_rank, marker, tmp_path):
    """DCP reads a sharded object (Megatron's `_extra_state`, say) with torch.load(weights_only=False),
    whatever Megatron asks: `refuse_code` makes torch use its weights-only unpickler there too."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    checkpoint = tmp_path / "objects"
    checkpoint.mkdir()
    dist_checkpointing.save({"extra": ShardedObject("extra", RunsCode(marker), (1,), (0,))}, str(checkpoint))
    refuse_code()
    with pytest.raises(CheckpointException, match="Unsupported global: GLOBAL getattr"):
        dist_checkpointing.load({"extra": ShardedObject("extra", None, (1,), (0,))}, str(checkpoint))
    assert not marker.exists()


def test_metadata_pointing_outside_its_checkpoint_is_refused(converted, tmp_path):
    source = tmp_path / "megatron"
    shutil.copytree(converted / MODEL_DIR, source)
    with open(source / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(source / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{source}/.metadata points at ../../etc/passwd, outside its checkpoint; {REFUSED}")):
        DistCheckpointReader(str(source))


def test_an_environment_that_turns_weights_only_off_is_refused(converted, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 would let checkpoints run code when loaded: unset it"):
        DistCheckpointReader(str(converted / MODEL_DIR))


def test_a_megatron_written_nemo_style_checkpoint_converts_exactly(one_rank, demo_dir, converted, tmp_path):
    """Megatron's own writer, NeMo 2's `module.` prefix, Transformer Engine-style `_extra_state`
    sharded objects and plain data in common.pt: the restricted reader takes all of its
    metadata (as plain pickle reads it) and the conversion is exact."""
    from alignflow.job.model import sharded_state
    from alignflow.job.model.gpt import build_gpt

    chunks = build_gpt(json.loads((converted / HF_DIR / "config.json").read_text()), one_rank)
    sharded_state.load(chunks, str(converted / MODEL_DIR))
    state = chunks[0].sharded_state_dict(prefix="module.")
    assert any(key.endswith("._extra_state") for key in state)
    nemo = tmp_path / "nemo" / "weights"
    nemo.mkdir(parents=True)
    dist_checkpointing.save({**state, "checkpoint_version": 3.0, "content_metadata": {"step": 7}}, str(nemo))
    with open(nemo / ".metadata", "rb") as f:
        plain = pickle.load(f)
    with open(nemo / ".metadata", "rb") as f:
        restricted = MetadataUnpickler(f, str(nemo / ".metadata")).load()
    assert vars(restricted) == vars(plain) and "BytesStorageMetadata" in {type(v).__name__ for v in plain.state_dict_metadata.values()}
    out = tmp_path / "from-nemo"
    convert.run(
        OmegaConf.create(
            {
                "model": {
                    "source": str(nemo),
                    "hf_config": str(converted / HF_DIR),
                    "tokenizer": str(demo_dir / "tokenizer"),
                    "make_vocab_size_divisible_by": 128,
                },
                "convert": {"parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}},
            }
        ),
        {},
        str(out),
    )
    expected, got = tensors(converted / MODEL_DIR), tensors(out / MODEL_DIR)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_training_checkpoint_whose_rng_file_would_run_code_is_refused_on_resume(demo_dir, converted, marker, tmp_path):
    inputs = {"data": str(prep_demo(demo_dir, tmp_path / "data")), "model": str(converted)}
    cfg = sft_cfg(demo_dir, trainer={"max_steps": 2, "val_check_interval": 2}, checkpoint={"every_n_steps": 2, "save_top_k": 1})
    out = tmp_path / "sft"
    run_sft(cfg, inputs, out)
    rank_file = out / "checkpoints" / "step-00000002" / "rank-00000.pt"
    assert torch.load(rank_file, weights_only=True)["layout"]  # our own format: plain data and tensors
    hostile_torch_file(rank_file, marker)
    with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{rank_file} wants to import builtins.getattr, pathlib.Path; {REFUSED}")):
        run_sft(cfg, inputs, out)  # resumes from step 2
    assert not marker.exists()
