"""What a pipeline costs: measured per job, predicted per stage by `align plan`, summed per run.

Measured: every job reports its wall time, hardware and device-hours (`alignflow.job.usage`:
GPU-hours on GPU, core-hours on CPU), and training and forward stages their model FLOPs,
tokens and the seconds of those passes (`compute_s`). At each commit the runner adds the job's
row to the store's throughput table, `{store.root}/_compute/` (one small JSON file a row, so
concurrent runs and object stores need no append), keyed by stage kind, model shape, layout,
launcher and device-hour unit, with the hardware it ran on.

Predicted: a stage's FLOPs from the model's shape (the config.json of `model.hf_config` or
`model.source`, else `model.architecture`) and its kind's passes (`StageKind.work`) over the
token counts of its prep stage's committed output (items from the Parquet footers; tokens and
squared document lengths per item from the first SAMPLED items of each split), else the
config's upper bounds (full rows of `data.seq_length`, one document each; a split of unknown
size counts nothing). Its time is a job's start-up plus its passes plus its decoding, each
measured rather than fitted (a tiny CPU job is mostly start-up, which a FLOPs-only model would
miss; generation goes a token at a time, whatever its FLOPs):
    job wall = median(wall_s - compute_s) + FLOPs / (sum of FLOPs / sum of (compute_s - generation_s))
               + decoding steps x (sum of generation_s / sum of decoding steps)
    stage seconds = job wall + median(stage seconds - wall_s)   (submission, queue, commit)
over the last HISTORY jobs of its key on the hardware the latest of them ran on; without one,
the stated DEFAULTS (no default for decoding: said as unknown). Decoding steps are counted as a
plan counts them (max_new_tokens a batch, the bound EOS may cut short), for the jobs measured
and the stage predicted alike. Device-hours = job wall x the devices such a job held. A committed stage is
predicted 0 (a cache hit) and shown as saved: the cost its manifest recorded. The total's time
is the longest path through the DAG (independent stages run at once), its device-hours the sum.

Orchestrator side: no torch.
"""

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass

import fsspec
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from alignflow.job.data.prepared import SCHEMAS
from alignflow.job.train.utilization import ModelShape, flops_of
from alignflow.job.usage import CORE_HOURS, GPU_HOURS
from alignflow.orchestrator.config.schema import LauncherName
from alignflow.orchestrator.kinds import STAGES
from alignflow.orchestrator.kinds.spec import Work
from alignflow.orchestrator.launch import gpus_per_node
from alignflow.orchestrator.pipeline import Pipeline, Stage
from alignflow.orchestrator.store import Store, options_for, store_of

COMPUTE = "_compute"  # the throughput table: one JSON row per job that ran
METRICS = ("flops", "wall_s", "device_hours", "device_hours_of", "hardware")  # what a stage's artifact shows of its cost
HISTORY = 5  # the latest jobs of a key a prediction reads
SAMPLED = 1024  # items of a split whose token counts stand for the split's


@dataclass(frozen=True)
class Default:
    rate: float  # model FLOP/s of a rank (GPU) or of a job (CPU)
    start_s: float  # a job's seconds besides its passes
    source: str


DEFAULTS = {
    GPU_HOURS: Default(
        0.35 * 989e12, 60.0, "H100 dense bf16 peak 989 TFLOP/s x MFU 0.35 a rank (bench/gpu.py: SFT 0.34), 60 s start-up (a guess, not measured)"
    ),
    CORE_HOURS: Default(
        80e9, 10.0, "80 GFLOP/s a job (bench/train_vs_trl.py: mid-shape SFT on 2 cores, 544 tok/s x 6 x 25.7M), 10 s start-up (demo jobs: 4-12 s)"
    ),
}


# ----------------------------------------------------------------------------- keys


def model_shape(cfg) -> ModelShape | None:
    """The shape of the model a stage's config names (`model.hf_config` or `model.source`'s
    config.json, else `model.architecture`); None where neither says."""
    key = "model.hf_config" if cfg.model.hf_config else "model.source"
    uri = f"{OmegaConf.select(cfg, key).rstrip('/')}/config.json"
    config = _read_json(uri, options_for(uri, cfg))
    if config is None and cfg.model.architecture is not None:
        config = OmegaConf.to_container(cfg.model.architecture)
    try:
        return ModelShape.of({**config, **config.get("text_config", {})}) if config else None
    except (KeyError, TypeError):
        return None


def _read_json(uri: str, options: dict) -> dict | None:
    try:
        with fsspec.open(uri, "r", **options) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def shape_key(shape: ModelShape | None) -> str:
    if shape is None:
        return "unknown"
    return f"L{shape.layers} h{shape.hidden} ffn{shape.ffn} heads{shape.heads}/{shape.kv_heads}x{shape.head_dim} V{shape.vocab}"


def layout_key(section) -> str:
    """Nodes x ranks a node, and the model-parallel sizes (DP follows)."""
    res = section.resources
    tp, pp = (OmegaConf.select(section, f"parallel.{size}_model_parallel_size", default=1) for size in ("tensor", "pipeline"))
    return f"{res.nodes}x{res.tasks_per_node} TP{tp} PP{pp}"


def unit_of(cfg) -> str:
    """The device-hours a stage's jobs will count: GPU-hours where its ranks get GPUs."""
    return GPU_HOURS if gpus_per_node(cfg.launcher) > 0 else CORE_HOURS


def key_of(stage: Stage) -> dict:
    cfg = stage.cfg
    return {
        "kind": stage.kind,
        "shape": shape_key(model_shape(cfg)),
        "layout": layout_key(stage.section),
        "launcher": LauncherName(cfg.launcher.name).value,
        "unit": unit_of(cfg),
    }


# ----------------------------------------------------------------------------- the throughput table


def record(store: Store, stage: Stage, manifest: dict) -> None:
    """The committed job's row of the throughput table (a job of before `alignflow.job.usage` has none)."""
    m = manifest["metrics"]
    if "wall_s" not in m:
        return
    row = key_of(stage) | {"unit": m["device_hours_of"]}
    row |= {k: m.get(k) for k in ("hardware", "devices", "device_hours", "wall_s", "flops", "tokens", "compute_s", "generation_s")}
    prep = stage.inputs.get("data")
    data = Data(store, prep and store.output_path(prep, manifest["inputs"][prep]["fingerprint"]), stage.cfg.data.seq_length)
    row["decode_steps"] = work_of(stage, data)[0].decode_steps  # as a plan counts them: the upper bound the time per step is of
    row |= {"stage": stage.name, "fingerprint": manifest["fingerprint"], "seconds": manifest["seconds"], "committed_at": manifest["committed_at"]}
    store.fs.makedirs(store.path(COMPUTE), exist_ok=True)
    store.fs.pipe(store.path(COMPUTE, f"{stage.name}-{manifest['fingerprint']}-{manifest['job']['job_id']}.json"), json.dumps(row).encode())


def history(store: Store) -> list[dict]:
    """Every row of the store's throughput table, oldest first."""
    paths = store.fs.glob(store.path(COMPUTE, "*.json"))
    rows = [json.loads(body) for body in store.fs.cat(paths).values()] if paths else []
    return sorted(rows, key=lambda r: r["committed_at"])


@dataclass(frozen=True)
class Throughput:
    """How a key's jobs ran: the model behind a prediction."""

    rate: float | None  # model FLOP/s while computing, generation aside
    step_s: float | None  # seconds a decoding step (of a plan's count)
    start_s: float  # a job's seconds besides its passes
    around_s: float  # a stage's seconds besides its job's
    devices: float
    basis: str  # where these come from, in words


def throughput(rows: list[dict], key: dict, devices: int) -> Throughput:
    """From the latest HISTORY rows of `key` on the hardware the latest of them ran on; else DEFAULTS."""
    same = [r for r in rows if all(r.get(k) == v for k, v in key.items())]
    if not same:
        default = DEFAULTS[key["unit"]]
        rate = default.rate * (devices if key["unit"] == GPU_HOURS else 1)
        return Throughput(rate, None, default.start_s, 0.0, devices, f"default: {default.source}")
    hardware = same[-1]["hardware"]
    latest = [r for r in same if r["hardware"] == hardware][-HISTORY:]
    generating, steps = sum(r.get("generation_s") or 0 for r in latest), sum(r.get("decode_steps") or 0 for r in latest)
    flops, busy = sum(r["flops"] or 0 for r in latest), sum(r["compute_s"] or 0 for r in latest) - generating
    return Throughput(
        flops / busy if flops and busy > 0 else None,
        generating / steps if generating and steps else None,
        statistics.median(r["wall_s"] - (r["compute_s"] or 0) for r in latest),
        statistics.median(r["seconds"] - r["wall_s"] for r in latest),
        latest[-1]["devices"],
        f"measured: {len(latest)} job{'s' if len(latest) > 1 else ''} on {hardware}",
    )


# ----------------------------------------------------------------------------- token counts


@dataclass(frozen=True)
class Split:
    """A split of prep's output: how many items, and per item its tokens and the sum of its
    documents' squared lengths (what attention costs)."""

    items: int | None
    tokens: float
    squares: float


def _token_columns(dataset: str) -> list[str]:
    """The columns of prep's `dataset` (`alignflow.job.data.prepared.SCHEMAS`) that give its items'
    documents: a packed row's document offsets, else each sequence's token ids."""
    names = SCHEMAS[dataset].names
    return [OFFSETS] if OFFSETS in names else [n for n in names if n.endswith("_ids") and n != "sample_ids"]


def _lengths(batch) -> list[list[int]]:
    """Each item's document lengths in a record batch of `_token_columns`."""
    if OFFSETS in batch.schema.names:
        return [[b - a for a, b in zip(cu, cu[1:])] for cu in batch.column(OFFSETS).to_pylist()]
    return [list(row) for row in zip(*(pc.list_value_length(column).to_pylist() for column in batch.columns))]


OFFSETS = "cu_seqlens"


def measured_split(fs, root: str, dataset: str, split: str) -> Split:
    """A split of a committed prep output: its items, and its first SAMPLED items' token counts."""
    files = [pq.ParquetFile(fs.open(f, "rb")) for f in sorted(fs.glob(f"{root}/{dataset}/{split}-*.parquet"))]
    items = sum(f.metadata.num_rows for f in files)
    sample: list[list[int]] = []
    for f in files:
        for batch in f.iter_batches(batch_size=SAMPLED - len(sample), columns=_token_columns(dataset)):
            sample += _lengths(batch)
            if len(sample) >= SAMPLED:
                break
        if len(sample) >= SAMPLED:
            break
    n = max(len(sample), 1)
    return Split(items, sum(map(sum, sample)) / n, sum(d * d for docs in sample for d in docs) / n)


def bound_split(dataset: str, seq_length: int) -> Split:
    """Without prep's output: full documents of seq_length, one a row (two a pair); size unknown."""
    docs = 2 if dataset == "preference" else 1
    return Split(None, docs * seq_length, docs * seq_length**2)


class Data:
    """The token counts a stage's work is priced on: its prep stage's committed output, else bounds."""

    def __init__(self, store: Store, prep_path: str | None, seq_length: int):
        self.fs, self.root, self.seq_length, self.splits = store.fs, prep_path, seq_length, {}

    @property
    def measured(self) -> bool:
        return self.root is not None

    def split(self, dataset: str, split: str) -> Split:
        if (dataset, split) not in self.splits:
            measured = self.root is not None and self.fs.exists(f"{self.root}/{dataset}")
            self.splits[dataset, split] = measured_split(self.fs, self.root, dataset, split) if measured else bound_split(dataset, self.seq_length)
        return self.splits[dataset, split]

    def count(self, dataset: str, split: str) -> int | None:
        return self.split(dataset, split).items


@dataclass(frozen=True)
class Amount:
    """A stage's work in the units its time goes by: model FLOPs (and tokens), decoding steps."""

    flops: float | None  # None: a split's size is unknown
    tokens: float | None
    decode_steps: int


def amount(shape: ModelShape | None, data: Data, work: list[Work], dp: int) -> Amount:
    """A stage's work on `data` at `dp` data-parallel ranks: FLOPs and tokens over every rank,
    decoding steps on the busiest (ranks decode their shares at once). No work: no FLOPs."""
    if not work:
        return Amount(None, None, 0)
    flops, tokens, steps = 0.0, 0.0, 0
    for w in work:
        s = data.split(w.dataset, w.split)
        items = s.items if w.items is None else w.items
        if items is None or shape is None:
            return Amount(None, None, 0)
        per_item_tokens, per_item_squares = s.tokens + w.extra, s.squares + 2 * w.extra * s.tokens + w.extra**2  # one document an item gets `extra`
        flops += w.repeat * items * flops_of(shape, per_item_tokens, per_item_squares, w.passes)
        tokens += w.repeat * items * per_item_tokens
        steps += w.repeat * math.ceil(math.ceil(items / dp) / w.batch) * w.extra if w.batch else 0
    return Amount(flops, tokens, steps)


def data_parallel(section) -> int:
    res = section.resources
    tp, pp = (OmegaConf.select(section, f"parallel.{size}_model_parallel_size", default=1) for size in ("tensor", "pipeline"))
    return max(res.nodes * res.tasks_per_node // (tp * pp), 1)


def work_of(stage: Stage, data: Data) -> tuple[Amount, bool]:
    """The stage's work (`StageKind.work`) priced on `data`; and whether it has any."""
    work = STAGES[stage.kind].work(stage, data.count)
    return amount(model_shape(stage.cfg), data, work, data_parallel(stage.section)), bool(work)


# ----------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class Estimate:
    stage: str
    kind: str
    status: str  # the plan's: committed, run, forced
    flops: float | None  # model FLOPs (None: not a model stage, or unknown)
    tokens: float | None
    seconds: float  # the stage's time (0 for a cache hit)
    device_hours: float  # what it will use (0 for a cache hit)
    saved: float  # a cache hit's recorded device-hours
    unit: str
    basis: str  # where the time comes from, and the token counts


def predict(pipeline: Pipeline, planned: list) -> list[Estimate]:
    """Each stage's predicted FLOPs, time and device-hours (`planned`: `runner.plan`'s rows)."""
    store = store_of(pipeline.cfg)
    rows, by_name = history(store), {row.stage: row for row in planned}
    estimates = []
    for stage in pipeline:
        row = by_name[stage.name]
        if row.status == "committed":
            metrics = (store.read_manifest(stage.name, row.fingerprint) or {}).get("metrics", {})
            unit = metrics.get("device_hours_of", unit_of(stage.cfg))
            estimates.append(Estimate(stage.name, stage.kind, row.status, None, None, 0.0, 0.0, metrics.get("device_hours", 0.0), unit, "cache hit"))
            continue
        estimates.append(_estimate(stage, row, rows, _data(stage, store, by_name)))
    return estimates


def _data(stage: Stage, store: Store, planned: dict) -> Data:
    prep = stage.inputs.get("data")
    committed = prep is not None and store.read_manifest(prep, planned[prep].fingerprint) is not None  # forced ones too
    return Data(store, store.output_path(prep, planned[prep].fingerprint) if committed else None, stage.cfg.data.seq_length)


def _estimate(stage: Stage, row, rows: list[dict], data: Data) -> Estimate:
    key, (work, any_work) = key_of(stage), work_of(stage, data)
    model = throughput(rows, key, _devices(stage, key["unit"]))
    busy = work.flops / model.rate if work.flops and model.rate else 0.0
    wall = model.start_s + busy + (work.decode_steps * model.step_s if model.step_s else 0.0)
    basis = model.basis
    if any_work:
        basis += "; tokens of prep's output" if data.measured else "; tokens: upper bounds from the config (prep not committed)"
    if any_work and work.flops is None:
        basis += "; FLOPs unknown (a split's size: run prep first)"
    if work.decode_steps and model.step_s is None:
        basis += "; decoding time unknown (no generation measured yet)"
    seconds, hours = wall + model.around_s, wall * model.devices / 3600
    return Estimate(stage.name, stage.kind, row.status, work.flops, work.tokens, seconds, hours, 0.0, key["unit"], basis)


def _devices(stage: Stage, unit: str) -> int:
    """What a job of `stage` holds by default: a GPU a rank, or on the CPU the cores its ranks may use."""
    res, launcher = stage.section.resources, stage.cfg.launcher
    ranks = res.nodes * res.tasks_per_node
    if unit == GPU_HOURS:
        return ranks
    if launcher.name == LauncherName.slurm:
        return ranks * launcher.cpus_per_task
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Total:
    flops: float
    seconds: float  # the longest path through the DAG
    device_hours: dict[str, float]  # by unit
    saved: dict[str, float]


def total(pipeline: Pipeline, estimates: list[Estimate]) -> Total:
    by_name, done = {e.stage: e for e in estimates}, {}
    for stage in pipeline:  # in run order: every stage after its upstream
        done[stage.name] = by_name[stage.name].seconds + max((done[u] for u in stage.upstream()), default=0.0)
    return Total(
        sum(e.flops or 0.0 for e in estimates),
        max(done.values(), default=0.0),
        _by_unit((e.unit, e.device_hours) for e in estimates),
        _by_unit((e.unit, e.saved) for e in estimates),
    )


def _by_unit(pairs) -> dict[str, float]:
    sums: dict[str, float] = {}
    for unit, hours in pairs:
        if hours:
            sums[unit] = sums.get(unit, 0.0) + hours
    return sums


def as_dict(estimates: list[Estimate], summed: Total) -> dict:
    return {"stages": [asdict(e) for e in estimates], "total": asdict(summed)}


# ----------------------------------------------------------------------------- a run's use


def usage(stages: list[dict]) -> dict[str, dict[str, float]]:
    """Device-hours a run used (stages that ran) and saved (cache hits: their outputs' recorded
    cost), by unit; `stages`: the run record's rows (`metrics`, `cached`)."""
    used = _by_unit((s["metrics"].get("device_hours_of"), s["metrics"].get("device_hours")) for s in stages if s.get("cached") is False)
    saved = _by_unit((s["metrics"].get("device_hours_of"), s["metrics"].get("device_hours")) for s in stages if s.get("cached"))
    return {"used": used, "saved": saved}


def usage_line(use: dict[str, dict[str, float]]) -> str:
    """`device-hours: used 0.0123 core-hours, saved 0.0045 core-hours (cache hits), total 0.0168 core-hours`."""

    def hours(sums: dict[str, float]) -> str:
        return " + ".join(f"{v:.4g} {unit}" for unit, v in sums.items()) or "0"

    every = _by_unit((u, v) for part in use.values() for u, v in part.items())
    return f"device-hours: used {hours(use['used'])}, saved {hours(use['saved'])} (cache hits), total {hours(every)}"
