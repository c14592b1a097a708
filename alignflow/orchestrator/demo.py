"""Deterministic offline demo assets: a byte-level BPE tokenizer, a tiny random Llama (and a
smaller one sharing its tokenizer: the distill pipeline's student; a tiny Qwen3; and a tiny
Qwen3-MoE, the mixture-of-experts demo model: conf/model/tiny_qwen3_moe.yaml) and an arithmetic task
("What is 17 + 25?" -> "42") whose answers a reward function can check; and the same task as two
lm-evaluation-harness tasks over local files (`benchmarks/`, the benchmark stage's demo).

There is no model hub here, so the demo and the tests build everything they need from seeds.
Runs on the orchestrator side: no torch, no transformers; only tokenizers, numpy and
safetensors. `build` is idempotent and rewrites only files whose bytes change, so mtimes
(and anything keyed on them) stay stable across calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save as save_safetensors
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SEED = 1234
MAX_OPERAND = 49
VOCAB_SIZE = 768

PAD, BOS, EOS = "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)

# An assistant turn ends exactly at eos, so an assistant-only loss mask is "42<|end_of_text|>".
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{- eos_token }}{%- else %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# A little ordinary English so the tokenizer is not only digits and "What is".
SENTENCES = (
    "You are a helpful assistant that answers arithmetic questions with a single number.",
    "The quick brown fox jumps over the lazy dog.",
    "Alignment pipelines prepare data, fine-tune a model and then optimise its preferences.",
    "A tokenizer turns text into integer ids; a model turns ids into the next token's logits.",
    "Please answer the question below. Think carefully, then give only the final answer.",
    "The answer is correct when it equals the sum or the difference of the two numbers.",
    "Training loss goes down, validation loss follows, and the reward slowly goes up.",
    "Numbers such as 0, 7, 13, 42 and 99 appear in questions and in answers.",
)

VAL_PROBLEMS = 200  # one held-out set: every kind's val split, never in any kind's train split
SPLITS = {  # file stem -> (row kind, train rows, seed offset, operators)
    "sft": ("messages", 2000, 1, "+-"),
    "preference": ("preference", 1000, 2, "+-"),
    "prompts": ("prompts", 4000, 3, "+-"),
    "sft_domain": ("messages", 1000, 4, "-"),  # a "domain" set: subtraction only (pipeline sft_general_domain)
    "preference_rm": ("preference", 4000, 5, "+-"),  # the reward model's pairs (pipeline sft_rm_grpo; its val: preference's)
}

MODEL_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}

# The distill pipeline's student: the demo Llama narrowed (hidden 48, heads of 12), about half
# its non-embedding parameters; same tokenizer, so it can learn from the teacher's top-k.
STUDENT_CONFIG = {**MODEL_CONFIG, "hidden_size": 48, "intermediate_size": 128}
# Qwen3's traits: per-head q/k norms, a head_dim wider than hidden / heads, tied embeddings.
QWEN3_CONFIG = {**MODEL_CONFIG, "head_dim": 32, "tie_word_embeddings": True}
# The mixture-of-experts demo: Qwen3-MoE of the demo Llama's attention (with q/k norms), every
# layer 4 experts of width 48, top 2 renormalized, as Qwen3-30B-A3B's router (norm_topk_prob).
MOE_CONFIG = {
    **MODEL_CONFIG,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}

# Folder -> (architecture, HF model_type, shape): the demo's models, all on the one tokenizer.
MODELS = {
    "tiny-llama": ("LlamaForCausalLM", "llama", MODEL_CONFIG),
    "tiny-llama-student": ("LlamaForCausalLM", "llama", STUDENT_CONFIG),
    "tiny-qwen3": ("Qwen3ForCausalLM", "qwen3", QWEN3_CONFIG),
    "tiny-qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe", MOE_CONFIG),
}


def build(dest: str | Path) -> Path:
    """Write tokenizer/, one folder per model of MODELS and data/ under dest (idempotent)
    and return dest."""
    dest = Path(dest)
    tokenizer = train_tokenizer()
    tok_files = tokenizer_files(tokenizer)
    for name, data in tok_files.items():
        write_if_changed(dest / "tokenizer" / name, data)
    for folder, model in MODELS.items():
        for name, data in {**model_files(tokenizer, *model), **tok_files}.items():
            write_if_changed(dest / folder / name, data)
    for name, data in data_files().items():
        write_if_changed(dest / "data" / name, data)
    for name, data in benchmark_files(dest.resolve() / "benchmarks").items():
        write_if_changed(dest / "benchmarks" / name, data)
    return dest


# ---------------------------------------------------------------- the arithmetic task


def all_problems() -> list[tuple[int, str, int]]:
    """Every (a, op, b) with operands 0..MAX_OPERAND and op in + -: 5,000 problems."""
    ops = ("+", "-")
    r = range(MAX_OPERAND + 1)
    return [(a, op, b) for a in r for op in ops for b in r]


def question(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def answer(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def split_problems(train_rows: int, seed: int, ops: str = "+-") -> tuple[list, list]:
    """(train, val): the shared held-out problems, and `train_rows` others with operators `ops`
    drawn with `seed`, so no stage trains on a problem that eval scores."""
    problems = all_problems()
    order = np.random.default_rng(SEED).permutation(len(problems))
    val, rest = [problems[i] for i in order[:VAL_PROBLEMS]], [i for i in order[VAL_PROBLEMS:] if problems[i][1] in ops]
    train = np.random.default_rng(seed).choice(rest, size=train_rows, replace=False)
    return [problems[i] for i in train], [p for p in val if p[1] in ops]


def wrong_answer(correct: int, rng: np.random.Generator) -> int:
    """A plausible wrong answer: off by 1..10 either way."""
    offset = int(rng.integers(1, 11)) * (1 if rng.random() < 0.5 else -1)
    return correct + offset


def make_rows(kind: str, problems: list, rng: np.random.Generator) -> list[dict]:
    rows = []
    for a, op, b in problems:
        q, ans = question(a, op, b), answer(a, op, b)
        if kind == "messages":
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": str(ans)}]})
        elif kind == "preference":
            rows.append({"prompt": q, "chosen": str(ans), "rejected": str(wrong_answer(ans, rng))})
        else:
            rows.append({"prompt": q, "answer": str(ans)})
    return rows


def data_files() -> dict[str, bytes]:
    """The jsonl files of the demo task (train and val of each of SPLITS), as bytes."""
    files = {}
    for stem, (kind, n_train, offset, ops) in SPLITS.items():
        train, val = split_problems(n_train, SEED + offset, ops)
        rng = np.random.default_rng(SEED + 10 * offset)
        for split, problems in (("train", train), ("val", val)):
            lines = [json.dumps(row, ensure_ascii=False) for row in make_rows(kind, problems, rng)]
            files[f"{stem}_{split}.jsonl"] = ("\n".join(lines) + "\n").encode()
    return files


# ---------------------------------------------------------------- the task as lm-eval tasks

BENCHMARK_DOCS = 50  # per task, from the held-out problems: a quick run, a standard error of ~0.07

# lm-eval's arithmetic_2da form (loglikelihood of the answer, `acc`: is it the greedy continuation),
# with lm-eval's `perplexity` of the answers beside it, a measure that moves before accuracy does.
ARITHMETIC_TASK = """\
# The demo's held-out arithmetic problems in lm-eval's arithmetic_2da form, over a local file
# (written by `align demo`, alignflow/orchestrator/demo.py).
task: arithmetic_demo
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: loglikelihood
validation_split: validation
test_split: null
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{completion}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
metadata:
  version: 1.0
"""

# lm-eval's gsm8k task (its metric and its two answer filters) on GSM8K-format rows of the
# demo's held-out problems; a question is the demo's prompt as the chat models were trained on it.
GSM8K_TASK = """\
# The demo's held-out arithmetic problems as GSM8K-format rows ("#### N" answers), scored as
# lm-eval's gsm8k task scores GSM8K, over a local file (written by `align demo`).
task: gsm8k_demo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore:
      - ","
      - "\\\\$"
      - "(?s).*#### "
      - "\\\\.$"
generation_kwargs:
  until:
    - "Question:"
  do_sample: false
  temperature: 0.0
  max_gen_toks: 16
repeats: 1
num_fewshot: 0
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 1.0
"""


def benchmark_files(folder: Path) -> dict[str, bytes]:
    """An lm-eval task folder (`--include_path`): arithmetic_demo and gsm8k_demo, each a YAML
    naming its jsonl in `folder` by absolute path (datasets reads a relative one from the cwd)."""
    _, val = split_problems(0, SEED)
    arithmetic, gsm8k = val[:BENCHMARK_DOCS], val[BENCHMARK_DOCS : 2 * BENCHMARK_DOCS]
    rows = {
        "arithmetic_demo": [{"context": question(*p), "completion": str(answer(*p))} for p in arithmetic],
        "gsm8k_demo": [{"question": question(*p), "answer": f"{p[0]} {p[1]} {p[2]} = {answer(*p)}\n#### {answer(*p)}"} for p in gsm8k],
    }
    files = {f"{name}.jsonl": ("\n".join(json.dumps(row) for row in docs) + "\n").encode() for name, docs in rows.items()}
    return files | {
        "arithmetic_demo.yaml": ARITHMETIC_TASK.format(data=folder / "arithmetic_demo.jsonl").encode(),
        "gsm8k_demo.yaml": GSM8K_TASK.format(data=folder / "gsm8k_demo.jsonl").encode(),
    }


# ---------------------------------------------------------------- tokenizer


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """CHAT_TEMPLATE in Python (no jinja on this side), used only to make training text."""
    text = BOS
    for m in messages:
        text += f"<|{m['role']}|>\n{m['content']}" + (EOS if m["role"] == "assistant" else "\n")
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def training_corpus() -> list[str]:
    """Chat-rendered text of every problem (with a correct and a near answer) plus SENTENCES."""
    rng = np.random.default_rng(SEED)
    corpus = list(SENTENCES)
    for a, op, b in all_problems():
        ans = answer(a, op, b)
        for reply in (ans, wrong_answer(ans, rng)):
            msgs = [{"role": "user", "content": question(a, op, b)}, {"role": "assistant", "content": str(reply)}]
            corpus.append(render_chat(msgs))
    return corpus


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE in the GPT-2 / Llama-3 style; deterministic for a fixed corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def token_ids(tok: Tokenizer) -> dict[str, int]:
    ids = (tok.token_to_id(t) for t in (PAD, BOS, EOS))
    return dict(zip(("pad_token_id", "bos_token_id", "eos_token_id"), ids))


def tokenizer_files(tok: Tokenizer) -> dict[str, bytes]:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json in HF's layout."""
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": list(ROLE_TOKENS),
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
    }
    return {
        "tokenizer.json": (tok.to_str(pretty=True) + "\n").encode(),
        "tokenizer_config.json": dump_json(config),
        "special_tokens_map.json": dump_json({**specials, "additional_special_tokens": list(ROLE_TOKENS)}),
    }


# ---------------------------------------------------------------- tiny models


def model_config(vocab_size: int, ids: dict[str, int], architecture: str, model_type: str, c: dict) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        **c,
        "head_dim": c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": c["rope_theta"]},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": c.get("tie_word_embeddings", False),
        "torch_dtype": "float32",
        "use_cache": True,
        **ids,
    }


def model_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes exactly as HF's LlamaForCausalLM (Qwen3ForCausalLM: with q/k
    norms; Qwen3MoeForCausalLM: a router and experts for the MLP too) state dict has them; tied
    embeddings are saved once."""
    h, f, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if "num_experts" in cfg:
            m = cfg["moe_intermediate_size"]
            shapes |= {p + "mlp.gate.weight": (cfg["num_experts"], h)}
            for e in range(cfg["num_experts"]):
                x = f"{p}mlp.experts.{e}."
                shapes |= {x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h), x + "down_proj.weight": (h, m)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    return shapes | {"model.norm.weight": (h,)} | ({} if cfg["tie_word_embeddings"] else {"lm_head.weight": (v, h)})


def init_weights(cfg: dict) -> dict[str, np.ndarray]:
    """Seeded N(0, 0.02) matrices and unit norms, generated in a fixed key order."""
    rng = np.random.default_rng(SEED)
    weights = {}
    for name, shape in model_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        else:
            weights[name] = rng.normal(0.0, cfg["initializer_range"], size=shape).astype(np.float32)
    return weights


def model_files(tok: Tokenizer, architecture: str, model_type: str, shape: dict) -> dict[str, bytes]:
    ids = token_ids(tok)
    cfg = model_config(tok.get_vocab_size(with_added_tokens=True), ids, architecture, model_type, shape)
    generation = {**ids, "do_sample": False, "max_new_tokens": 8}
    return {
        "config.json": dump_json(cfg),
        "generation_config.json": dump_json(generation),
        "model.safetensors": save_safetensors(init_weights(cfg), metadata={"format": "pt"}),
    }


# ---------------------------------------------------------------- files


def dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode()


def write_if_changed(path: Path, data: bytes) -> None:
    """Atomic write that leaves an identical file (and its mtime) untouched."""
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
