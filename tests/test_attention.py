"""Packed attention (`alignflow.job.model.attention`), against independent references:
- a micro batch of packed rows gives HF's logits (eager attention) on each document alone,
  through Megatron's forward and the lean forward, for Llama and Mistral's sliding window;
- a forward-only pass (eval mode, no gradients: reference log-probs, GRPO's old policy)
  gives exactly the training forward's log-probs, in fp32 and bf16: one kernel;
- no tensor of s x s elements or more is made for a long packed row, in the forward and
  backward of a training step and in a forward-only pass (every op's outputs watched);
- on CUDA in bf16 the kernel is torch's `varlen_attn`, called as torch's own fake (shape)
  implementation accepts (fake CUDA tensors: no GPU here, so shapes, not numbers).
"""

import numpy as np
import pytest
import torch
from megatron_ranks import TOLERANCE, converted_chunks, saved_state, tiny_hf_model
from reference_convert import hf_to_megatron
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from alignflow.job.model.attention import Documents, kernel, packed_attention
from alignflow.job.model.decoder import LeanForward
from alignflow.job.model.gpt import build_gpt, document_params, load_megatron_state, token_nll
from alignflow.job.forward.objectives import sft_forward
from alignflow.job.train.data import packed_rows

# Two rows of 320: a document over 128 tokens (a call of its own), short ones of mixed
# lengths (gathered by rounded length), two equal long ones (one call), then padding.
ROWS = [[150, 9, 20, 33, 70, 30], [140, 140, 17]]
LENGTH = 320


def packed_batch(rows: list[list[int]], length: int, vocab: int = 100) -> tuple[dict, list[np.ndarray]]:
    """A collated micro batch of random documents of the given lengths, and each row's ids."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, vocab, sum(docs)) for docs in rows]
    batch = vars(packed_rows([(row, np.ones(len(row)), np.cumsum([0, *docs])) for row, docs in zip(ids, rows)], length, pad_id=0))
    return batch, ids


@pytest.mark.parametrize("case", ["llama", "mistral_window", "gemma2", "gemma3"])  # Gemma 2: soft-capped scores (`eager`)
def test_packed_rows_give_hf_logits_of_each_document_alone(one_rank, case, tmp_path):
    hf_model, config = tiny_hf_model(case, max_position_embeddings=512)
    model = converted_chunks(config, one_rank, saved_state(hf_model, tmp_path))[0]
    batch, ids = packed_batch(ROWS, LENGTH)
    documents = document_params(batch)
    with torch.no_grad():
        ours = {
            "megatron": sft_forward(model, dict(batch, labels=None)),
            "lean": token_nll(LeanForward.of([model], LENGTH), batch["tokens"], batch["position_ids"], None, None, packed_seq_params=documents),
        }
        for r, docs in enumerate(ROWS):
            starts = np.cumsum([0, *docs])
            for a, e in zip(starts, starts[1:]):
                document = torch.as_tensor(ids[r][a:e])[None]
                # Megatron's forward rotates by row position (RoPE is relative: the same scores but
                # for the fp32 rounding of the angles, 1e-5 on Gemma's scaled activations at 300);
                # the lean forward by position in the document.
                positions = {"megatron": torch.arange(a, e)[None], "lean": None}
                for name, logits in ours.items():
                    expected = hf_model(document, position_ids=positions[name]).logits[0]
                    error = (logits[r, a:e, : config["vocab_size"]] - expected).abs().max().item()
                    assert error < TOLERANCE, f"{name}: row {r}, document {a}:{e}, max |logits - HF| {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_only_log_probs_equal_the_training_forwards(one_rank, dtype, tmp_path):
    """GRPO's KL to the reference is 0 at step 1 only if this holds: eval mode without
    gradients (the reference, the old policy) and train mode with them, through Megatron's
    forward and (fp32, where the engine takes it) the lean forward."""
    hf_model, config = tiny_hf_model("mistral_window", max_position_embeddings=512)
    [model] = build_gpt(config, one_rank, params_dtype=dtype)
    load_megatron_state(model, hf_to_megatron(saved_state(hf_model, tmp_path), config, 0, 1, 0, 1))
    batch, _ = packed_batch(ROWS, LENGTH)

    def lean() -> torch.Tensor:
        forward = LeanForward.of([model], LENGTH)
        assert forward is not None
        return token_nll(forward, batch["tokens"], batch["position_ids"], None, batch["labels"], packed_seq_params=document_params(batch))

    forwards = {"megatron": lambda: sft_forward(model, batch), **({"lean": lean} if dtype == torch.float32 else {})}
    model.eval()
    for name, forward in forwards.items():
        with torch.no_grad():
            forward_only = -forward().float()
        model.train()
        training = -forward().float()
        (training * batch["loss_mask"]).sum().backward()  # a training step's forward, whose graph is used
        model.eval()
        model.zero_grad()
        assert torch.equal(forward_only, training.detach()), f"{name}: max |difference| {(forward_only - training).abs().max():.2e}"


class LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an op returns while active (autograd's backward ops too)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("case", ["llama", "mistral_window", "gemma2"])
def test_no_s_by_s_tensor_for_a_long_packed_row(one_rank, case):
    """A row of 2048 tokens packing nine documents (the longest 700): the largest tensor of a
    training step's forward and backward and of a forward-only pass, from collating the row
    on, is below 2048^2 elements (a dense mask is 2048^2; scores per head are more)."""
    s = 2048
    config = tiny_hf_model(case, max_position_embeddings=s)[1]
    [model] = build_gpt(config, one_rank)
    for grad in (True, False):
        watch = LargestOutput()
        with watch, torch.set_grad_enabled(grad):
            batch, _ = packed_batch([[700, 513, 300, 200, 130, 90, 60, 33, 17]], s)
            nll = sft_forward(model, batch)
            if grad:
                (nll * batch["loss_mask"]).sum().backward()
        print(f"{case}, {'training' if grad else 'forward-only'}: largest tensor {watch.largest} elements ({watch.op}), s^2 = {s * s}")
        assert watch.largest < s * s, (watch.largest, watch.op)


def test_thd_sequences_attend_as_the_same_documents_of_a_row(one_rank):
    """Transformer Engine's batches (a soft-capped model's core attention is ours there too):
    THD queries [t, heads, dim] with their cu_seqlens give what the [s, b] row gives."""
    from megatron.core.packed_seq_params import PackedSeqParams

    [model] = build_gpt(tiny_hf_model("gemma2")[1], one_rank)
    attention = model.decoder.layers[0].self_attention.core_attention  # a window layer, soft-capped
    assert attention.softcap == 5.0 and attention.window_size == (3, 0)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, 1, n, 32, generator=generator) for n in (4, 2, 2))
    cu_seqlens = torch.tensor([0, 7, 19, 30], dtype=torch.int32)
    row = attention(q, k, v, None, packed_seq_params=Documents.of(cu_seqlens, 12, 30))
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=12, max_seqlen_kv=12)
    torch.testing.assert_close(attention(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=thd), row[:, 0], rtol=0, atol=0)


def test_on_cuda_in_bf16_the_kernel_is_torchs_varlen_attention():
    """Fake CUDA tensors run the `varlen` call through torch's fake implementation of the flash
    op: the arguments our call passes are the ones torch's `varlen_attn` takes, with query
    groups and a window, and the output has the queries' shape. fp32, dropout and the CPU
    take `sdpa`."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(24, 4, 16, dtype=torch.bfloat16, device="cuda")
        kv = torch.empty(24, 2, 16, dtype=torch.bfloat16, device="cuda")
        documents = Documents.of(
            torch.empty(4, dtype=torch.int32, device="cuda"), 12, 24
        )  # 3 documents; fake tensors hold no values (and torch.tensor(device="cuda") is refused once tests/accelerator.py registered its device)
        assert kernel(q, 0.0) == "varlen" and kernel(q, 0.1) == "sdpa" and kernel(q.float(), 0.0) == "sdpa"
        for window in (None, (3, 0)):
            out = packed_attention(q, kv, kv, documents, window, 0.25)
            assert out.shape == q.shape and out.dtype == q.dtype and out.is_cuda
    assert kernel(torch.zeros(2, 4, 16, dtype=torch.bfloat16), 0.0) == "sdpa"
