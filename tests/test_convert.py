"""HF -> Megatron torch_dist -> HF: bit-exact, loadable at any TP/PP, never stale."""

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from alignflow.job.model_files import HF_DIR, MODEL_DIR
from alignflow.job.model_files.dist_io import Chunk, DistCheckpointReader, Entry, save_lazy
from alignflow.orchestrator.config.compose import ConfigError, build, compose
from alignflow.job.convert import streaming
from alignflow.orchestrator.fingerprint import fingerprint
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage, stage_identity
from alignflow.job.stages import convert, export

sys.path.insert(0, str(Path(__file__).parent))
from megatron_ranks import tiny_hf_model  # noqa: E402
from ranks import run_ranks  # noqa: E402

RANKS = Path(__file__).with_name("checkpoint_ranks.py")
TOLERANCE = 1e-5
# q/k norms, biases, sandwich norms, post-norm, fused qkv_proj, Phi-4-mini's config (partial rotary longrope), experts
STREAMED = [
    "llama",
    "qwen2",
    "qwen3_tied_bias",
    "llama_biases",
    "gemma2",
    "gemma3",
    "olmo2_tied_bias",
    "phi3_window",
    "phi4_mini_longrope",
    "mixtral",
    "qwen3_moe",
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random Llama (GQA, untied, random norms; saved in shards) and Qwen2 (qkv bias, tied)."""
    dirs = {}
    for case in STREAMED:
        model, _ = tiny_hf_model(case)
        dirs[case] = tmp_path_factory.mktemp(case)
        model.save_pretrained(dirs[case], max_shard_size="40KB")
    assert (dirs["llama"] / "model.safetensors.index.json").exists()
    return dirs


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def stage_cfg(source, demo_dir, tp=1, hf_config=None, **export_cfg):
    return OmegaConf.create(
        {
            "model": {"source": str(source), "hf_config": hf_config, "tokenizer": str(demo_dir / "tokenizer"), "make_vocab_size_divisible_by": 128},
            "convert": {"parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1}},
            "export": {"dtype": "float32", "max_shard_size": "2GB", "destination": None, **export_cfg},
        }
    )


def convert_to(tmp_path, source, demo_dir, name="ckpt", **kw) -> Path:
    out = tmp_path / name
    convert.run(stage_cfg(source, demo_dir, **kw), {}, str(out))
    return out


def export_to(tmp_path, ckpt, demo_dir, name="export", **export_cfg) -> Path:
    out = tmp_path / name
    export.run(stage_cfg("unused", demo_dir, **export_cfg), {"model": str(ckpt)}, str(out))
    return out


def on_ranks(nproc: int, *args: str) -> str:
    """tests/checkpoint_ranks.py on `nproc` ranks; their stdout."""
    run = run_ranks(nproc, RANKS, *args)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def logits(tmp_path, ckpt, hf_dir, tp=1, pp=1, ep=1) -> dict:
    out = tmp_path / f"logits-{ckpt.name}-tp{tp}-pp{pp}-ep{ep}.pt"
    on_ranks(max(tp * pp, ep), "logits", str(ckpt), str(hf_dir), str(out), "--tp", str(tp), "--pp", str(pp), "--ep", str(ep))
    return torch.load(out)


@pytest.fixture(params=["one-chunk", "small-chunks"])
def chunking(request, monkeypatch):
    """Tiny models fit one chunk per tensor; small chunks exercise row, gate/up and query-group splits."""
    if request.param == "small-chunks":
        monkeypatch.setattr(streaming, "CHUNK_BYTES_RANGE", (1000, 1000))
    return request.param


@pytest.mark.parametrize("case", STREAMED)
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_identical(hf_dirs, demo_dir, tmp_path, case, tp, chunking):
    ckpt = convert_to(tmp_path, hf_dirs[case], demo_dir, tp=tp)
    if chunking == "small-chunks":
        stored = DistCheckpointReader(str(ckpt / MODEL_DIR)).metadata.state_dict_metadata
        assert len(stored["decoder.layers.self_attention.linear_qkv.weight"].chunks) > 4
        if "decoder.layers.mlp.experts.experts.linear_fc1.weight" in stored:  # [layers, experts, gate; up rows, hidden]
            assert len(stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].chunks) > 4 * 4
    exported = export_to(tmp_path, ckpt, demo_dir)
    source, back = hf_tensors(hf_dirs[case]), hf_tensors(exported)
    assert set(back) == set(source)
    for name in source:
        assert torch.equal(back[name], source[name]), name
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_export_shards_and_casts(hf_dirs, demo_dir, tmp_path):
    ckpt = convert_to(tmp_path, hf_dirs["llama"], demo_dir)
    exported = export_to(tmp_path, ckpt, demo_dir, dtype="bfloat16", max_shard_size="30KB")
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"
    assert (exported / "tokenizer.json").exists() and (exported / "generation_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.dtype == torch.bfloat16
    source = hf_tensors(hf_dirs["llama"])
    assert torch.equal(hf_tensors(exported)["model.norm.weight"], source["model.norm.weight"].bfloat16())


def test_nemo_prefixed_torch_dist_source(hf_dirs, demo_dir, tmp_path):
    """A NeMo 2 checkpoint is a torch_dist checkpoint whose keys start with `module.`."""
    ckpt = convert_to(tmp_path, hf_dirs["llama"], demo_dir)
    reader = DistCheckpointReader(str(ckpt / MODEL_DIR))
    entries = [
        Entry(
            f"module.{key}",
            reader.shape(key),
            reader.dtype(key),
            tuple(
                Chunk(tuple(c.offsets), tuple(c.sizes), lambda key=key, c=c: reader.read_chunk(key, c.offsets))
                for c in reader.metadata.state_dict_metadata[key].chunks
            ),
        )
        for key in reader.keys()
    ]
    nemo = tmp_path / "nemo" / "weights"
    save_lazy(str(nemo), entries)
    again = convert_to(tmp_path, nemo, demo_dir, name="from-nemo", hf_config=str(ckpt / HF_DIR))
    exported = export_to(tmp_path, again, demo_dir)
    source, back = hf_tensors(hf_dirs["llama"]), hf_tensors(exported)
    assert all(torch.equal(back[k], source[k]) for k in source)


def test_unsupported_architecture_fails_at_compose(base_overrides, tmp_path, hf_dirs):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    config = json.loads((hf_dirs["llama"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="model.source: .*unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        compose("demo", [*base_overrides, f"model.source={bad}"])


@pytest.mark.slow
def test_changing_one_source_tensor_reconverts(base_overrides, hf_dirs, tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for f in hf_dirs["llama"].iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    overrides = [*base_overrides, f"model.source={source}", "pipeline.stages={convert: {}}"]
    first = run_stage(build("demo", overrides)["convert"], {}, log=print)
    assert run_stage(build("demo", overrides)["convert"], {}, log=print).cached
    shard = sorted(source.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, shard, metadata={"format": "pt"})
    cfg = compose("demo", overrides)
    assert fingerprint(stage_identity(Pipeline.build(cfg)["convert"], {})) != first.fingerprint
    second = run_stage(Pipeline.build(cfg)["convert"], {}, log=print)
    assert not second.cached
    changed = DistCheckpointReader(f"{second.uri}/{MODEL_DIR}")
    assert changed.keys()


@pytest.mark.slow
# Llama's keys in many chunks each; OLMo 2's q/k norms load TP-sharded. The other families' layouts
# (in-memory states at TP2 / PP2): tests/test_megatron_model.py.
@pytest.mark.parametrize("case", ["llama", "olmo2_tied_bias"])
def test_logits_match_hf_at_tp1_tp2_pp2(hf_dirs, demo_dir, tmp_path, case, monkeypatch):
    if case == "llama":
        monkeypatch.setattr(streaming, "CHUNK_BYTES_RANGE", (1000, 1000))  # many chunks per key, resharded on load
    ckpt = convert_to(tmp_path, hf_dirs[case], demo_dir, tp=2)
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        assert logits(tmp_path, ckpt, hf_dirs[case], tp, pp)["error"] < TOLERANCE, (tp, pp)


@pytest.mark.slow
def test_moe_checkpoints_load_at_ep2_with_hf_logits_and_megatron_saves_them_alike(hf_dirs, demo_dir, tmp_path, monkeypatch):
    """The converter's expert keys are the ones Megatron's SequentialMLP asks for at EP2 (and
    reshards to each rank's experts; TP2 / PP2 on in-memory states: tests/test_megatron_model.py);
    Megatron's own writer at EP2 stores what exports back bit-exactly."""
    case = "qwen3_moe"
    monkeypatch.setattr(streaming, "CHUNK_BYTES_RANGE", (1000, 1000))  # many chunks per expert, resharded on load
    ckpt = convert_to(tmp_path, hf_dirs[case], demo_dir)
    assert logits(tmp_path, ckpt, hf_dirs[case], ep=2)["error"] < TOLERANCE
    resaved = tmp_path / "ep2-saved"
    on_ranks(2, "resave", str(ckpt), str(resaved), "--ep", "2")
    source, back = hf_tensors(hf_dirs[case]), hf_tensors(export_to(tmp_path, resaved, demo_dir, name="export-ep2"))
    assert set(back) == set(source) and all(torch.equal(back[k], source[k]) for k in source)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "olmo2_tied_bias"])
def test_round_trip_through_megatron_saved_tp2_and_pp2_checkpoints(hf_dirs, demo_dir, tmp_path, case):
    ckpt = convert_to(tmp_path, hf_dirs[case], demo_dir, tp=2)
    source = hf_tensors(hf_dirs[case])
    for name, layout in (("tp2", ["--tp", "2"]), ("pp2", ["--pp", "2"])):
        resaved = tmp_path / f"{name}-saved"
        on_ranks(2, "resave", str(ckpt), str(resaved), *layout)
        back = hf_tensors(export_to(tmp_path, resaved, demo_dir, name=f"export-{name}"))
        assert set(back) == set(source) and all(torch.equal(back[k], source[k]) for k in source), name


@pytest.mark.slow
def test_a_tp2_saved_checkpoint_loads_at_tp1_and_pp2_with_identical_logits(hf_dirs, demo_dir, tmp_path):
    ckpt = convert_to(tmp_path, hf_dirs["llama"], demo_dir, tp=2)
    resaved = tmp_path / "tp2-saved"
    on_ranks(2, "resave", str(ckpt), str(resaved), "--tp", "2")
    reference = logits(tmp_path, ckpt, hf_dirs["llama"])["logits"]
    for tp, pp in ((1, 1), (1, 2)):
        assert torch.equal(logits(tmp_path, resaved, hf_dirs["llama"], tp, pp)["logits"], reference), (tp, pp)
