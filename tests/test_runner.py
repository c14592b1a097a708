"""The runner never corrupts an output: concurrent runs share one job, failures commit nothing."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from alignflow.config import compose
from alignflow.launch import StageFailed
from alignflow.runner import run_stage

RUN_PREP = """
import json, sys
from alignflow.config import compose
from alignflow.runner import run_stage
result = run_stage(compose("demo", sys.argv[1:]), "prep", {}, log=lambda line: None)
print(json.dumps({"cached": result.cached, "fingerprint": result.fingerprint}))
"""


def jobs_submitted(tmp_path) -> int:
    return len(list((tmp_path / "jobs").glob("*/*")))


@pytest.mark.slow
def test_two_concurrent_runs_of_one_fingerprint_submit_one_job(base_overrides, tmp_path):
    runs = [subprocess.Popen([sys.executable, "-c", RUN_PREP, *base_overrides, "store.poll_interval_s=0.2"], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in runs]
    assert all(p.returncode == 0 for p in runs)
    assert sorted(r["cached"] for r in results) == [False, True]
    assert results[0]["fingerprint"] == results[1]["fingerprint"]
    assert jobs_submitted(tmp_path) == 1
    out = tmp_path / "store" / "prep" / results[0]["fingerprint"]
    manifest = json.loads((out / "_SUCCESS.json").read_text())
    for entry in manifest["files"]:
        assert (out / entry["path"]).stat().st_size == entry["size"]
    assert pq.read_table(out / "sft" / "train-00000.parquet").num_rows > 0


def test_a_bad_row_fails_the_stage_naming_file_line_field_and_commits_nothing(base_overrides, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}\n{"messages": "oops"}\n')
    cfg = compose("demo", [*base_overrides, f"data.sft.train={bad}", "data.sft.val=null"])
    with pytest.raises(StageFailed, match=r"bad\.jsonl.*line 2.*messages"):
        run_stage(cfg, "prep", {}, log=lambda line: None)
    assert not list((tmp_path / "store" / "prep").glob("*/_SUCCESS.json"))


def test_a_failed_forced_rerun_keeps_the_committed_output(base_overrides, tmp_path):
    good = run_stage(compose("demo", base_overrides), "prep", {}, log=lambda line: None)
    manifest = (tmp_path / "store" / "prep" / good.fingerprint / "_SUCCESS.json").read_text()
    # Same fingerprint (where jobs run is not identity), but the job cannot even start.
    cfg = compose("demo", [*base_overrides, "force=[prep]", "launcher.folder=/dev/null/jobs"])
    with pytest.raises(OSError):
        run_stage(cfg, "prep", {}, log=lambda line: None)
    assert (tmp_path / "store" / "prep" / good.fingerprint / "_SUCCESS.json").read_text() == manifest
