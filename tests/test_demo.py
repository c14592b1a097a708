"""Demo assets: deterministic, idempotent, loadable by transformers, a checkable task."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from alignflow.orchestrator import demo


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return demo.build(tmp_path_factory.mktemp("demo"))


def files(root):
    return {p.relative_to(root): p for p in sorted(root.rglob("*")) if p.is_file()}


def content(path, root) -> bytes:
    """A file's bytes, the build's own folder named as `<demo>`: the lm-eval task YAMLs name their
    data files by absolute path (datasets reads a relative one from the working directory)."""
    return path.read_bytes().replace(bytes(root.resolve()), b"<demo>")


def test_build_is_deterministic(assets, tmp_path):
    other = demo.build(tmp_path / "again")
    a, b = files(assets), files(other)
    assert a.keys() == b.keys()
    assert {"tokenizer/tokenizer.json", "tiny-llama/model.safetensors", "data/sft_train.jsonl"} <= {str(k) for k in a}
    for rel in a:
        assert content(a[rel], assets) == content(b[rel], other), rel


def test_build_in_a_fresh_process_gives_the_same_bytes(assets, tmp_path):
    code = f"from alignflow.orchestrator import demo; import sys; demo.build({str(tmp_path)!r}); print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "'torch'" not in out and "'transformers'" not in out, "demo must stay orchestrator-side"
    for rel, path in files(assets).items():
        assert content(tmp_path / rel, tmp_path) == content(path, assets), rel


def test_rebuild_leaves_unchanged_files_alone(assets):
    before = {rel: p.stat().st_mtime_ns for rel, p in files(assets).items()}
    demo.build(assets)
    assert {rel: p.stat().st_mtime_ns for rel, p in files(assets).items()} == before


def test_tokenizer_loads_with_transformers(assets):
    tok = AutoTokenizer.from_pretrained(assets / "tokenizer")
    assert 512 <= len(tok) <= 1024
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (demo.BOS, demo.EOS, demo.PAD)
    msgs = [{"role": "user", "content": "What is 17 + 25?"}, {"role": "assistant", "content": "42"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == demo.render_chat(msgs) == f"{demo.BOS}<|user|>\nWhat is 17 + 25?\n<|assistant|>\n42{demo.EOS}"
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|assistant|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|assistant|>")) == 1


def test_tiny_llama_loads_and_runs(assets):
    model, info = LlamaForCausalLM.from_pretrained(assets / "tiny-llama", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = AutoTokenizer.from_pretrained(assets / "tiny-llama")
    cfg = model.config
    assert cfg.vocab_size == len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    ids = (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    assert ids == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert cfg.tie_word_embeddings is False
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    ids = torch.tensor([tok("What is 1 + 2?")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def solve(question):
    a, op, b = question.removeprefix("What is ").rstrip("?").split()
    return str(int(a) + int(b) if op == "+" else int(a) - int(b))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("folder", sorted(demo.MODELS))
def test_every_demo_model_loads_in_transformers_as_its_architecture(assets, folder):
    model, info = AutoModelForCausalLM.from_pretrained(assets / folder, output_loading_info=True)
    assert type(model).__name__ == demo.MODELS[folder][0] and not any(info.values()), info


def test_task_data(assets):
    data = assets / "data"
    sizes = {p.name: len(read_jsonl(p)) for p in data.glob("*.jsonl")}
    assert sizes == {
        "sft_train.jsonl": 2000,
        "sft_val.jsonl": 200,
        "preference_train.jsonl": 1000,
        "preference_val.jsonl": 200,
        "prompts_train.jsonl": 4000,
        "prompts_val.jsonl": 200,
        "sft_domain_train.jsonl": 1000,
        "sft_domain_val.jsonl": 102,  # the held-out problems that are subtractions
        "preference_rm_train.jsonl": 4000,
        "preference_rm_val.jsonl": 200,  # the reward model's pairs (sft_rm_grpo)
    }
    for row in read_jsonl(data / "sft_domain_train.jsonl"):
        assert " - " in row["messages"][0]["content"] and solve(row["messages"][0]["content"]) == row["messages"][1]["content"]
    for row in read_jsonl(data / "sft_train.jsonl")[:50]:
        user, reply = row["messages"]
        assert (user["role"], reply["role"]) == ("user", "assistant")
        assert solve(user["content"]) == reply["content"]
    for row in read_jsonl(data / "preference_train.jsonl") + read_jsonl(data / "preference_rm_train.jsonl"):
        assert solve(row["prompt"]) == row["chosen"] != row["rejected"]
    for row in read_jsonl(data / "prompts_val.jsonl"):
        assert solve(row["prompt"]) == row["answer"]


def test_no_kind_trains_on_a_held_out_problem(assets):
    """Every kind's val split is the same held-out problems, and no train split has one."""

    def questions(stem: str, split: str) -> set[str]:
        rows = read_jsonl(assets / "data" / f"{stem}_{split}.jsonl")
        found = {row["messages"][0]["content"] if "messages" in row else row["prompt"] for row in rows}
        assert len(found) == len(rows)  # no duplicates within a split
        return found

    stems = ("sft", "preference", "prompts", "preference_rm")
    val = questions("sft", "val")
    assert all(questions(stem, "val") == val for stem in stems)
    assert questions("sft_domain", "val") == {q for q in val if " - " in q}
    assert not any(questions(stem, "train") & val for stem in (*stems, "sft_domain"))
