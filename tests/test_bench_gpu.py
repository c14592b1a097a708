"""bench/gpu.py end to end on CPU (`--dry-run`: the demo's tiny shape, fp32), so it cannot rot
before a GPU machine runs it: its phases in order within their caps, the GPU test subset
collected, both sides measuring every kind, each figure on disk the moment it is measured (a
kill keeps it), and a last line saying what ran and what did not."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from alignflow import PROJECT_ROOT
from conftest import GPU_FAMILY_TESTS, GPU_TESTS

KINDS = ("sft", "reference", "dpo", "generation")
ENV = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}


def gpu_bench(*args: str, out) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--dry-run", "--out", str(out), *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert (out / "gpu.log").read_text() == done.stdout  # everything printed is in the log
    return done


@pytest.mark.slow
def test_the_gpu_bench_runs_end_to_end_on_cpu(tmp_path):
    out = gpu_bench(out=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "budget 540 s; phases (cap s): environment 60, bench 330, stage tests 100, family tests 50; figures as measured: " + str(
        tmp_path / "figures.jsonl"
    )
    assert [line for line in lines if line.startswith("== ")] == [
        "== environment (cap 60 s): the wheels' install (--install), versions, the device",
        "== bench (cap 330 s): the shape's inputs, then ours and TRL's SFT, reference pass, DPO and generation",
        "== stage tests (cap 100 s): pytest -m gpu, the stage tests",
        "== family tests (cap 50 s): pytest -m gpu, the family tests (one per model family)",
    ]
    said = "\n".join(lines)
    collected = {which: int(re.search(rf"^GPU {which}: (\d+) tests collected$", said, re.M).group(1)) for which in ("stage tests", "family tests")}
    stage_tests = collected["stage tests"]  # every listed test found (a missing one is named and fails the phase), each case counted
    assert stage_tests >= len(GPU_TESTS) - len(GPU_FAMILY_TESTS) and collected["family tests"] > len(GPU_FAMILY_TESTS)
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] and line.split()[0] in KINDS}
    for kind in KINDS:  # ours and TRL's tokens/s, their ratio, both TFLOP/s; no MFU on CPU; both peaks
        ours, trl, ratio, ours_tflops, ours_mfu, trl_tflops, trl_mfu, ours_gib, trl_gib = rows[kind]
        assert min(float(v.replace(",", "")) for v in (ours, trl, ratio, ours_tflops, trl_tflops, ours_gib, trl_gib)) > 0, rows[kind]
        assert ours_mfu == trl_mfu == "-"
    figures = [json.loads(line) for line in (tmp_path / "figures.jsonl").read_text().splitlines()]
    assert sorted((r["side"], r["kind"]) for r in figures) == sorted((side, kind) for side in ("ours", "trl") for kind in KINDS)
    assert any("TRL settings:" in line and "'gradient_checkpointing': False" in line for line in lines)
    assert "issue 22's bars (a CPU dry run: not judged)" in out.stdout
    assert "SFT peak within 15% of the estimate" in out.stdout and "measured / estimated" in out.stdout
    last = lines[-1]
    assert (
        last.startswith("ran: environment (CPU; ") and "bench (ours: sft, generation, reference, dpo; TRL: sft, reference, dpo, generation; " in last
    )
    assert f"stage tests ({stage_tests} collected;" in last and last.endswith("| did not run: nothing")


def test_a_phase_stops_at_its_cap_and_the_budget_leaves_out_what_has_no_time(tmp_path):
    """The bench capped at 3 s (its inputs' imports alone take longer) is stopped there, with
    what it started; a 7 s budget then leaves the family tests no time; unchosen phases are said."""
    out = gpu_bench("--only", "bench,family tests", "--cap", "bench=3", "--budget-s", "7", out=tmp_path)
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.splitlines()[-1] == (
        "ran: nothing | did not run: bench (stopped at its cap, 3 s: what it measured before is kept); "
        "family tests (no time left in the 7 s budget); environment (not chosen); stage tests (not chosen)"
    )


@pytest.mark.slow
def test_a_figure_is_on_disk_the_moment_it_is_measured(tmp_path):
    """SIGKILL the whole command as soon as its first figure is there: the figure stays, whole."""
    figures = tmp_path / "figures.jsonl"
    bench = subprocess.Popen(
        [sys.executable, "bench/gpu.py", "--dry-run", "--only", "bench", "--out", str(tmp_path)],
        cwd=PROJECT_ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (figures.exists() and figures.read_text().endswith("\n")):
            assert bench.poll() is None and time.monotonic() < deadline, "no figure before the end"
            time.sleep(0.05)
    finally:
        os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
    (first, *_) = [json.loads(line) for line in figures.read_text().splitlines()]
    assert first["side"] == "ours" and first["kind"] == "sft" and first["tokens_per_s"] > 0
