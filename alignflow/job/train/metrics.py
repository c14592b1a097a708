"""Training metrics: `{out}/metrics.jsonl`, wandb (optional) and a progress line in the job log.

Rank 0 only. One JSON object per logged step (step, loss, lr, grad_norm, tokens, tokens_per_s,
and val_loss on steps that validated). On resume the lines after the resumed step are
dropped, so the file reads as one uninterrupted run (a torn last line too). wandb runs in
`logging.wandb.mode`, by default online when an api key is configured and offline otherwise;
its run id is kept in the checkpoints folder so a retry continues the same run. The api key is handed to wandb through its environment variable, never logged or saved.
"""

import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Optional

from alignflow.job.train.checkpoints import WANDB_RUN_ID

log = logging.getLogger("alignflow.job.train")


class MetricsLog:
    def __init__(self, out: Path, checkpoints: Path, resumed_step: int, wandb_cfg: Any = None, run_name: str = "train"):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        _truncate_after(self.path, resumed_step)
        self.wandb = _start_wandb(wandb_cfg, out, checkpoints, run_name) if wandb_cfg is not None and wandb_cfg.enabled else None

    def write(self, record: dict, total_steps: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        parts = [f"{k} {_fmt(v)}" for k, v in record.items() if k != "step"]
        event = {"step": record["step"], "total": total_steps} | ({"loss": record["loss"]} if "loss" in record else {})
        log.info("step %d/%d: %s", record["step"], total_steps, ", ".join(parts), extra={"event": event})

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records up to the resumed step; a torn last line (the job died mid-write) goes too."""
    if not path.exists():
        return
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            log.warning("%s line %d: not a whole record (a write cut short by a kill): dropped", path, number)
            continue
        if record is not None and record["step"] <= step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _start_wandb(cfg: Any, out: Path, checkpoints: Path, run_name: str):
    import wandb

    id_file = checkpoints / WANDB_RUN_ID
    checkpoints.mkdir(parents=True, exist_ok=True)
    if not id_file.exists():
        id_file.write_text(secrets.token_hex(4))
    api_key: Optional[str] = cfg.api_key
    if api_key:
        os.environ["WANDB_API_KEY"] = api_key
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        id=id_file.read_text().strip(),
        resume="allow",
        name=run_name,
        mode=cfg.mode or ("online" if api_key else "offline"),
        dir=str(out),
    )
    if run.settings.mode == "online":  # the orchestrator links the run from the stage's artifacts
        log.info("wandb run %s", run.url, extra={"event": {"link": run.url}})
    return run
