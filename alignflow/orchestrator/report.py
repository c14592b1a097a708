"""Curves of a training stage, where a person looks: a Prefect markdown artifact and report.html.

- `curves_markdown`: one row per metric (first, last, min, max and a sparkline of the whole
  run in Unicode block characters, which every markdown renderer shows, Prefect's UI included:
  no image, no script);
- `stage_report`: a self-contained report.html for the stage's output: an inline SVG chart per
  metric, how well it used the hardware (tokens/s, TFLOP/s, MFU, peak memory), the headline
  metrics and the config, no external file or script, so it opens offline;
- `pipeline_report`: one page for a pipeline run linking every stage's report, and the
  trend of its metrics across the runs of its series (`trend_markdown` says the same in markdown).

Orchestrator side: no torch, no prefect; the records are metrics.jsonl's.
"""

import html
import json

import fsspec

from alignflow.job.train.utilization import HARDWARE_METRICS, PEAK_SOURCE

METRICS = "metrics.jsonl"  # written by the training stages (alignflow.job.train.metrics)
REPORT = "report.html"


def read_metrics(output: str, storage_options: dict | None = None) -> list[dict]:
    """The records of an output's (or staging folder's) metrics.jsonl; none if it has none."""
    try:
        with fsspec.open(f"{output.rstrip('/')}/{METRICS}", "r", **(storage_options or {})) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 40
CURVES = ("loss", "val_loss", "reward_mean", "accuracy", "reward_accuracy", "val_reward_accuracy", "kl", "grad_norm", "lr")


def series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (steps, values)} for the metrics worth a curve, in CURVES' order."""
    out = {}
    for name in CURVES:
        points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float)) and r[name] == r[name]]
        if len(points) >= 2:
            out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def sparkline(values: list[float], width: int = SPARK_POINTS) -> str:
    picked = [values[round(i * (len(values) - 1) / (width - 1))] for i in range(width)] if len(values) > width else values
    low, high = min(picked), max(picked)
    span = (high - low) or 1.0
    return "".join(BLOCKS[min(int((v - low) / span * len(BLOCKS)), len(BLOCKS) - 1)] for v in picked)


def curves_markdown(stage: str, records: list[dict]) -> str:
    rows = [
        f"# {stage}: curves over {records[-1]['step'] if records else 0} steps",
        "",
        "| metric | first | last | min | max | curve |",
        "|---|---|---|---|---|---|",
    ]
    for name, (_, values) in series(records).items():
        rows.append(f"| {name} | {values[0]:.4g} | {values[-1]:.4g} | {min(values):.4g} | {max(values):.4g} | `{sparkline(values)}` |")
    return "\n".join(rows)


def svg_chart(name: str, steps: list[int], values: list[float], width: int = 420, height: int = 160, x_label: str = "step") -> str:
    pad, low, high = 34, min(values), max(values)
    span, step_span = (high - low) or 1.0, (steps[-1] - steps[0]) or 1
    x = lambda s: pad + (s - steps[0]) / step_span * (width - 2 * pad)  # noqa: E731
    y = lambda v: height - pad - (v - low) / span * (height - 2 * pad)  # noqa: E731
    points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in zip(steps, values))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="{name}">'
        f'<rect width="100%" height="100%" fill="#fff" stroke="#ddd"/>'
        f'<text x="{pad}" y="16" font-size="13" font-family="sans-serif">{html.escape(name)}</text>'
        f'<text x="4" y="{pad}" font-size="10" font-family="sans-serif">{high:.4g}</text>'
        f'<text x="4" y="{height - pad}" font-size="10" font-family="sans-serif">{low:.4g}</text>'
        f'<text x="{pad}" y="{height - 8}" font-size="10" font-family="sans-serif">{x_label} {steps[0]}</text>'
        f'<text x="{width - pad - 50}" y="{height - 8}" font-size="10" font-family="sans-serif">{x_label} {steps[-1]}</text>'
        f'<polyline fill="none" stroke="#2563eb" stroke-width="2" points="{points}"/></svg>'
    )


def stage_report(stage: str, manifest: dict, records: list[dict], table=None) -> str:
    """`table`: the kind's table of its output (`alignflow.orchestrator.kinds.spec.Table`), shown first."""
    charts = "".join(svg_chart(name, steps, values) for name, (steps, values) in series(records).items())
    metrics = manifest.get("metrics", {})
    return _page(
        f"{stage} {manifest.get('fingerprint', '')}",
        f"<h1>{html.escape(stage)} <small>{html.escape(manifest.get('kind', ''))} {manifest.get('fingerprint', '')}</small></h1>"
        f"{rows_table(table.title, table.rows) if table is not None else ''}"
        f"<div class='charts'>{charts or ('' if table is not None else '<p>no curves: the stage logs no steps</p>')}</div>"
        f"{hardware_table(metrics)}<h2>metrics</h2>{_table(metrics)}"
        f"<h2>config</h2><pre>{html.escape(json.dumps(manifest.get('config', {}), indent=2))}</pre>",
    )


def hardware_table(metrics: dict) -> str:
    """How well the stage used its hardware, from the metrics that say it (training and forward stages)."""
    shown = {k: ("n/a (no known peak: CPU or an unlisted device)" if metrics[k] is None else metrics[k]) for k in HARDWARE_METRICS if k in metrics}
    return f"<h2>hardware use</h2>{_table(shown)}<p>MFU against the {PEAK_SOURCE}.</p>" if shown else ""


def rows_table(title: str, rows: list[dict]) -> str:
    """A titled table of `rows`, a column per key any row has."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(row.get(c, '')))}</td>" for c in columns) + "</tr>" for row in rows)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def _table(metrics: dict) -> str:
    return "<table>" + "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_fmt(v))}</td></tr>" for k, v in metrics.items()) + "</table>"


def pipeline_report(title: str, stages: list[dict], trend: list[tuple[str, dict]] | None = None, gate: str = "") -> str:
    """`stages`: {name, kind, state, fingerprint, uri, metrics} per stage, in pipeline order (no uri: no output);
    `trend`: (run name, {metric: value}) per run of the series, oldest first; `gate`: its verdict, a line."""
    rows = "".join(
        f"<tr><td>{_link(s['name'], s['uri'])}</td><td>{html.escape(s['kind'])}</td>"
        f"<td>{html.escape(s['state'])}</td><td><code>{s['fingerprint']}</code></td>"
        f"<td>{html.escape(', '.join(f'{k}={_fmt(v)}' for k, v in list(s['metrics'].items())[:4]))}</td></tr>"
        for s in stages
    )
    return _page(
        title,
        f"<h1>{html.escape(title)}</h1><table><tr><th>stage</th><th>kind</th><th>state</th><th>fingerprint</th>"
        f"<th>headline metrics</th></tr>{rows}</table>{f'<p>{html.escape(gate)}</p>' if gate else ''}"
        f"{trend_html(trend or [])}",
    )


def _trend_series(trend: list[tuple[str, dict]]) -> dict[str, tuple[list[int], list[float]]]:
    """{metric: (run numbers, values)}, 1 the oldest run shown; runs without the metric left out."""
    names = dict.fromkeys(k for _, metrics in trend for k in metrics)
    return {k: ([i for i, (_, m) in enumerate(trend, 1) if k in m], [m[k] for _, m in trend if k in m]) for k in names}


def trend_html(trend: list[tuple[str, dict]]) -> str:
    """A chart per metric across the runs (x: run number, listed below), where there are two runs or more."""
    if len(trend) < 2:
        return ""
    charts = "".join(svg_chart(k, runs, values, x_label="run") for k, (runs, values) in _trend_series(trend).items() if len(values) >= 2)
    listed = "".join(f"<li>{html.escape(name)}</li>" for name, _ in trend)
    return f"<h2>trend over the last {len(trend)} runs</h2><div class='charts'>{charts}</div><ol>{listed}</ol>"


def trend_markdown(title: str, trend: list[tuple[str, dict]]) -> str:
    """A row per run (oldest first), a column per metric, and a sparkline per metric below."""
    columns = _trend_series(trend)
    rows = [f"# {title}", "", f"| run | {' | '.join(columns)} |", f"|---|{'---|' * len(columns)}"]
    rows += [f"| {name} | {' | '.join(_fmt(m[k]) if k in m else '-' for k in columns)} |" for name, m in trend]
    rows.append(f"| trend | {' | '.join(f'`{sparkline(values)}`' for _, values in columns.values())} |")
    return "\n".join(rows)


def _link(name: str, uri: str) -> str:
    """The stage's report, where it has an output."""
    return f"<a href='{html.escape(uri)}/{REPORT}'>{html.escape(name)}</a>" if uri else html.escape(name)


def _page(title: str, body: str) -> str:
    style = (
        "body{font-family:sans-serif;margin:2em;max-width:1400px}.charts{display:flex;flex-wrap:wrap;gap:12px}"
        "td,th{padding:2px 10px;text-align:left;border-bottom:1px solid #eee}pre{background:#f6f6f6;padding:1em}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>{body}</body></html>"
    )


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
