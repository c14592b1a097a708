"""`align gc`: what the store holds, and the space nothing needs any more, reclaimed.

Only alignflow's own layout (`alignflow.orchestrator.store`) is ever touched; anything else under the root
(a file, a folder of the user's) is listed as not ours and left. What it reclaims, by category:

- `staging`: `{stage}/_staging/{fp}` whose fingerprint is committed, or whose run is gone (no
  live lease) and which has not changed for `store.retention.keep_days`: a dead run's staging
  holds the checkpoints its rerun resumes from, so recent ones stay;
- `leftovers`: what interrupted operations leave, once unchanged for a lease ttl: an output
  folder without a manifest (an object-store commit or a deletion cut short), `{fp}.replaced-*`
  (a forced local commit), a lease's `.stale-*` (a takeover);
- `checkpoints`: the `checkpoints/` of kept committed outputs (unless `keep_checkpoints`), which
  outputs committed before the commit left them out hold (or a commit cut short before it
  removed them), but not the final checkpoint a config asked to keep (`checkpoint.keep_optimizer`:
  the manifest's `training_state`). Nothing reads them: a retry resumes from its staging, and a
  reader loads `model/` or `adapter/` + `lora.json`, whose base is an upstream output. The
  manifest is rewritten first (atomically), its file list without them plus a `reclaimed` record;
- `outputs`: committed outputs that nothing keeps. Kept are those named by the newest
  `keep_runs` run records (`{root}/_runs`), those committed or named by a run within
  `keep_days`, those whose lease is live (a forced re-run), and every upstream of a kept one
  (its manifest's `inputs`; a LoRA output's base is one). An output is uncommitted first
  (manifest removed), then deleted, so no reader ever sees half of one.

A lease is live when its file changed within `store.lease_ttl_s` (this host's clock against
the store's: they must agree within a ttl); nothing whose lease is live is touched, and each
deletion checks again right before it acts. A run in progress has not written its record yet:
what it reads from the cache is protected by `keep_days`, so keep that longer than a pipeline runs.

Cost: one listing of the store (all sizes come from it) and one read per manifest and per
recent run record, so `align plan` shows the survey's one line before every run.
"""

import calendar
import json
import re
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from omegaconf import DictConfig
from rich.filesize import decimal

from alignflow.orchestrator.fingerprint import FINGERPRINT_CHARS
from alignflow.orchestrator.cost import COMPUTE
from alignflow.orchestrator.runs import REPORTS, RUNS
from alignflow.orchestrator.store import CHECKPOINTS, MANIFEST, TRAINING_STATE, Store

CATEGORIES = ("staging", "leftovers", "checkpoints", "outputs")
DAY_S = 86400.0
_FINGERPRINT = re.compile(rf"[0-9a-f]{{{FINGERPRINT_CHARS}}}")
_LEASE = re.compile(rf"(?P<fp>{_FINGERPRINT.pattern})(?:\.job)?\.json(?P<stale>\.stale-[0-9a-f]+)?")  # a lease, or its job record
_REPLACED = re.compile(rf"{_FINGERPRINT.pattern}\.replaced-[0-9a-f]+")


@dataclass(frozen=True)
class Item:
    """One thing gc would reclaim: a store path (the filesystem's), its bytes, and why."""

    category: str
    path: str
    bytes: int
    why: str
    stage: str
    fingerprint: str


@dataclass
class Survey:
    """What the store holds (alignflow's files) and what gc would reclaim."""

    root: str
    bytes: int = 0
    outputs: int = 0
    output_bytes: int = 0
    staging: int = 0
    staging_bytes: int = 0
    reclaim: list[Item] = field(default_factory=list)
    kept: dict[str, int] = field(default_factory=dict)  # why -> how many outputs or staging folders
    foreign: dict[str, int] = field(default_factory=dict)  # a path not ours (relative to the root) -> its bytes

    @property
    def reclaim_bytes(self) -> int:
        return sum(item.bytes for item in self.reclaim)

    def line(self) -> str:
        """One line for `align plan`."""
        reclaim = f"align gc would reclaim {decimal(self.reclaim_bytes)}" if self.reclaim else "nothing for align gc to reclaim"
        foreign = f"; {_many(len(self.foreign), 'path')} not alignflow's ({decimal(sum(self.foreign.values()))})" if self.foreign else ""
        return (
            f"store {self.root}: {decimal(self.bytes)} in {_many(self.outputs, 'output')} ({decimal(self.output_bytes)}) and "
            f"{_many(self.staging, 'staging folder')} ({decimal(self.staging_bytes)}){foreign}; {reclaim}"
        )

    def as_dict(self, items: bool = True) -> dict:
        """As JSON data; without `items`, only the totals per category (`align plan --json`)."""
        categories = {}
        for category in CATEGORIES:
            chosen = [i for i in self.reclaim if i.category == category]
            categories[category] = {"count": len(chosen), "bytes": sum(i.bytes for i in chosen)} | (
                {"items": [asdict(i) for i in chosen]} if items else {}
            )
        return {
            "root": self.root,
            "bytes": self.bytes,
            "outputs": self.outputs,
            "output_bytes": self.output_bytes,
            "staging": self.staging,
            "staging_bytes": self.staging_bytes,
            "reclaim_bytes": self.reclaim_bytes,
            "reclaim": categories,
            "kept": self.kept,
            "foreign": self.foreign,
            "line": self.line(),
        }


def _many(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


@dataclass
class _Unit:
    """One output, staging folder, lease, leftover or run record as the listing shows it."""

    bytes: int = 0
    newest: float = 0.0  # the latest change of anything in it (epoch seconds)
    committed: bool = False  # an output with its manifest
    checkpoints: bool = False  # an output with a checkpoints/ folder
    checkpoint_bytes: int = 0


def survey(store: Store, cfg: DictConfig) -> Survey:
    """The store's survey under `cfg.store.retention` and `cfg.store.lease_ttl_s` (reads only)."""
    retention, ttl, now = cfg.store.retention, cfg.store.lease_ttl_s, time.time()
    units, foreign = _units(store)
    found = Survey(store.uri(store.path()), bytes=sum(u.bytes for u in units.values()), foreign=foreign)
    live = {(p[1], p[2]) for p, u in units.items() if p[0] == "lease" and now - u.newest < ttl}
    committed = {(p[1], p[2]): u for p, u in units.items() if p[0] == "output" and u.committed}
    staging = {(p[1], p[2]): u for p, u in units.items() if p[0] == "staging"}
    found.outputs, found.output_bytes = len(committed), sum(u.bytes for u in committed.values())
    found.staging, found.staging_bytes = len(staging), sum(u.bytes for u in staging.values())

    manifests = _manifests(store, committed)
    kept = _kept_outputs(manifests, committed, live, _run_references(store, units, retention, now), retention, now)
    for (stage, fp), unit in committed.items():
        path = store.output_path(stage, fp)
        asked = TRAINING_STATE in (manifests[(stage, fp)] or {})  # its config kept its final checkpoint (checkpoint.keep_optimizer)
        if (stage, fp) not in kept:
            found.reclaim.append(Item("outputs", path, unit.bytes, "no kept run names it, nor any kept output as an upstream", stage, fp))
        elif unit.checkpoints and not retention.keep_checkpoints and (stage, fp) not in live and not asked:
            found.reclaim.append(
                Item(
                    "checkpoints",
                    f"{path}/{CHECKPOINTS}",
                    unit.checkpoint_bytes,
                    "training checkpoints of a committed output (nothing reads them)",
                    stage,
                    fp,
                )
            )
    whys = list(kept.values())
    for (stage, fp), unit in staging.items():
        why = _staging_reclaimed((stage, fp), unit, committed, live, retention.keep_days, now)
        if why.startswith("kept: "):
            whys.append(why.removeprefix("kept: "))
        else:
            found.reclaim.append(Item("staging", store.staging_path(stage, fp), unit.bytes, why, stage, fp))
    found.kept = dict(Counter(whys))
    for place, unit in units.items():
        if place[0] in _LEFTOVER and (place[0] != "output" or not unit.committed):
            stage, name, fp = place[1], place[2], place[2][:FINGERPRINT_CHARS]
            if (stage, fp) not in live and now - unit.newest >= ttl:
                path = store.path(stage, "_leases", name) if place[0] == "stale" else store.path(stage, name)
                found.reclaim.append(Item("leftovers", path, unit.bytes, _LEFTOVER[place[0]], stage, fp))
    found.reclaim.sort(key=lambda i: (CATEGORIES.index(i.category), i.path))
    return found


def _units(store: Store) -> tuple[dict[tuple, _Unit], dict[str, int]]:
    """The store's one listing grouped into alignflow's units (`_place`), and what is not ours
    (topmost paths relative to the root, with their bytes)."""
    fs, root = store.fs, store.path()
    fs.invalidate_cache(root)
    listing = fs.find(root, detail=True, withdirs=True) if fs.exists(root) else {}
    units: dict[tuple, _Unit] = defaultdict(_Unit)
    foreign: dict[str, int] = {}
    for path, info in listing.items():
        parts = path[len(root) + 1 :].split("/")
        is_file = info["type"] == "file"
        size = info["size"] if is_file else 0
        if not parts[0]:  # the root itself
            continue
        if (place := _place(parts, is_file)) is None:
            foreign["/".join(parts)] = size
            continue
        unit = units[place]
        unit.bytes += size
        unit.newest = max(unit.newest, _changed(info, renamed=place[0] in ("stale", "replaced")))
        if place[0] == "output":
            unit.committed |= parts[2:] == [MANIFEST]
            unit.checkpoints |= len(parts) > 2 and parts[2] == CHECKPOINTS
            unit.checkpoint_bytes += size if len(parts) > 3 and parts[2] == CHECKPOINTS else 0
    # A top-level folder is a stage instance's only with a sign of one: a committed output, a
    # staging or lease folder. Anything else (a cache of hash-named folders, say) is not ours.
    instances = {p[1] for p, u in units.items() if p[0] in ("layout", "staging", "lease", "stale") or (p[0] == "output" and u.committed)}
    for place in [p for p in units if p[0] in _IN_INSTANCE and p[1] not in instances]:
        foreign[place[1]] = foreign.get(place[1], 0) + units.pop(place).bytes
    return units, _topmost(foreign)


_IN_INSTANCE = ("instance", "layout", "output", "staging", "lease", "stale", "replaced")

_LEFTOVER = {
    "stale": "a lease renamed by an interrupted takeover",
    "replaced": "an old output an interrupted forced commit set aside",
    "output": "an output folder without a manifest (an interrupted commit or deletion)",
}


def _place(parts: list[str], is_file: bool) -> tuple | None:
    """Which unit of alignflow's layout a path belongs to, or None: not ours."""
    top, depth = parts[0], len(parts)
    if top == RUNS and depth == 2 and is_file and parts[1].endswith(".json"):
        return ("run", "/".join(parts))
    if top in (RUNS, REPORTS, COMPUTE):  # COMPUTE: the throughput table `align plan` predicts from, kept
        return ("records", top) if top != RUNS or depth == 1 else None
    if depth == 1:
        return None if is_file else ("instance", top)
    stage, name = top, parts[1]
    if name in ("_staging", "_leases") and depth == 2:
        return ("layout", stage)
    if name == "_staging":
        return ("staging", stage, parts[2]) if _FINGERPRINT.fullmatch(parts[2]) else None
    if name == "_leases":
        lease = _LEASE.fullmatch(parts[2]) if depth == 3 else None
        return None if lease is None else ("stale", stage, parts[2]) if lease["stale"] else ("lease", stage, lease["fp"])
    if _FINGERPRINT.fullmatch(name):
        return ("output", stage, name)
    if _REPLACED.fullmatch(name):
        return ("replaced", stage, name)
    return None


def _changed(info: dict, renamed: bool) -> float:
    """When a listed path last changed: its mtime (a rename sets only ctime, hence `renamed`),
    or an object's LastModified."""
    if "LastModified" in info:
        return info["LastModified"].timestamp()
    return max(info.get("mtime", 0.0), info.get("created", 0.0) if renamed else 0.0)


def _topmost(paths: dict[str, int]) -> dict[str, int]:
    """Foreign paths folded into their topmost foreign folder, with its bytes."""
    tops: dict[str, int] = {}
    for rel in sorted(paths, key=lambda r: r.count("/")):  # folders before what is in them
        parts = rel.split("/")
        top = next((a for a in ("/".join(parts[:i]) for i in range(1, len(parts))) if a in tops), rel)
        tops[top] = tops.get(top, 0) + paths[rel]
    return dict(sorted(tops.items()))


def _run_references(store: Store, units: dict, retention: DictConfig, now: float) -> dict[tuple[str, str], str]:
    """(stage, fingerprint) -> why a run keeps it: named by one of the newest keep_runs records,
    or by a record written within keep_days."""
    records = sorted(((u.newest, p[1]) for p, u in units.items() if p[0] == "run"), reverse=True)
    newest = {rel for _, rel in records[: retention.keep_runs]}
    recent = {rel for changed, rel in records if now - changed < retention.keep_days * DAY_S}
    wanted = sorted(newest | recent)
    bodies = store.fs.cat([store.path(rel) for rel in wanted], on_error="return") if wanted else {}
    keeps: dict[tuple[str, str], str] = {}
    for rel in wanted:
        try:
            stages = json.loads(bodies[store.path(rel)])["stages"]
        except (TypeError, ValueError, KeyError):  # an unreadable record keeps nothing
            continue
        why = f"named by one of the newest {retention.keep_runs} runs" if rel in newest else f"named by a run within {retention.keep_days:g} days"
        for stage in stages:
            if stage.get("fingerprint"):
                keeps.setdefault((stage["name"], stage["fingerprint"]), why)
    return keeps


def _manifests(store: Store, committed: dict) -> dict[tuple[str, str], dict | None]:
    """(stage, fingerprint) -> the committed output's manifest, None where it does not parse."""
    paths = {key: f"{store.output_path(*key)}/{MANIFEST}" for key in committed}
    bodies = store.fs.cat(list(paths.values()), on_error="return") if paths else {}
    manifests = {}
    for key, path in paths.items():
        try:
            manifests[key] = json.loads(bodies[path])
        except (TypeError, ValueError):
            manifests[key] = None
    return manifests


def _kept_outputs(manifests: dict, committed: dict, live: set, named: dict, retention: DictConfig, now: float) -> dict[tuple[str, str], str]:
    """(stage, fingerprint) -> why it is kept, for the committed outputs gc keeps, upstreams included."""
    kept = {}
    for key in committed:
        if manifests[key] is None:
            kept[key] = "its manifest does not parse"
            continue
        committed_at = _epoch(manifests[key].get("committed_at"), committed[key].newest)
        if key in live:
            kept[key] = "its lease is live (a forced re-run)"
        elif key in named:
            kept[key] = named[key]
        elif now - committed_at < retention.keep_days * DAY_S:
            kept[key] = f"committed within {retention.keep_days:g} days"
    todo = list(kept)
    while todo:
        stage, fp = todo.pop()
        for up, ref in ((manifests[(stage, fp)] or {}).get("inputs") or {}).items():
            key = (up, ref.get("fingerprint", ""))
            if key in committed and key not in kept:
                kept[key] = "upstream of a kept output"
                todo.append(key)
    return kept


def _epoch(stamp: str | None, fallback: float) -> float:
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return fallback


def _staging_reclaimed(key: tuple[str, str], unit: _Unit, committed: dict, live: set, keep_days: float, now: float) -> str:
    """Why a staging folder goes, or why it is kept (starting with "kept: ")."""
    if key in live:
        return "kept: its lease is live (a run is producing it)"
    if key in committed:
        return "its fingerprint is committed"
    idle_days = (now - unit.newest) / DAY_S
    if idle_days >= keep_days:
        return f"its run is gone (no live lease) and it has not changed for {idle_days:.1f} days"
    return f"kept: a dead run's, changed within {keep_days:g} days (a rerun resumes from it)"


# ----------------------------------------------------------------------------- acting


def reclaim(store: Store, found: Survey, ttl_s: float) -> list[Item]:
    """Delete what `found` lists, each after checking again that its lease is not live; returns
    what was deleted (an item whose lease came alive since is skipped)."""
    done = []
    for item in found.reclaim:
        if _lease_live(store, item.stage, item.fingerprint, ttl_s):
            continue
        try:
            if item.category == "outputs":
                store.uncommit(item.stage, item.fingerprint)
            elif item.category == "checkpoints":
                store.drop_checkpoints(item.stage, item.fingerprint)
            else:
                store.fs.rm(item.path, recursive=True)
        except FileNotFoundError:  # gone meanwhile (another gc; an interrupted operation finished); any rest is a leftover
            pass
        done.append(item)
    return done


def _lease_live(store: Store, stage: str, fp: str, ttl_s: float) -> bool:
    path = store.lease_path(stage, fp)
    store.fs.invalidate_cache(path)
    try:
        return time.time() - _changed(store.fs.info(path), renamed=False) < ttl_s
    except FileNotFoundError:
        return False
