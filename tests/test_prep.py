"""The prep stage on the demo task and on small hand-written inputs of every format."""

import json
import re
import time
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from alignflow.orchestrator import demo
from alignflow.orchestrator.config.schema import PrepConfig
from alignflow.job.data.packing import pack_bfd
from alignflow.job.data.tokenize import ChatEncoder, load_tokenizer
from alignflow.job.stages import prep

EOS = demo.EOS
SCHEMAS = {
    "sft": {
        "input_ids": "list<element: int32>",
        "loss_mask": "list<element: int8>",
        "cu_seqlens": "list<element: int32>",
        "sample_ids": "list<element: int64>",
    },
    "preference": {
        "sample_id": "int64",
        "prompt_length": "int32",
        "chosen_input_ids": "list<element: int32>",
        "chosen_loss_mask": "list<element: int8>",
        "rejected_input_ids": "list<element: int32>",
        "rejected_loss_mask": "list<element: int8>",
    },
    "prompts": {"sample_id": "int64", "prompt_ids": "list<element: int32>", "prompt": "string", "answer": "string"},
}


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return demo.build(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def tok(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizer")


def spec(train, val=None, **kw):
    return {
        "train": str(train),
        "val": None if val is None else str(val),
        "val_fraction": 0.0,
        "format": "auto",
        "dev_choose_samples": None,
        "answer_key": "answer",
        **kw,
    }


def make_cfg(assets, sft=None, preference=None, prompts=None, chat_template=None, prep_=None, **data):
    """The prep section typed by its schema, in chunks of 64 rows so that every test crosses
    chunk boundaries; prep_ overrides some of it."""
    specs = {"sft": sft, "preference": preference, "prompts": prompts}
    return OmegaConf.create(
        {
            "prep": OmegaConf.merge(OmegaConf.structured(PrepConfig), {"chunk_rows": 64}, prep_ or {}),
            "data": {"seq_length": 128, "max_prompt_length": 64, "truncation": "keep_start", "packing": True, "seed": 0, **data, **specs},
            "model": {"tokenizer": str(assets / "tokenizer"), "chat_template": chat_template},
        }
    )


def read(out, kind, split="train"):
    files = sorted((out / kind).glob(f"{split}-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).to_pylist()


def masked(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m])


def docs(row):
    """(sample_id, input_ids, loss_mask) of each document of an SFT row."""
    cu = row["cu_seqlens"]
    return [(sid, row["input_ids"][a:b], row["loss_mask"][a:b]) for sid, a, b in zip(row["sample_ids"], cu, cu[1:])]


def write_jsonl(path, rows):
    """Rows as lines: a dict as JSON, a str as UTF-8, bytes as they are."""
    path.write_bytes(b"".join((r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()) + b"\n" for r in rows))
    return path


def run_prep(cfg, tmp_path, name="out"):
    out = tmp_path / name
    return prep.run(cfg, {}, str(out)), out


# ---------------------------------------------------------------- the demo task


@pytest.fixture(scope="module")
def demo_run(assets, tmp_path_factory):
    d = assets / "data"
    cfg = make_cfg(
        assets,
        sft=spec(d / "sft_train.jsonl", d / "sft_val.jsonl"),
        preference=spec(d / "preference_train.jsonl", d / "preference_val.jsonl"),
        prompts=spec(d / "prompts_train.jsonl", d / "prompts_val.jsonl"),
    )
    return run_prep(cfg, tmp_path_factory.mktemp("prep"))


def test_schemas_and_layout(demo_run):
    _, out = demo_run
    for kind, schema in SCHEMAS.items():
        for split in ("train", "val"):
            table = pq.read_table(out / kind / f"{split}-00000.parquet")
            assert {f.name: str(f.type) for f in table.schema} == schema
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["tokenizer"] == {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert meta["sft"]["format"] == "messages" and meta["sft"]["packed"] is True
    assert meta["preference"]["format"] == "preference" and meta["prompts"]["format"] == "prompt_answer"
    train = meta["sft"]["splits"]["train"]
    assert train["rows_in"] == train["rows"] == 2000 and train["skipped_rows"] == train["truncated_rows"] == 0


def test_sft_loss_mask_is_exactly_the_answer(demo_run, assets, tok):
    metrics, out = demo_run
    source = [json.loads(line) for line in (assets / "data" / "sft_train.jsonl").read_text().splitlines()]
    rows, seen = read(out, "sft"), []
    for row in rows:
        cu = row["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == len(row["input_ids"]) == len(row["loss_mask"]) <= 128
        assert all(a < b for a, b in zip(cu, cu[1:])) and len(cu) == len(row["sample_ids"]) + 1
        for sid, ids, mask in docs(row):
            user, reply = source[sid]["messages"]
            assert masked(tok, ids, mask) == reply["content"] + EOS
            assert tok.decode(ids) == demo.render_chat(source[sid]["messages"])
            seen.append(sid)
    assert sorted(seen) == list(range(2000))
    assert metrics["sft.train.loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert metrics["sft.train.tokens"] == sum(len(r["input_ids"]) for r in rows)


def test_packing_efficiency_is_reported(demo_run):
    metrics, out = demo_run
    for split in ("train", "val"):
        packs, tokens = metrics[f"sft.{split}.packs"], metrics[f"sft.{split}.tokens"]
        assert packs == len(read(out, "sft", split)) >= metrics[f"sft.{split}.packs_lower_bound"] == -(-tokens // 128)
        assert metrics[f"sft.{split}.packing_efficiency"] == pytest.approx(tokens / (packs * 128))
        assert 0.9 < metrics[f"sft.{split}.packing_efficiency"] <= metrics[f"sft.{split}.efficiency_upper_bound"]
    json.dumps(metrics)


def test_preference_pairs(demo_run, tok):
    _, out = demo_run
    rows = read(out, "preference")
    assert [r["sample_id"] for r in rows] == list(range(1000))
    for r in rows[:100]:
        p = r["prompt_length"]
        assert r["chosen_input_ids"][:p] == r["rejected_input_ids"][:p]
        assert tok.decode(r["chosen_input_ids"][:p]).endswith("<|assistant|>\n")
        assert not any(r["chosen_loss_mask"][:p]) and not any(r["rejected_loss_mask"][:p])
        chosen, rejected = masked(tok, r["chosen_input_ids"], r["chosen_loss_mask"]), masked(tok, r["rejected_input_ids"], r["rejected_loss_mask"])
        assert chosen.endswith(EOS) and rejected.endswith(EOS) and chosen != rejected


def test_prompts(demo_run, assets, tok):
    _, out = demo_run
    source = [json.loads(line) for line in (assets / "data" / "prompts_val.jsonl").read_text().splitlines()]
    for r in read(out, "prompts", "val"):
        assert r["prompt"] == tok.decode(r["prompt_ids"])
        assert r["prompt"] == demo.render_chat([{"role": "user", "content": source[r["sample_id"]]["prompt"]}], True)
        assert r["answer"] == source[r["sample_id"]]["answer"]


def test_unpacked_rows_hold_one_document_and_dev_choose_samples(assets, tmp_path):
    d = assets / "data"
    cfg = make_cfg(assets, sft=spec(d / "sft_train.jsonl", dev_choose_samples=50), packing=False)
    metrics, out = run_prep(cfg, tmp_path)
    rows = read(out, "sft")
    assert metrics["sft.train.rows_in"] == metrics["sft.train.rows"] == len(rows) == 50
    assert "sft.train.packs" not in metrics and "sft.val.rows" not in metrics
    assert [r["sample_ids"] for r in rows] == [[i] for i in range(50)]
    assert all(r["cu_seqlens"] == [0, len(r["input_ids"])] for r in rows)


# ---------------------------------------------------------------- formats


def test_multi_turn_messages_train_every_assistant_turn(assets, tok, tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    f = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])
    _, out = run_prep(make_cfg(assets, sft=spec(f, format="messages"), packing=False), tmp_path)
    (row,) = read(out, "sft")
    assert masked(tok, row["input_ids"], row["loss_mask"]) == f"2{EOS}4{EOS}"
    assert tok.decode(row["input_ids"]) == demo.render_chat(chat)


SFT_CASES = {
    "prompt_completion": {"prompt": "What is 3 + 4?", "completion": "7"},
    "prompt_completion_lists": {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "completion": [{"role": "assistant", "content": "7"}]},
    "input_output": {"input": "What is 3 + 4?", "output": "7"},
    "messages": {"messages": [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}]},
}


@pytest.mark.parametrize("case", SFT_CASES)
def test_sft_formats(assets, tok, tmp_path, case):
    f = write_jsonl(tmp_path / "d.jsonl", [SFT_CASES[case]] * 3)
    metrics, out = run_prep(make_cfg(assets, sft=spec(f)), tmp_path)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["sft"]["format"] == case.removesuffix("_lists")
    (row,) = read(out, "sft")
    assert [masked(tok, ids, mask) for _, ids, mask in docs(row)] == [f"7{EOS}"] * 3
    assert tok.decode(docs(row)[0][1]) == f"{demo.BOS}<|user|>\nWhat is 3 + 4?\n<|assistant|>\n7{EOS}"


PREFERENCE_CASES = {
    "preference": {"prompt": "What is 3 + 4?", "chosen": "7", "rejected": "8"},
    "preference_lists": {
        "prompt": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 3 + 4?"}],
        "chosen": [{"role": "assistant", "content": "7"}],
        "rejected": [{"role": "assistant", "content": "8"}],
    },
    "nemo_preference": {"prompt": "What is 3 + 4?", "chosen_response": "7", "rejected_response": "8"},
}


@pytest.mark.parametrize("case", PREFERENCE_CASES)
def test_preference_formats(assets, tok, tmp_path, case):
    f = write_jsonl(tmp_path / "p.jsonl", [PREFERENCE_CASES[case]])
    _, out = run_prep(make_cfg(assets, preference=spec(f)), tmp_path)
    (r,) = read(out, "preference")
    p = r["prompt_length"]
    assert tok.decode(r["chosen_input_ids"][:p]).endswith("What is 3 + 4?\n<|assistant|>\n")
    assert masked(tok, r["chosen_input_ids"], r["chosen_loss_mask"]) == f"7{EOS}"
    assert masked(tok, r["rejected_input_ids"], r["rejected_loss_mask"]) == f"8{EOS}"
    if case == "preference_lists":
        assert "<|system|>\nBe exact." in tok.decode(r["chosen_input_ids"][:p])


def test_prompt_answer_with_custom_answer_key(assets, tmp_path):
    rows = [{"prompt": "What is 3 + 4?", "solution": 7}, {"prompt": [{"role": "user", "content": "What is 1 - 2?"}], "solution": "-1"}]
    f = write_jsonl(tmp_path / "q.jsonl", rows)
    _, out = run_prep(make_cfg(assets, prompts=spec(f, answer_key="solution")), tmp_path)
    rows = read(out, "prompts")
    assert [r["answer"] for r in rows] == ["7", "-1"]
    assert rows[1]["prompt"].endswith("What is 1 - 2?\n<|assistant|>\n")


def test_file_types_directories_and_globs(assets, tok, tmp_path):
    row = SFT_CASES["messages"] | {"extra": 1}
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", [row])
    (src / "b.json").write_text(json.dumps([row]))  # one JSON array
    table = pa.Table.from_pylist([row])
    pq.write_table(table, src / "c.parquet")
    with pa.ipc.new_file(src / "d.arrow", table.schema) as w:
        w.write_table(table)
    with pa.ipc.new_stream(src / "e.arrow", table.schema) as w:  # as HF datasets writes .arrow
        w.write_table(table)
    (src / "notes.txt").write_text("ignored")
    for name, uri, n in (("dir", src, 5), ("glob", f"{src}/*.arrow", 2), ("url", f"file://{src}/c.parquet", 1)):
        metrics, out = run_prep(make_cfg(assets, sft=spec(uri), packing=False), tmp_path, name)
        assert [masked(tok, r["input_ids"], r["loss_mask"]) for r in read(out, "sft")] == [f"7{EOS}"] * n
        assert [r["sample_ids"] for r in read(out, "sft")] == [[i] for i in range(n)]


def test_hf_datasets_on_disk(assets, tmp_path):
    """What HF `datasets` writes (save_to_disk in several shards, a DatasetDict's split, the
    load_dataset cache) is read with pyarrow and gives the rows of the jsonl it came from."""
    from datasets import Dataset, DatasetDict, load_dataset

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]} for i in range(30)]
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    load_dataset("json", data_files=str(src), cache_dir=str(tmp_path / "cache"), split="train")
    expected = read(run_prep(make_cfg(assets, sft=spec(src), packing=False, prep_={"chunk_rows": 4}), tmp_path, "jsonl")[1], "sft")
    assert [r["sample_ids"] for r in expected] == [[i] for i in range(30)]
    for name, uri in (("saved", tmp_path / "saved"), ("split", tmp_path / "dict" / "train"), ("cache", f"{tmp_path}/cache/**/json-train*.arrow")):
        _, out = run_prep(make_cfg(assets, sft=spec(uri), packing=False, prep_={"chunk_rows": 4}), tmp_path, name)
        assert read(out, "sft") == expected, name
    with pytest.raises(ValueError, match="holds a DatasetDict .* name one of its splits"):
        run_prep(make_cfg(assets, sft=spec(tmp_path / "dict")), tmp_path, "dict")


def test_mixed_formats_in_one_source_are_bad_rows(assets, tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [SFT_CASES["messages"], SFT_CASES["input_output"]])
    with pytest.raises(ValueError, match="line 2: field 'messages': missing"):
        run_prep(make_cfg(assets, sft=spec(f)), tmp_path)


# ---------------------------------------------------------------- bad rows


GOOD = json.dumps(SFT_CASES["messages"])
BAD_ROWS = {
    "not a list": ('{"messages": "hello"}', "field 'messages': expected a non-empty list of {role, content}, got str 'hello'"),
    "invalid json": ('{"messages": [', "invalid JSON"),
    "missing field": ('{"chat": []}', "field 'messages': missing"),
    "wrong content type": ('{"messages": [{"role": "user", "content": 42}]}', "field 'messages[0].content': expected a string, got int 42"),
    "missing role": ('{"messages": [{"content": "hi"}]}', "field 'messages[0].role': expected a string, got nothing (missing or null)"),
    "not utf-8": (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not UTF-8: byte 0xe9 at column 47"),
    "empty assistant": (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}',
        "field 'messages': empty assistant content",
    ),
    "no assistant": ('{"messages": [{"role": "user", "content": "hi"}]}', "field 'messages': no assistant turn"),
    "not an object": ("[1, 2]", "expected a JSON object"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_row_raises_with_file_line_and_field(assets, tmp_path, case):
    line, message = BAD_ROWS[case]
    f = write_jsonl(tmp_path / "sft.jsonl", [GOOD, "", line, GOOD])  # the blank line still counts
    with pytest.raises(ValueError) as err:
        run_prep(make_cfg(assets, sft=spec(f)), tmp_path)
    assert str(err.value).startswith(f"data.sft.train: {f} line 3: ")
    assert message in str(err.value)


def test_bad_parquet_row_names_its_row(assets, tmp_path):
    f = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "chosen": "1", "rejected": "2"}, {"prompt": "b", "chosen": "", "rejected": "2"}]), f)
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "a", "chosen": "1", "rejected": "2"}])
    with pytest.raises(ValueError, match=rf"^data\.preference\.val: {re.escape(str(f))} row 2: field 'chosen': empty"):
        run_prep(make_cfg(assets, preference=spec(good, val=f)), tmp_path)


def test_line_numbers_survive_read_blocks_and_parts(assets, tmp_path, monkeypatch):
    from alignflow.job.data import readers

    monkeypatch.setattr(readers, "READ_BYTES", 7)  # lines cut across reads, blank lines inside a read
    monkeypatch.setattr(readers, "PART_LINES", 2)
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join([GOOD, "", GOOD, "  ", GOOD, BAD_ROWS["missing field"][0], GOOD]))  # no final newline
    with pytest.raises(ValueError, match=rf"^data\.sft\.train: {re.escape(str(f))} line 6: field 'messages': missing"):
        run_prep(make_cfg(assets, sft=spec(f), prep_={"chunk_rows": 2}), tmp_path)
    metrics, out = run_prep(make_cfg(assets, sft=spec(f), packing=False, prep_={"chunk_rows": 2, "skip_bad_rows": True}), tmp_path)
    assert [r["sample_ids"] for r in read(out, "sft")] == [[0], [1], [2], [4]] and metrics["sft.train.skipped_rows"] == 1


def test_a_data_set_with_no_usable_row_fails_in_prep_and_commits_nothing(assets, tmp_path):
    """seq_length so short that no response token fits: the error names the key, the file and
    why, here and not later in sft (an empty output is never written)."""
    f = write_jsonl(tmp_path / "sft.jsonl", [GOOD] * 5)
    with pytest.raises(
        ValueError,
        match=rf"^data\.sft\.train: no usable row in {re.escape(str(f))}: 5 read, 0 skipped as bad, "
        r"5 with nothing left to train on within data\.seq_length=4",
    ):
        run_prep(make_cfg(assets, sft=spec(f), seq_length=4, max_prompt_length=2), tmp_path)
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_skip_bad_rows_counts_them(assets, tok, tmp_path):
    lines = [GOOD] + [line for line, _ in BAD_ROWS.values()] + [GOOD]
    f = write_jsonl(tmp_path / "sft.jsonl", lines)
    metrics, out = run_prep(make_cfg(assets, sft=spec(f), prep_={"skip_bad_rows": True}, packing=False), tmp_path)
    bad = len(BAD_ROWS)
    assert (metrics["sft.train.rows_in"], metrics["sft.train.rows"], metrics["sft.train.skipped_rows"]) == (bad + 2, 2, bad)
    assert [r["sample_ids"] for r in read(out, "sft")] == [[0], [bad + 1]]


# ---------------------------------------------------------------- truncation


def long_chat():
    return {"messages": [{"role": "user", "content": "What is " + "1 + " * 40 + "1?"}, {"role": "assistant", "content": "41"}]}


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_sft_truncation(assets, tok, tmp_path, mode):
    f = write_jsonl(tmp_path / "t.jsonl", [long_chat(), SFT_CASES["messages"]])
    full = tok(demo.render_chat(long_chat()["messages"]), add_special_tokens=False)["input_ids"]
    assert len(full) > 32
    metrics, out = run_prep(make_cfg(assets, sft=spec(f), packing=False, seq_length=32, truncation=mode), tmp_path)
    rows = read(out, "sft")
    assert metrics["sft.train.truncated_rows"] == 1
    if mode == "keep_start":  # the answer is cut off: nothing left to train on
        assert metrics["sft.train.no_loss_rows"] == 1 and [r["sample_ids"] for r in rows] == [[1]]
    else:
        assert metrics["sft.train.no_loss_rows"] == 0 and rows[0]["input_ids"] == full[-32:]
        assert masked(tok, rows[0]["input_ids"], rows[0]["loss_mask"]) == f"41{EOS}"


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_prompt_truncation(assets, tok, tmp_path, mode):
    question = long_chat()["messages"][0]["content"]
    write_jsonl(tmp_path / "q.jsonl", [{"prompt": question, "answer": "41"}])
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": question, "chosen": "41", "rejected": "40"}])
    cfg = make_cfg(
        assets, prompts=spec(tmp_path / "q.jsonl"), preference=spec(tmp_path / "p.jsonl"), max_prompt_length=16, seq_length=20, truncation=mode
    )
    metrics, out = run_prep(cfg, tmp_path)
    assert metrics["prompts.train.truncated_rows"] == metrics["preference.train.truncated_rows"] == 1
    (q,), (p,) = read(out, "prompts"), read(out, "preference")
    assert len(q["prompt_ids"]) == p["prompt_length"] == 16
    assert q["prompt_ids"] == p["chosen_input_ids"][:16]
    assert q["prompt"] == tok.decode(q["prompt_ids"])
    if mode == "keep_end":
        assert q["prompt"].endswith("1?\n<|assistant|>\n")
    else:
        assert q["prompt"].startswith(f"{demo.BOS}<|user|>\nWhat is 1 +")
    assert len(p["chosen_input_ids"]) <= 20 and masked(tok, p["chosen_input_ids"], p["chosen_loss_mask"]) == f"41{EOS}"


# ---------------------------------------------------------------- splits, shards, config


def test_val_fraction_split_is_deterministic(assets, tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [SFT_CASES["input_output"]] * 40)

    def split_ids(seed, name):
        cfg = make_cfg(assets, sft=spec(f, val_fraction=0.25), packing=False, seed=seed)
        metrics, out = run_prep(cfg, tmp_path, name)
        assert (metrics["sft.train.rows"], metrics["sft.val.rows"]) == (30, 10)
        return [sorted(i for r in read(out, "sft", s) for i in r["sample_ids"]) for s in ("train", "val")]

    train, val = split_ids(0, "a")
    assert sorted(train + val) == list(range(40))
    assert split_ids(0, "b") == [train, val]
    assert split_ids(1, "c") != [train, val]


def test_shards(assets, tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [SFT_CASES["input_output"]] * 20)
    _, out = run_prep(make_cfg(assets, sft=spec(f), packing=False, prep_={"rows_per_shard": 7}), tmp_path)
    assert sorted(p.name for p in (out / "sft").iterdir()) == [f"train-0000{i}.parquet" for i in range(3)]
    assert len(read(out, "sft")) == 20


def test_chat_template_override(assets, tok, tmp_path):
    template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    f = write_jsonl(tmp_path / "s.jsonl", [SFT_CASES["messages"]])
    _, out = run_prep(make_cfg(assets, sft=spec(f), packing=False, chat_template=template), tmp_path)
    (row,) = read(out, "sft")
    assert tok.decode(row["input_ids"]) == f"[user] What is 3 + 4?\n[assistant] 7{EOS}\n"
    assert masked(tok, row["input_ids"], row["loss_mask"]) == f"7{EOS}\n"


# Templates in the shapes of real ones: Llama 3's headers, ChatML with a default system turn, and a
# template that reads a special token and strips contents.
TEMPLATES = [
    "{{- bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'].strip() + eos_token }}{% else %}"
    "{{ '[' + m['role'] | upper + '] ' + m['content'] + ' ' }}{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_render_equals_apply_chat_template(assets, template):
    """ChatEncoder renders through the compiled template directly: the text must be what
    transformers' own apply_chat_template gives."""
    tokenizer = load_tokenizer(str(assets / "tokenizer"), template)
    chats = [
        [{"role": "user", "content": " What is 3 + 4? "}, {"role": "assistant", "content": " 7 "}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ]
    for generation_prompt in (False, True):
        assert ChatEncoder(tokenizer).render(chats, generation_prompt) == tokenizer.apply_chat_template(
            chats, tokenize=False, add_generation_prompt=generation_prompt
        )


def test_config_errors(assets, tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [{"text": "hello"}])
    with pytest.raises(ValueError, match=r"data\.sft\.train: .*line 1: cannot detect the format from keys \['text'\]"):
        run_prep(make_cfg(assets, sft=spec(f)), tmp_path)
    with pytest.raises(ValueError, match="format 'preference' is not a sft format"):
        run_prep(make_cfg(assets, sft=spec(f, format="preference")), tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        run_prep(make_cfg(assets, sft=spec(tmp_path / "missing.jsonl")), tmp_path)


def test_any_fsspec_filesystem(assets, tok):
    """memory:// stands in for s3://: remote tokenizer, remote inputs, remote output."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in (assets / "tokenizer").iterdir():
        fs.pipe(f"memory://af/tokenizer/{p.name}", p.read_bytes())
    fs.pipe("memory://af/data/part-0.jsonl", (json.dumps(SFT_CASES["messages"]) + "\n").encode())
    fs.pipe("memory://af/data/part-1.jsonl", b'{"messages": 1}\n')
    cfg = make_cfg(assets, sft=spec("memory://af/data"), packing=False)
    cfg.model.tokenizer = "memory://af/tokenizer"
    with pytest.raises(ValueError, match="data.sft.train: memory:///af/data/part-1.jsonl line 1: field 'messages'"):
        prep.run(cfg, {}, "memory://af/out")
    cfg.prep.skip_bad_rows = True
    metrics = prep.run(cfg, {}, "memory://af/out")
    assert (metrics["sft.train.rows"], metrics["sft.train.skipped_rows"]) == (1, 1)
    with fs.open("memory://af/out/sft/train-00000.parquet", "rb") as f:
        (row,) = pq.read_table(f).to_pylist()
    assert masked(tok, row["input_ids"], row["loss_mask"]) == f"7{EOS}"
    assert json.loads(fs.cat("memory://af/out/metadata.json"))["sft"]["splits"]["train"]["rows"] == 1


def test_broken_template_is_never_skipped(assets, tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [SFT_CASES["messages"]])
    cfg = make_cfg(assets, sft=spec(f), prep_={"skip_bad_rows": True}, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="line 1: chat template does not parse"):
        run_prep(cfg, tmp_path)
    cfg.model.tokenizer = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model.tokenizer"):
        run_prep(cfg, tmp_path)


# ---------------------------------------------------------------- data-set scale: chunks, ranks, progress


def write_chats(path, n, seed=0, bad=None):
    """n chats of lognormal length made of the demo's words; line `bad` (1-based) malformed."""
    rng = np.random.default_rng(seed)
    words = np.array(" ".join(demo.SENTENCES).split())
    lines = []
    for i in range(1, n + 1):
        user, reply = (" ".join(words[rng.integers(0, len(words), k)]) for k in np.clip(rng.lognormal(2.5, 0.8, 2), 1, 300).astype(int))
        chat = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        lines.append('{"messages": [{"role": "user", "content": 7}]}' if i == bad else json.dumps({"messages": chat}))
    path.write_text("\n".join(lines) + "\n")
    return path


def files_of(out):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != "_SUCCESS.json"}


def test_chunk_size_changes_nothing(assets, tmp_path):
    f = write_jsonl(tmp_path / "s.jsonl", [GOOD, BAD_ROWS["not a list"][0], *[json.dumps(long_chat())] * 5, GOOD, GOOD] * 7)
    d = assets / "data"
    outputs = []
    for chunk_rows in (10000, 3, 1):
        cfg = make_cfg(
            assets,
            sft=spec(f, val_fraction=0.2),
            preference=spec(d / "preference_train.jsonl", dev_choose_samples=50),
            prompts=spec(d / "prompts_train.jsonl", d / "prompts_val.jsonl", dev_choose_samples=40),
            seq_length=48,
            prep_={"skip_bad_rows": True, "chunk_rows": chunk_rows, "rows_per_shard": 4},
        )
        outputs.append(files_of(run_prep(cfg, tmp_path, f"c{chunk_rows}")[1]))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len([p for p in outputs[0] if p.startswith("sft/train-")]) > 1 and not any(p.startswith("_prep") for p in outputs[0])


def test_packed_rows_are_best_fit_decreasing_over_the_split_then_shuffled(assets, tmp_path):
    """The in-memory prep's packing, computed here from the unpacked documents."""
    f = write_chats(tmp_path / "c.jsonl", 600)
    docs = [r for r in read(run_prep(make_cfg(assets, sft=spec(f), packing=False, seed=3), tmp_path, "docs")[1], "sft")]
    bins = pack_bfd([len(r["input_ids"]) for r in docs], 128)
    expected = [bins[i] for i in np.random.default_rng(3).permutation(len(bins))]
    rows = read(run_prep(make_cfg(assets, sft=spec(f), seed=3, prep_={"chunk_rows": 50, "rows_per_shard": 40}), tmp_path)[1], "sft")
    assert len(rows) == len(expected) > 100
    for row, b in zip(rows, expected):
        assert row["input_ids"] == [t for i in b for t in docs[i]["input_ids"]]
        assert row["loss_mask"] == [m for i in b for m in docs[i]["loss_mask"]]
        assert row["sample_ids"] == [docs[i]["sample_ids"][0] for i in b]
        assert row["cu_seqlens"] == np.cumsum([0] + [len(docs[i]["input_ids"]) for i in b]).tolist()


def test_a_bad_row_deep_in_a_large_file_is_skipped_and_counted(assets, tmp_path):
    f = write_chats(tmp_path / "big.jsonl", 20_000, bad=17_321)
    metrics, out = run_prep(make_cfg(assets, sft=spec(f), seq_length=2048, prep_={"skip_bad_rows": True, "chunk_rows": 1000}), tmp_path)
    assert (metrics["sft.train.rows_in"], metrics["sft.train.skipped_rows"], metrics["sft.train.rows"]) == (20_000, 1, 19_999)
    assert 17_320 not in {i for r in read(out, "sft") for i in r["sample_ids"]}


def prep_stage(overrides):
    from alignflow.orchestrator.config.compose import build

    return build("demo", overrides)["prep"]


@pytest.mark.slow
def test_two_ranks_write_the_bytes_one_rank_does_and_report_progress(base_overrides, tmp_path):
    """Through the local launcher, as a pipeline runs it: the same fingerprint and the same
    bytes from 1 rank and from 2 (with another chunk size); the progress lines of rank 0 reach
    the caller's log (Prefect's, in a flow) while the job runs."""
    from alignflow.orchestrator.runner import run_stage
    from alignflow.job.worker import job_record

    f = write_chats(tmp_path / "chats.jsonl", 24_000)
    data = [f"data.sft.train={f}", "data.sft.val=null", "data.sft.val_fraction=0.05", "prep.rows_per_shard=300"]
    one = run_stage(prep_stage([*base_overrides, *data]), {}, log=lambda line: None)
    lines = []
    two = run_stage(
        prep_stage(
            [
                *base_overrides,
                *data,
                f"store.root={tmp_path / 'store2'}",
                "prep.resources.tasks_per_node=2",
                "prep.chunk_rows=1500",
                "prep.progress_interval_s=0.5",
            ]
        ),
        {},
        log=lambda line: lines.append((time.monotonic(), line)),
    )
    held = ("wall_s", "device_hours", "devices", "hardware")  # how long it held how many cores, threads a rank: not what it wrote
    assert two.fingerprint == one.fingerprint and {k: v for k, v in two.metrics.items() if k not in held} == {
        k: v for k, v in one.metrics.items() if k not in held
    }
    out_one, out_two = (tmp_path / store / "prep" / one.fingerprint for store in ("store", "store2"))
    assert files_of(out_two) == files_of(out_one)
    assert len([p for p in files_of(out_one) if p.startswith("sft/")]) > 4

    progress = [(at, record) for at, line in lines if (record := job_record(line)) and "percent" in record.get("event", {})]
    done = [record["event"]["percent"] for _, record in progress]
    assert len(progress) >= 3 and done == sorted(done) and done[-1] == 100.0, lines
    assert all(r["rank"] == 0 and "rows read" in r["message"] and "rows/s" in r["message"] and "ETA" in r["message"] for _, r in progress)
    stamps = [datetime.strptime(record["time"], "%Y-%m-%d %H:%M:%S,%f") for _, record in progress]
    assert max((b - a).total_seconds() for a, b in zip(stamps, stamps[1:])) < 10
    completed = next(at for at, line in lines if line.endswith(": COMPLETED"))
    assert progress[0][0] < completed  # forwarded while the job ran, not after


@pytest.mark.slow
def test_a_bad_row_deep_in_a_large_file_on_another_rank_fails_the_stage_and_commits_nothing(base_overrides, tmp_path):
    from alignflow.orchestrator.launch import StageFailed
    from alignflow.orchestrator.runner import run_stage

    f = write_chats(tmp_path / "big.jsonl", 20_000, bad=13_457)  # chunk 13 of 1000 rows: rank 1's
    stage = prep_stage([*base_overrides, f"data.sft.train={f}", "data.sft.val=null", "prep.resources.tasks_per_node=2", "prep.chunk_rows=1000"])
    with pytest.raises(
        StageFailed, match=rf"data\.sft\.train: {re.escape(str(f))} line 13457: field 'messages\[0\]\.content': expected a string, got int 7"
    ):
        run_stage(stage, {}, log=lambda line: None)
    assert not list((tmp_path / "store" / "prep").glob("*/_SUCCESS.json"))
