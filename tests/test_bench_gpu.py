"""bench/gpu.py end to end on CPU (`--dry-run`: the demo's tiny shape, fp32), so it cannot rot
before a GPU machine runs it: the GPU test subset is collected, both sides measure every kind."""

import os
import subprocess
import sys

import pytest

from alignflow import PROJECT_ROOT
from conftest import GPU_TESTS

KINDS = ("sft", "reference", "dpo", "generation")


@pytest.mark.slow
def test_the_gpu_bench_runs_end_to_end_on_cpu():
    out = subprocess.run(
        [sys.executable, "bench/gpu.py", "--dry-run"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)},
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert f"GPU test subset: {len(GPU_TESTS)} tests collected" in lines
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] and line.split()[0] in KINDS}
    for kind in KINDS:  # ours and TRL's tokens/s, their ratio, both TFLOP/s; no MFU on CPU; both peaks
        ours, trl, ratio, ours_tflops, ours_mfu, trl_tflops, trl_mfu, ours_gib, trl_gib = rows[kind]
        assert min(float(v.replace(",", "")) for v in (ours, trl, ratio, ours_tflops, trl_tflops, ours_gib, trl_gib)) > 0, rows[kind]
        assert ours_mfu == trl_mfu == "-"
    assert any("TRL settings:" in line and "'gradient_checkpointing': False" in line for line in lines)
    assert "issue 22's bars (a CPU dry run: not judged)" in out.stdout
    assert "SFT peak within 15% of the estimate" in out.stdout and "measured / estimated" in out.stdout
