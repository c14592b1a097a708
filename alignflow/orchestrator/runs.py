"""Pipeline run records: what a run produced, kept so that two runs can be compared.

The flow writes `{store.root}/_runs/<run>.json` at its end (beside `_reports/<run>.html`): the
pipeline, its overrides and, per stage in pipeline order, kind, final state, fingerprint,
output URI and headline metrics. `compare` lines up two records stage by stage and says why
a stage's fingerprint differs, from the identities its manifests hold (config keys, code,
packages, sources, inputs), as `align plan` explains a re-run.

Orchestrator side: no torch, no prefect.
"""

import json
import re
from dataclasses import dataclass
from datetime import datetime, timezone

from alignflow.orchestrator.fingerprint import differences
from alignflow.orchestrator.store import Store

RUNS = "_runs"
REPORTS = "_reports"  # the flow's report.html per run


def slug(name: str) -> str:
    """A run name as a file name: `sft_dpo · local · local store · 11-23 14:05:09` -> `sft_dpo_local_local_store_11-23_14_05_09`."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_")


def write(store: Store, name: str, record: dict) -> str:
    """The run's record, stamped with when it ended (UTC, ISO 8601); returns its URI."""
    path = store.path(RUNS, f"{slug(name)}.json")
    store.fs.makedirs(store.path(RUNS), exist_ok=True)
    store.fs.pipe(path, json.dumps({"name": name, "ended": datetime.now(timezone.utc).isoformat(), **record}, indent=2).encode())
    return store.uri(path)


def history(store: Store) -> list[dict]:
    """Every run record of the store, oldest first (records from before the `ended` stamp first)."""
    records = [json.loads(store.fs.cat(p)) for p in store.fs.glob(store.path(RUNS, "*.json"))]
    return sorted(records, key=lambda r: r.get("ended", ""))


def read(store: Store, run: str) -> dict:
    """A run's record by its name (as the UI shows it) or its file name; a clear error otherwise."""
    path = store.path(RUNS, f"{slug(run).removesuffix('.json')}.json")
    if not store.fs.exists(path):
        known = sorted(store.fs.glob(store.path(RUNS, "*.json")), key=store.fs.modified, reverse=True)
        names = ", ".join(p.rsplit("/", 1)[1].removesuffix(".json") for p in known[:5]) or "none yet"
        raise FileNotFoundError(f"no run {run!r} in {store.uri(store.path(RUNS))} (recent runs: {names})")
    return json.loads(store.fs.cat(path))


@dataclass(frozen=True)
class StageComparison:
    stage: str
    kind: str
    a: str  # fingerprint in run A ("" where the stage is not in it or did not finish)
    b: str
    same: bool
    why: list[str]  # what differs, in a person's words (empty when the same)
    metrics: dict[str, tuple]  # headline metric -> (A's value, B's value)


def compare(store: Store, a: dict, b: dict) -> list[StageComparison]:
    """Run A's and run B's stages side by side, in A's order then B's own stages."""
    stages_a, stages_b = ({s["name"]: s for s in run["stages"]} for run in (a, b))
    rows = []
    for name in [*stages_a, *(n for n in stages_b if n not in stages_a)]:
        sa, sb = stages_a.get(name, {}), stages_b.get(name, {})
        fa, fb = sa.get("fingerprint", ""), sb.get("fingerprint", "")
        keys = [*sa.get("metrics", {}), *(k for k in sb.get("metrics", {}) if k not in sa.get("metrics", {}))][:4]
        rows.append(
            StageComparison(
                name,
                sa.get("kind") or sb.get("kind", ""),
                fa,
                fb,
                bool(fa) and fa == fb,
                [] if fa and fa == fb else _why(store, name, sa, sb),
                {k: (sa.get("metrics", {}).get(k), sb.get("metrics", {}).get(k)) for k in keys},
            )
        )
    return rows


def _why(store: Store, name: str, sa: dict, sb: dict) -> list[str]:
    for side, label in ((sa, "A"), (sb, "B")):
        if not side.get("fingerprint"):
            return [f"not in run {label}" if not side else f"{side.get('state', 'not finished')} in run {label}"]
    manifests = [store.read_manifest(name, s["fingerprint"]) for s in (sa, sb)]
    if any(m is None or "identity" not in m for m in manifests):
        return ["an output is no longer in the store: no identity to compare"]
    return differences(manifests[1]["identity"], manifests[0]["identity"]) or ["(no difference recorded)"]
