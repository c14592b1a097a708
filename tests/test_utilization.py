"""Model FLOPs against torch's own count (FlopCounterMode), the peak table, and the report."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from alignflow.orchestrator.report import stage_report
from alignflow.job.train.utilization import FORWARD, LORA_TRAINING, TRAINING, ModelShape, figures, model_flops, peak_tflops

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    tie_word_embeddings=False,
)


def counted(model, lengths: list[int], mode: str) -> tuple[int, int]:
    """torch's count of (weight matmul, attention bmm) FLOPs, each document run on its own (eager
    attention: the whole score matrix is computed, so the causal half is ours to take)."""
    with FlopCounterMode(display=False) as counter:
        for n in lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, n), device=model.device)
            if mode == "forward":
                with torch.no_grad():
                    model(ids)
            elif mode == "frozen":  # LoRA: the base is frozen, gradients flow to the inputs (the adapters) only
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
                model(inputs_embeds=embeds, labels=ids).loss.backward()
            else:
                model(ids, labels=ids).loss.backward()
    found = counter.get_flop_counts()["Global"]
    return found[torch.ops.aten.mm], found[torch.ops.aten.bmm]


def llama(shape: dict, device: str) -> LlamaForCausalLM:
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="eager"))


def test_model_flops_of_a_training_step_are_torchs_count_on_the_1b_shape():
    """The 1B shape at one 4096-token document, on the meta device (shapes only): the weight
    GEMMs exactly (GQA's smaller K/V, the SwiGLU MLP's three matrices, the tied logits), and
    half of the whole score matrix (causal: Megatron-LM's convention)."""
    model = llama(LLAMA_1B, "meta")
    mm, bmm = counted(model, [4096], "train")
    assert mm == 6 * 4096 * sum(p.numel() for p in model.parameters() if p.dim() == 2)  # 6N per token (N: the matrices; tied: once)
    assert model_flops(ModelShape.of(model.config.to_dict()), [4096], TRAINING) == mm + bmm / 2


@pytest.mark.parametrize("mode,passes", [("train", TRAINING), ("frozen", LORA_TRAINING), ("forward", FORWARD)])
def test_model_flops_sum_each_documents_attention(mode, passes):
    """Documents of a packed row attend within themselves: the count of each run alone, summed."""
    torch.manual_seed(0)
    model = llama(TINY, "cpu")
    if mode == "frozen":
        model.requires_grad_(False)
    lengths = [5, 11, 32]
    mm, bmm = counted(model, lengths, mode)
    assert model_flops(ModelShape.of(model.config.to_dict()), lengths, passes) == mm + bmm / 2


def test_the_peak_table_knows_the_lent_devices_and_no_other():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA H100 NVL") is None and peak_tflops(None) is None
    assert figures(989e12 * 2 * 3, 3.0, 4, "NVIDIA H100 80GB HBM3") == {"tflops": 1978.0, "mfu": 0.5}
    assert figures(1e9, 1.0, 1, None) == {"tflops": 0.001, "mfu": None}


def test_report_shows_the_hardware_use():
    page = stage_report(
        "ref",
        {
            "kind": "ref_logprobs",
            "metrics": {"train.pairs": 4, "tokens_per_s": 812.5, "tflops": 0.0123, "mfu": None, "peak_memory_gib": 1.5, "peak_memory_of": "peak RSS"},
        },
        [],
    )
    hardware = page.split("<h2>hardware use</h2>")[1].split("<h2>")[0]
    assert all(cell in hardware for cell in ("812.5", "0.0123", "n/a", "1.5", "peak RSS")) and "train.pairs" not in hardware


def test_a_jobs_peak_memory_is_its_own_not_the_process_that_started_it():
    """Linux carries `ru_maxrss` over exec from the forking process; the peak a stage reports
    (`peak_rss_bytes`) is the job's own: a child of a parent holding 600 MiB reports its own ~tens."""
    import subprocess
    import sys

    held = bytearray(600 * 2**20)
    held[::4096] = b"\1" * len(held[::4096])  # resident, page by page
    child = (
        "import resource; from alignflow.job.train.utilization import peak_rss_bytes; "
        "print(peak_rss_bytes() >> 20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)"
    )
    ours, inherited = map(int, subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.split())
    del held
    assert inherited >= 600 > 200 > ours, (ours, inherited)  # ru_maxrss: the parent's; ours: the child's
