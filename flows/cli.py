"""The `align` command. Everything after the verb is a Hydra override.

  align demo                          build the offline demo assets (tokenizer, tiny model, data)
  align plan   [--json] [overrides...] the DAG: fingerprints, output URIs, what would run and why;
                                      each training stage's estimated memory per rank; each
                                      stage's predicted FLOPs, time and device-hours, and the total
  align config [overrides...]         the resolved config and each stage instance's, secrets masked
  align run    [overrides...]         run the `align` flow (Prefect; ephemeral without PREFECT_API_URL);
                                      exits 1 where the gate (gate.thresholds) finds a regression
  align compare [--json] RUN_A RUN_B [overrides...]
                                      two runs' stages side by side: which differ, why, headline metrics
  align gc     [--yes] [--json] [overrides...]
                                      what the store could reclaim (store.retention), per category;
                                      --yes deletes it

`pipeline=NAME` picks the pipeline (conf/pipeline/NAME.yaml); `force=[prep]` re-runs stages.
"""

import argparse
import json
import os
import sys
from dataclasses import asdict
from functools import partial

# Prefect's ephemeral server needs more than its default start-up time on 2 cores, and
# nothing here should phone home. Set before prefect is imported.
for _key, _value in {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}.items():
    os.environ.setdefault(_key, _value)

import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.filesize import decimal  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from alignflow import __version__  # noqa: E402
from alignflow.orchestrator import cost  # noqa: E402
from alignflow.orchestrator.config.compose import ConfigError, build, compose  # noqa: E402
from alignflow.orchestrator.config.slices import masked  # noqa: E402
from alignflow.orchestrator.config.validate import memory_estimates  # noqa: E402
from alignflow.orchestrator.gate import REGRESSED  # noqa: E402
from alignflow.orchestrator.gc import CATEGORIES, reclaim, survey  # noqa: E402
from alignflow.orchestrator.pipeline import Pipeline  # noqa: E402
from alignflow.orchestrator.runner import plan  # noqa: E402
from alignflow.orchestrator.store import store_of  # noqa: E402

console = Console(soft_wrap=True)
LAST_UPDATES_S = 30.0  # the wait for the UI's updates queued as a flow run ended
_STATUS_STYLE = {"committed": "green", "run": "yellow", "forced": "magenta"}


def _split(overrides: list[str]) -> tuple[str | None, list[str]]:
    """`pipeline=X` becomes the flow's pipeline parameter; the rest stay Hydra overrides."""
    pipeline = next((o.split("=", 1)[1] for o in overrides if o.startswith("pipeline=")), None)
    return pipeline, [o for o in overrides if not o.startswith("pipeline=")]


def cmd_demo(args: argparse.Namespace) -> int:
    from alignflow.orchestrator.demo import build

    cfg = compose(None, args.overrides, check_paths=False)
    dest = build(cfg.paths.demo)
    console.print(f"demo assets in {dest}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    pipeline, overrides = _split(args.overrides)
    stages = build(pipeline, overrides, check_paths=False)
    shown = masked(stages.cfg)
    shown["instances"] = {
        stage.name: {
            "kind": stage.kind,
            "inputs": {r: list(u) if isinstance(u, tuple) else u for r, u in stage.inputs.items()},
            stage.kind: masked(stage.cfg, (stage.kind,))[stage.kind],
        }
        for stage in stages
    }  # each instance's effective config
    console.print(yaml.safe_dump(shown, sort_keys=False), end="", markup=False, highlight=False)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    pipeline, overrides = _split(args.overrides)
    try:
        stages = build(pipeline, overrides)
    except ConfigError as err:
        if args.json:
            raise
        try:  # what the model's shape alone says (a preset's, before its checkpoint is downloaded)
            light = build(pipeline, overrides, check_paths=False)
        except ConfigError as found:  # a layout that cannot fit is said beside a checkpoint that is not there
            raise (err if str(found) == str(err) else ConfigError(_together(err, found))) from None
        _print_memory(memory_estimates(light, check_paths=False), light.cfg.launcher.gpu_memory_gib)
        raise
    cfg = stages.cfg
    memory = memory_estimates(stages)
    planned = plan(stages)
    predicted = cost.predict(stages, planned)
    summed = cost.total(stages, predicted)
    store = survey(store_of(cfg), cfg)
    if args.json:
        print(
            json.dumps(
                {
                    "stages": [asdict(row) for row in planned],
                    "store": store.as_dict(items=False),
                    "cost": cost.as_dict(predicted, summed),
                    "memory": {
                        name: {**m.footprint.gib(), "stage": m.footprint.stage, "layout": asdict(m.layout), "shape_from": m.shape_from}
                        for name, m in memory.items()
                    },
                },
                indent=2,
            )
        )
        return 0
    _print_memory(memory, cfg.launcher.gpu_memory_gib)
    table = Table(title=f"align plan: {cfg.pipeline.name}  (store {cfg.store.root})")
    for column in ("stage", "kind", "status", "fingerprint", "output", "why"):
        table.add_column(column, overflow="fold")
    for row in planned:
        style = _STATUS_STYLE.get(row.status, "")
        table.add_row(row.stage, row.kind, f"[{style}]{row.status}[/]", row.fingerprint, row.uri, row.reason)
    Console(width=max(console.width, 160)).print(table)
    _print_cost(predicted, summed)
    console.print(store.line(), markup=False, highlight=False)
    return 0


def _print_cost(predicted: list, summed) -> None:
    """Each stage's predicted model FLOPs, time and device-hours (`alignflow.orchestrator.cost`), and the total."""
    table = Table(title="predicted compute (alignflow/orchestrator/cost.py)", title_justify="left")
    for column in ("stage", "FLOPs", "tokens", "time", "device-hours", "saved (cache hit)", "from"):
        table.add_column(column, overflow="fold", justify="left" if column in ("stage", "from") else "right")
    for e in predicted:
        table.add_row(
            e.stage,
            _si(e.flops),
            _si(e.tokens),
            _duration(e.seconds),
            f"{e.device_hours:.3g} {e.unit}" if e.device_hours else "-",
            f"{e.saved:.3g} {e.unit}" if e.saved else "-",
            e.basis,
        )
    hours = ", ".join(f"{v:.3g} {u}" for u, v in summed.device_hours.items()) or "-"
    saved = ", ".join(f"{v:.3g} {u}" for u, v in summed.saved.items()) or "-"
    table.add_row("[bold]total[/]", _si(summed.flops or None), "", _duration(summed.seconds), hours, saved, "time: the longest path of the DAG")
    Console(width=max(console.width, 160)).print(table)


def _si(value: float | None) -> str:
    """1.23e15 -> `1.23 P`."""
    if value is None:
        return "-"
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    return "-" if not seconds else f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _together(*errors: ConfigError) -> str:
    """The problems of several refusals of one config, each once."""
    head = "invalid config:"
    lines = [line for err in errors for line in (str(err).splitlines()[1:] if str(err).startswith(head) else [f"  - {err}"])]
    return "\n".join([head, *dict.fromkeys(lines)])


def _print_memory(memory: dict, limit_gib: float | None) -> None:
    """Each training stage's estimated per-rank memory (`alignflow.orchestrator.config.memory`) in GiB."""
    if not memory:
        return
    table = Table(
        title=f"estimated memory per rank in GiB (alignflow/orchestrator/config/memory.py), launcher.gpu_memory_gib: {limit_gib}",
        title_justify="left",
    )
    for column in ("stage", "layout", "weights", "gradients", "optimizer", "activations", "total", "shape from"):
        table.add_column(column, overflow="fold", justify="left" if column in ("stage", "layout", "shape from") else "right")
    for name, m in memory.items():
        lay, g = m.layout, m.footprint.gib()
        layout = (
            f"TP{lay.tp} PP{lay.pp}{f' VP{lay.vpp}' if lay.vpp else ''}{f' EP{lay.ep}' if lay.ep > 1 else ''} DP{lay.dp}, "
            f"micro {lay.micro_batch} x {lay.seq_length}, {'bf16' if lay.bf16 else 'fp32'}, recompute {lay.recompute}"
            f"{', dist. optimizer' if lay.distributed_optimizer else ''}{', LoRA' if lay.lora_params is not None else ''}"
        )
        over = limit_gib and g["total"] > limit_gib
        table.add_row(
            name,
            layout,
            *(f"{g[k]:.3g}" for k in ("weights", "gradients", "optimizer", "activations")),
            f"[red]{g['total']:.3g}[/]" if over else f"{g['total']:.3g}",
            m.shape_from,
        )
    Console(width=max(console.width, 160)).print(table)


def cmd_run(args: argparse.Namespace) -> int:
    from flows.align import align_validated

    pipeline, overrides = _split(args.overrides)
    pipeline = pipeline or "sft_dpo"
    stages = build(pipeline, overrides)  # a config error fails fast, before Prefect starts; the flow takes what was built
    try:
        state = align_validated(stages, pipeline, overrides)
        if state.name == REGRESSED:  # the stages' outputs are committed; the gate found a metric dropped
            console.print(f"[red]Regressed[/] {escape(state.message or '')}", highlight=False)
            return 1
        results = state.result()
    except Exception as err:
        if not _api_unreachable(err):
            raise
        return _finished_without_api(stages, err)
    finally:
        _ui_caught_up()
    console.print("\n[bold]outputs[/]")
    for stage, result in results.items():
        console.print(f"  {stage:<13} {'cache hit' if result.cached else 'ran':<9} {result.uri}")
    console.print(cost.usage_line(cost.usage([{"metrics": r.metrics, "cached": r.cached} for r in results.values()])), highlight=False)
    return 0


def _ui_caught_up() -> None:
    """Give the UI's last updates, queued as the flow ended, half a minute more (the flow run
    itself waited `flows.align.DRAIN_S` for a Prefect API that was down)."""
    from tasks import dashboard

    if missed := dashboard.drain(LAST_UPDATES_S):
        console.print(
            f"[yellow]the Prefect UI missed {len(missed)} updates of this run ({', '.join(missed[:5])}): its API did not come back in time[/]",
            highlight=False,
        )


def _api_unreachable(err: BaseException | None) -> bool:
    """Whether `err` (or what caused it) is the Prefect API not answering."""
    import httpx

    while err is not None:
        if isinstance(err, httpx.TransportError):
            return True
        err = err.__cause__ or err.__context__
    return False


def _finished_without_api(stages: Pipeline, err: Exception) -> int:
    """The run could not tell Prefect how it ended: the store says what it did."""
    planned = plan(stages)
    done = [row for row in planned if row.status == "committed"]
    console.print(
        f"[yellow]the Prefect API ({os.environ.get('PREFECT_API_URL', 'ephemeral')}) stopped answering ({err}); "
        "the UI does not show how this run ended.[/] From the store:",
        highlight=False,
    )
    for row in planned:
        console.print(f"  {row.stage:<13} {'committed' if row.status == 'committed' else 'not committed':<13} {row.uri}")
    return 0 if len(done) == len(planned) else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from alignflow.orchestrator import runs

    _, overrides = _split(args.overrides)
    store = store_of(compose(None, overrides, check_paths=False))  # store.root and its options, as the runs had them
    try:
        a, b = runs.read(store, args.run_a), runs.read(store, args.run_b)
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    rows = runs.compare(store, a, b)
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2, default=str))
        return 0
    table = Table(title=f"align compare\n  A: {a['name']}\n  B: {b['name']}", title_justify="left")
    for column in ("stage", "kind", "A", "B", "why", "headline metrics (A -> B)"):
        table.add_column(column, overflow="fold")
    for row in rows:
        fingerprints = (row.a, row.b) if not row.same else (row.a, "[green]same[/]")
        metrics = ", ".join(f"{k} {_value(x)} -> {_value(y)}" for k, (x, y) in row.metrics.items())
        table.add_row(row.stage, row.kind, *fingerprints, escape("; ".join(row.why)), escape(metrics))
    Console(width=max(console.width, 160)).print(table)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    _, overrides = _split(args.overrides)
    cfg = compose(None, overrides, check_paths=False)  # store.root, its options and store.retention
    store = store_of(cfg)
    found = survey(store, cfg)
    deleted = reclaim(store, found, cfg.store.lease_ttl_s) if args.yes else None
    if args.json:
        print(json.dumps(found.as_dict() | {"dry_run": deleted is None, "deleted": [i.path for i in deleted or []]}, indent=2))
        return 0
    say, root = partial(console.print, markup=False, highlight=False), store.path()
    say(
        f"align gc: {found.root} "
        + ("(deleted what is listed)" if deleted is not None else "(dry run: nothing deleted; `align gc --yes` deletes what is listed)")
    )
    for category in CATEGORIES:
        items = [i for i in found.reclaim if i.category == category]
        say(f"  {category:<12} {len(items):>4}  {decimal(sum(i.bytes for i in items)):>10}")
        for item in items:
            skipped = "  (skipped: its lease is live now)" if deleted is not None and item not in deleted else ""
            say(f"      {item.path[len(root) + 1 :]}  {decimal(item.bytes)}  {item.why}{skipped}")
    done = found.reclaim if deleted is None else deleted
    say(f"{'would reclaim' if deleted is None else 'reclaimed'} {decimal(sum(i.bytes for i in done))} of {decimal(found.bytes)}")
    for why, count in found.kept.items():
        say(f"  kept {count}: {why}")
    for path, nbytes in found.foreign.items():
        say(f"  not alignflow's, left alone: {path} ({decimal(nbytes)})")
    return 0


def _value(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="align", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"alignflow {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name, fn in (("run", cmd_run), ("plan", cmd_plan), ("config", cmd_config), ("demo", cmd_demo), ("compare", cmd_compare), ("gc", cmd_gc)):
        sub = verbs.add_parser(name, help=fn.__name__)
        if name == "compare":
            sub.add_argument("run_a", help="a run's name as the Prefect UI shows it (or its record's file name under {store.root}/_runs)")
            sub.add_argument("run_b")
        sub.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. pipeline=sft_dpo data.seq_length=512")
        sub.set_defaults(fn=fn)
        if name in ("plan", "compare", "gc"):
            sub.add_argument("--json", action="store_true", help="as JSON")
        if name == "gc":
            sub.add_argument("--yes", action="store_true", help="delete what it lists (default: a dry run, nothing deleted)")
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as err:
        console.print(f"[red]error:[/] {escape(str(err))}", markup=True, highlight=False)  # '[a, b]' in a message is text
        return 2


if __name__ == "__main__":
    sys.exit(main())
