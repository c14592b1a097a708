"""Each bench script end to end in its tiny mode (`--tiny`), so none can rot before someone
next runs it at full size: it exits 0 and prints its figures, ours and the peer's where it has
one, each a positive number. (bench/gpu.py's dry run is tests/test_bench_gpu.py.)"""

import os
import re
import subprocess
import sys

import pytest

from alignflow import PROJECT_ROOT

ENV = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}


def bench(name: str, *args: str) -> str:
    """The script's stdout after a tiny run that succeeded."""
    done = subprocess.run(
        [sys.executable, f"bench/{name}.py", "--tiny", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600, env=ENV
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def table(out: str, labels: list[str], columns: int) -> list[tuple[str, list[float]]]:
    """(label, its `columns` numbers) of each line that starts with one of `labels` followed by
    that many numbers (thousands' commas, a unit 'M' or '%' dropped), in printed order."""
    rows = []
    for line in map(str.strip, out.splitlines()):
        for label in labels:
            words = line.removeprefix(label + " ").split()[:columns]
            if line.startswith(label + " ") and len(words) == columns and all(re.fullmatch(r"[\d,.]+[M%]?", w) for w in words):
                rows.append((label, [float(w.replace(",", "").rstrip("M%")) for w in words]))
    return rows


def line_after(out: str, prefix: str) -> list[float]:
    """The numbers of the line that starts with `prefix`."""
    [line] = [line for line in out.splitlines() if line.startswith(prefix)]
    return [float(w.rstrip("%x,")) for w in line.removeprefix(prefix).replace("(", " ").split() if w.rstrip("%x,").replace(".", "").isdigit()]


ATTENTION_ROW = re.compile(r"^ *(\w+): +([\d.]+) ms +peak (?:RSS \+)? *([\d.]+) MiB +max \|out - sdpa\| ([\d.e+-]+)( +\(forward only\))?$", re.M)


def test_attention():
    out = bench("attention")
    rows = {m[1]: (float(m[2]), float(m[3]), float(m[4]), bool(m[5])) for m in ATTENTION_ROW.finditer(out)}
    assert list(rows)[:3] == ["dense", "sdpa", "flex"], out  # and varlen on CUDA
    for name, (ms, peak_mib, error, _) in rows.items():
        assert ms > 0 and peak_mib >= 0 and error < 1e-4, (name, rows[name])
    assert rows["flex"][3] and not rows["dense"][3]  # FlexAttention has no backward on CPU


def test_packing():
    out = bench("packing")
    ours = ["alignflow pack_bfd", "alignflow pack_bfd + gather", "first-fit-shuffle"]
    trl = ["trl bfd (batch_size=1000)", "trl bfd (batch_size=None)"]
    rows = dict(table(out, ours + trl, 5))
    assert list(rows) == ours + trl, out
    for label, (seconds, peak_mib, packs, efficiency, over_bound) in rows.items():
        assert seconds > 0 and peak_mib >= 0 and packs > 0 and 0 < efficiency <= 1 and over_bound >= 0, (label, rows[label])


@pytest.mark.slow
def test_prep():
    out = bench("prep")
    labels = ["alignflow, 1 rank", "alignflow, 2 ranks", "TRL SFTTrainer, 2 procs"]
    rows = table(out, labels, 9)
    assert [label for label, _ in rows] == [*labels, "alignflow, 2 ranks"], out
    assert [int(numbers[0]) for _, numbers in rows] == [200, 200, 200, 2000]  # N, and ours at 10N
    for label, (_, tokens, packs, load, seconds, rows_per_s, cpu_s, rss_mb, pss_mb) in rows:
        assert min(tokens, packs, seconds, rows_per_s, cpu_s, rss_mb, pss_mb) > 0 and load >= 0, label
    ratio, peak, n, peak_10n, n_10 = line_after(out, "prep: ratio")
    assert ratio > 0 and peak > 0 and peak_10n > 0 and (n, n_10) == (200, 2000)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["llama", "mixtral"])
def test_convert(shape, tmp_path):
    out = bench("convert", str(tmp_path), "--shape", shape)
    assert out.startswith(f"synthetic {shape}: ")
    reads = dict(table(out, ["plain read (page cache)", "plain read of the shards"], 2))
    converted = dict(table(out, ["alignflow convert stage", "the same, with process start-up"], 3))  # s, MB/s, % of the plain read
    assert len(reads) == 2 and len(converted) == 2, out
    assert all(seconds > 0 and mb_per_s > 0 for seconds, mb_per_s in reads.values())
    seconds, mb_per_s, _ = converted["alignflow convert stage"]  # its share of a plain read rounds to 0-5% at this size
    assert seconds > 0 and mb_per_s > 0
    assert converted["the same, with process start-up"][0] > seconds
    peak_mb, of_checkpoint, of_largest, imports_mb = line_after(out, "peak RSS of convert:")
    assert min(peak_mb, of_checkpoint, of_largest, imports_mb) > 0
    assert (tmp_path / "megatron").is_dir()  # a work directory given is kept


@pytest.mark.slow
def test_memory():
    out = bench("memory")
    settings = ["fp32", "bf16", "bf16+distopt", "bf16+distopt+recompute"]
    rows = dict(table(out, settings, 5))
    assert list(rows) == settings, out
    for setting, (params_m, state, theory, activations_mb, peak) in rows.items():
        assert min(params_m, state, theory, activations_mb, peak) > 0 and peak >= state, (setting, rows[setting])
    assert [rows[s][2] for s in settings] == [16, 18, 12, 12]
    assert out.splitlines()[-1].startswith("memory: bf16+distopt ")


@pytest.mark.slow
def test_grpo_vs_trl():
    out = bench("grpo_vs_trl")
    [(_, (batch, ours_tok_s, trl_tok_s, ratio, ours_step_s, trl_step_s, trl_over_ours))] = table(out, ["1m"], 7)
    assert batch == 8 and min(ours_tok_s, trl_tok_s, ratio, ours_step_s, trl_step_s, trl_over_ours) > 0
    generation, step = line_after(out, "ratio: generation")
    assert (generation, step) == (round(ratio, 2), round(trl_over_ours, 2))


@pytest.mark.slow
def test_train_vs_trl():
    out = bench("train_vs_trl")
    kinds = ["SFT", "reference log-probs", "DPO (precomputed ref)"]
    rows = dict(table(out, kinds, 5))
    assert list(rows) == kinds, out  # no row says a side failed
    for kind, (ours, trl, ratio, ours_mb, trl_mb) in rows.items():
        assert min(ours, trl, ratio, ours_mb, trl_mb) > 0, (kind, rows[kind])
    sft, dpo, ref = line_after(out, "ratio: sft")
    assert (sft, ref, dpo) == tuple(round(numbers[2], 2) for numbers in rows.values())


@pytest.mark.slow
def test_startup():
    out = bench("startup")
    rows = {}
    for line in out.splitlines()[1:]:
        ranks, *mode, median, each = line.split()
        rows[" ".join(mode)] = (int(ranks), float(median), float(each))
    assert list(rows) == ["cold", "warm, first", "warm"], out
    assert all(ranks == 1 and median == each > 0 for ranks, median, each in rows.values())
    assert rows["warm"][1] < rows["cold"][1]  # what the warm server is for
