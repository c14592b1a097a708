"""The runner never corrupts an output: concurrent runs share one job, failures commit nothing, a
killed job leaves no process behind (a killed run's job is adopted by its rerun: tests/test_faults.py)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import psutil
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from alignflow.orchestrator.config.compose import build, compose
from alignflow.orchestrator.config.schema import LauncherConfig
from alignflow.orchestrator.launch import StageFailed, submit
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage

sys.path.insert(0, str(Path(__file__).parent))
from train_ranks import convert_demo, prep_demo, sft_cfg  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # jobs run this file's functions by value

RUN_PREP = """
import json, sys
from alignflow.orchestrator.config.compose import build
from alignflow.orchestrator.runner import run_stage
result = run_stage(build("demo", sys.argv[1:])["prep"], {}, log=lambda line: None)
print(json.dumps({"cached": result.cached, "fingerprint": result.fingerprint}))
"""


def jobs_submitted(tmp_path) -> int:
    return len(list((tmp_path / "jobs").glob("*/*")))


@pytest.mark.slow
def test_two_concurrent_runs_of_one_fingerprint_submit_one_job(base_overrides, tmp_path):
    runs = [
        subprocess.Popen([sys.executable, "-c", RUN_PREP, *base_overrides, "store.poll_interval_s=0.2"], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
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
        run_stage(Pipeline.build(cfg)["prep"], {}, log=lambda line: None)
    assert not list((tmp_path / "store" / "prep").glob("*/_SUCCESS.json"))


def test_a_failed_forced_rerun_keeps_the_committed_output(base_overrides, tmp_path):
    good = run_stage(build("demo", base_overrides)["prep"], {}, log=lambda line: None)
    manifest = (tmp_path / "store" / "prep" / good.fingerprint / "_SUCCESS.json").read_text()
    # Same fingerprint (where jobs run is not identity), but the job cannot even start.
    cfg = compose("demo", [*base_overrides, "force=[prep]", "launcher.folder=/dev/null/jobs"])
    with pytest.raises(OSError):
        run_stage(Pipeline.build(cfg)["prep"], {}, log=lambda line: None)
    assert (tmp_path / "store" / "prep" / good.fingerprint / "_SUCCESS.json").read_text() == manifest


FORGETFUL = {  # a stage kind with a bug, added to a copy of the checkout: its output lacks what its format ("eval") declares
    "alignflow/job/stages/forgetful.py": '''"""A toy stage kind that writes its result under the wrong name."""


def run(cfg, inputs, out):
    with open(f"{out}/result.json", "w") as f:
        f.write("{}")
    return {"rows": 0}
''',
    "alignflow/orchestrator/kinds/forgetful.py": "from alignflow.orchestrator.config import schema\nfrom alignflow.orchestrator.kinds.spec import StageKind\n\n"
    'KIND = StageKind(schema=schema.ForgetfulConfig, output="eval", inputs={}, resumable=False)\n',
    "conf/pipeline/forgetful.yaml": "# @package _global_\n# align run pipeline=forgetful\npipeline:\n  name: forgetful\n  stages:\n    forgetful: {}\n",
}
RUN_FORGETFUL = """
import sys
from alignflow.orchestrator.config.compose import build, compose
from alignflow.orchestrator.pipeline import Pipeline
from alignflow.orchestrator.runner import run_stage
from alignflow.orchestrator.verify import IncompleteOutput
try:
    run_stage(build("forgetful", sys.argv[1:])["forgetful"], {}, log=lambda line: None)
except IncompleteOutput as err:
    print(err)
"""


@pytest.mark.slow
def test_a_stage_whose_output_lacks_a_declared_file_commits_nothing(base_overrides, tmp_path):
    """The runner's commit checks the staged output against its kind's format (`alignflow.orchestrator.verify`):
    a job that ran to its end but wrote result.json instead of eval.json is not committed."""
    from test_plan import checkout_copy, edit

    checkout = checkout_copy(tmp_path)
    for path, text in FORGETFUL.items():
        (checkout / path).write_text(text)
    with open(checkout / "alignflow" / "orchestrator" / "config" / "schema.py", "a") as f:
        f.write("\n\n@dataclass\nclass ForgetfulConfig(StageBase):\n    pass\n")
    edit(checkout / "alignflow" / "orchestrator" / "kinds" / "__init__.py", '    "export",\n)', '    "export",\n    "forgetful",\n)')
    ran = subprocess.run([sys.executable, "-c", RUN_FORGETFUL, *base_overrides], cwd=checkout, capture_output=True, text=True, check=True)
    staging = next((tmp_path / "store" / "forgetful" / "_staging").iterdir())
    assert ran.stdout.strip() == f"forgetful {staging.name}: not committed: the output staged at {staging} is incomplete: eval.json: missing"
    instance = tmp_path / "store" / "forgetful"
    assert sorted(p.name for p in instance.iterdir()) == ["_leases", "_staging"] and not list((instance / "_leases").iterdir())  # no output
    assert [p.name for p in staging.iterdir()] == ["result.json"]  # kept as the job left it, to look at


def alive(processes: list[psutil.Process]) -> list[str]:
    """The processes still running (a zombie has ended: only its exit status is left)."""
    running = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            pass
    return running


def sleeping_after_a_checkpoint(*args):
    """`run_stage_job`, asleep after its first checkpoint (so a test can kill it there), with a
    helper process of its own running, as wandb's service runs beside a job that logs to it."""
    from alignflow.job.train import checkpoints
    from alignflow.job.worker import run_stage_job
    from alignflow.orchestrator import orphans

    save = checkpoints.save

    def save_then_sleep(*a, **kw):
        path = save(*a, **kw)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(4 * orphans.POLL_S)  # the watcher ends what it has seen: let it see the helper
        print("checkpoint saved", flush=True)
        time.sleep(600)
        return path

    checkpoints.save = save_then_sleep
    return run_stage_job(*args)


@pytest.mark.slow
def test_a_killed_job_leaves_none_of_its_processes_behind(demo_dir, tmp_path):
    """SIGKILL of an SFT job after a checkpoint: every process it started (a helper, its
    watcher) is gone within seconds."""
    inputs = {"data": str(prep_demo(demo_dir, tmp_path / "data")), "model": str(convert_demo(demo_dir, tmp_path / "model"))}
    cfg = sft_cfg(demo_dir, trainer={"max_steps": 4}, checkpoint={"every_n_steps": 2})
    launcher = OmegaConf.merge(OmegaConf.structured(LauncherConfig), {"folder": str(tmp_path / "jobs")})
    job = submit(launcher, OmegaConf.create(cfg["sft"]), "sft", sleeping_after_a_checkpoint, "sft", cfg, inputs, str(tmp_path / "out"), {})
    deadline = time.time() + 240
    while "checkpoint saved" not in (job.paths.stdout.read_text() if job.paths.stdout.exists() else ""):
        assert not job.done() and time.time() < deadline, job.stderr()
        time.sleep(0.5)
    (rank,) = psutil.Process(int(job.job_id)).children()  # the controller's one rank (cold or forked warm)
    started = rank.children(recursive=True)
    assert started, "the job started no process: nothing to check"
    rank.kill()
    gone, alive_ = psutil.wait_procs(started, timeout=15)
    assert alive(alive_) == [], alive(alive_)


def test_a_job_reads_only_the_sections_its_kind_declares(base_overrides):
    """A job's config holds its section, what it reads and its context, with the schema's
    defaults; reading anything else raises instead of silently taking a default that the
    fingerprint never saw."""
    from omegaconf.errors import ConfigAttributeError

    from alignflow.orchestrator.config.slices import for_job
    from alignflow.orchestrator.kinds import job_paths
    from alignflow.job.worker import typed

    cfg = build("sft_dpo", [*base_overrides, "ref_logprobs.micro_batch_size=3"], check_paths=False)["ref_logprobs"].cfg
    job = typed(for_job(cfg, job_paths("ref_logprobs")), "ref_logprobs")
    assert job.ref_logprobs.micro_batch_size == 3 and job.model.source == cfg.model.source and "cache_dir" in job.store
    for undeclared in ("launcher", "dpo", "logging", "data"):
        with pytest.raises(ConfigAttributeError, match=undeclared):
            getattr(job, undeclared)
    with pytest.raises(ConfigAttributeError, match="store.root"):
        _ = job.store.root
    assert typed({}, "ref_logprobs").ref_logprobs.micro_batch_size == 4  # declared sections are filled with the schema's defaults
