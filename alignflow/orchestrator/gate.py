"""The nightly gate: did this run keep its baseline's metrics, beyond their noise?

A run's metrics are `{stage}.{metric}` from its record (`alignflow.orchestrator.runs`), e.g. `eval.sft.accuracy`.
`gate.thresholds` maps fnmatch patterns of them to the largest tolerated drop (a rise, for the
losses of LOWER_IS_BETTER). A metric regresses when its drop exceeds its threshold AND
`gate.sigmas` standard errors of the difference, sqrt(se_baseline^2 + se_run^2), from the
`<metric>_stderr` the runs report (eval's, lm-eval's `acc_stderr`); a metric neither run reports
one for is judged by its threshold alone. The baseline is a pinned run or the last successful
run of the same series: the same Prefect deployment, or outside one the same pipeline, in
the same store.

Orchestrator side: no torch, no prefect.
"""

import math
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase

from alignflow.orchestrator import runs
from alignflow.orchestrator.store import Store

LOWER_IS_BETTER = ("loss", "val_loss", "perplexity")  # by a metric's last name; every other metric: higher is better
STDERR = "_stderr"
REGRESSED = "Regressed"  # the flow run's state name when a metric regressed (a Failed type)
OK_STATES = ("Completed", "Cached")  # a stage of a successful run


@dataclass(frozen=True)
class Check:
    metric: str
    baseline: float
    value: float
    drop: float  # positive: worse
    threshold: float
    stderr: float | None  # of the difference; None: neither run reports one
    regressed: bool


@dataclass(frozen=True)
class Verdict:
    baseline: str | None  # the baseline run's name; None: no baseline (a series' first run)
    checks: list[Check] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)  # threshold patterns no metric of this run matches

    @property
    def state(self) -> str:
        """Regressed; else Failed where a threshold matched no metric (a typo would gate nothing,
        night after night); else Completed."""
        return REGRESSED if self.regressed else "Failed" if self.unmatched else "Completed"

    @property
    def regressed(self) -> list[Check]:
        return [c for c in self.checks if c.regressed]

    def message(self) -> str:
        """One line for the flow run's state (the table follows where there is one), what made it fail first."""
        typo = (
            [
                f"gate.thresholds: {', '.join(self.unmatched)} matches no metric of this run "
                "(its metrics are `{stage}.{metric}`, as its record and `align compare` show them)"
            ]
            if self.unmatched
            else []
        )
        return "; ".join([self._compared(), *typo] if self.regressed else [*typo, self._compared()])

    def _compared(self) -> str:
        if self.baseline is None:
            return "gate: no baseline run yet (the first of its series): nothing compared"
        if self.regressed:
            dropped = ", ".join(f"{c.metric} {c.baseline:.4g} -> {c.value:.4g}" for c in self.regressed)
            return f"gate: regressed against run '{self.baseline}': {dropped}"
        return f"gate: no metric dropped beyond its threshold and noise against run '{self.baseline}' ({len(self.checks)} compared)"

    def markdown(self) -> str:
        rows = ["| metric | baseline | this run | drop | threshold | stderr of the drop | verdict |", "|---|---|---|---|---|---|---|"]
        rows += [
            f"| {c.metric} | {c.baseline:.4g} | {c.value:.4g} | {c.drop:+.4g} | {c.threshold:.4g} | "
            f"{'-' if c.stderr is None else f'{c.stderr:.4g}'} | {_verdict(c)} |"
            for c in self.checks
        ]
        return "\n".join([self.message(), "", *rows])

    def as_dict(self) -> dict:
        return {"state": self.state, "baseline": self.baseline, "checks": [asdict(c) for c in self.checks], "unmatched": self.unmatched}


def _verdict(check: Check) -> str:
    if check.regressed:
        return "**regressed**"
    return "within noise" if check.drop > check.threshold else "ok"


def metrics_of(record: dict) -> dict[str, float]:
    """A run record's numeric stage metrics as `{stage}.{metric}`."""
    return {
        f"{s['name']}.{k}": v
        for s in record["stages"]
        for k, v in s.get("metrics", {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def gated(patterns, metrics: dict) -> dict[str, str]:
    """metric -> the first pattern that matches it (standard errors are not gated themselves)."""
    found = {}
    for pattern in patterns:
        for name in metrics:
            if fnmatchcase(name, pattern) and not name.endswith(STDERR):
                found.setdefault(name, pattern)
    return found


def judge(thresholds: dict, sigmas: float, record: dict, baseline: dict | None) -> Verdict:
    """This run's record against its baseline's under `gate.thresholds` and `gate.sigmas`."""
    now = metrics_of(record)
    matched = gated(thresholds, now)
    unmatched = [p for p in thresholds if p not in matched.values()]
    if baseline is None:
        return Verdict(None, [], unmatched)
    before = metrics_of(baseline)
    checks = [_check(name, before, now, thresholds[pattern], sigmas) for name, pattern in matched.items() if name in before]
    return Verdict(baseline["name"], checks, unmatched)


def _check(name: str, before: dict, now: dict, threshold: float, sigmas: float) -> Check:
    sign = -1.0 if name.rsplit(".", 1)[-1] in LOWER_IS_BETTER else 1.0
    drop = sign * (before[name] - now[name])
    errors = [side[name + STDERR] for side in (before, now) if name + STDERR in side]
    stderr = math.sqrt(sum(e * e for e in errors)) if errors else None
    return Check(name, before[name], now[name], drop, threshold, stderr, drop > threshold and (stderr is None or drop > sigmas * stderr))


def series(store: Store, record: dict) -> list[dict]:
    """The records of `record`'s series, oldest first: the same deployment or, for a run outside
    one, the same pipeline outside one."""
    key = (record.get("deployment"), None if record.get("deployment") else record["pipeline"])
    return [r for r in runs.history(store) if (r.get("deployment"), None if r.get("deployment") else r["pipeline"]) == key]


def successful(record: dict) -> bool:
    return all(s["state"] in OK_STATES for s in record["stages"]) and record.get("gate", {}).get("state") != REGRESSED


def baseline_of(store: Store, pinned: str, record: dict) -> dict | None:
    """`gate.baseline`: a pinned run's record, or (`last`) the last successful run of the series."""
    if pinned != "last":
        return runs.read(store, pinned)
    return next((r for r in reversed(series(store, record)) if successful(r) and r["name"] != record["name"]), None)


def trend(records: list[dict], names: list[str]) -> list[tuple[str, dict[str, float]]]:
    """(run name, {metric: value}) per run, for the metrics `names`."""
    return [(r["name"], {k: v for k, v in metrics_of(r).items() if k in names}) for r in records]
