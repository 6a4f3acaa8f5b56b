"""`nightshift report`: one self-contained runs/<id>/report.html (plotly's JS inlined, no network), from the
trace, the run branch and, where `nightshift verify` ran, verify/verify.json."""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

import git
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from agent.proposers.funnel import got_through
from agent.stages.stats import accepts, off_schedule, tokens_per_step
from agent.world.task import Acceptance
from agent.run.relaxed import describe as describe_relaxed, of_run
from traces import read_trace
from traces.schema import BenchReport, Commit, Decision, Record, RunFinished, RunStarted, TokenAudit

DIFF_LIMIT = 200_000
VERDICT_COLORS = {"keep": "#2ca02c", "discard": "#7f7f7f", "crash": "#d62728", "timeout": "#ff7f0e",
                  "unfinished": "#1f77b4"}
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;
vertical-align:top}th{background:#f4f4f4}.bad{color:#b00020;font-weight:600}.good{color:#1b5e20}
pre.diff{background:#fafafa;border:1px solid #ddd;padding:8px;font-size:12px;overflow-x:auto;max-height:600px}
pre.diff .add{color:#1b5e20;background:#e8f5e9}pre.diff .del{color:#b71c1c;background:#ffebee}
pre.diff .hunk{color:#0d47a1}.passes{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:8px}
.passes>div{min-width:0}
.note{color:#666;font-size:13px}
"""


class Figures:
    """Each figure as a div; the first carries plotly.js itself (include_plotlyjs=True), the rest reuse it."""

    def __init__(self):
        self.count = 0

    def div(self, fig: go.Figure, height: int = 360) -> str:
        # the title below the toolbar (which takes the top ~32 px), and room for the axis titles
        fig.update_layout(height=height, margin=dict(l=50, r=20, t=88, b=50), template="plotly_white",
                          title=dict(y=1, yref="container", yanchor="top", pad=dict(t=38)))
        fig.update_xaxes(automargin=True)
        fig.update_yaxes(automargin=True)
        out = fig.to_html(full_html=False, include_plotlyjs=self.count == 0, include_mathjax=False,
                          config={"displaylogo": False, "responsive": True})
        self.count += 1
        return out


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _e(value) -> str:
    return html.escape(str(value))


def _events(records: list[Record], kind: str) -> list:
    return [r.event for r in records if r.event.kind == kind]


def glance(records: list[Record], verify: dict | None) -> str:
    started: RunStarted = records[0].event
    task = started.task
    finished = next((r.event for r in reversed(records) if isinstance(r.event, RunFinished)), None)
    budget = task.get("budget", {})
    decisions = _events(records, "decision")
    elapsed = finished.seconds if finished else records[-1].time - records[0].time
    rows = [("run", _e(started.run_id)), ("task", _e(task.get("name", ""))),
            ("versions", _e(f"nightshift {started.nightshift_version}, vLLM {started.vllm_version}, torch "
                            f"{started.torch_version}, Python {started.python_version}")),
            ("platform", _e(started.platform)),
            ("GPUs", _e(", ".join(map(str, task.get("sandbox", {}).get("gpus", []))) or "none (CPU)")
             + (f" &mdash; {_e(verify['environment']['gpu'])}" if verify else "")),
            ("model", _e(f"sha256 {started.model_sha256[:16]}, {task.get('model', {}).get('dtype', '')}")),
            ("branch", _e(f"{started.branch} from {started.base_commit[:12]}")),
            ("budget used", _e(f"{len(decisions)} of {budget.get('max_candidates', '?')} candidates, "
                               f"{elapsed:.0f} s of {budget.get('wall_clock_s', '?')} s"
                               + (f", ${finished.spend_usd:.4f}" if finished and finished.spend_usd else ""))),
            ("finished", _e(f"{finished.reason}; kept {finished.kept}, cumulative {finished.best_speedup:.3f}x")
             if finished else "<span class=bad>no run_finished record</span>")]
    loosened = of_run(started)
    if loosened:
        rows.append(("relaxed checks", "<span class=bad>" + _e("; ".join(map(describe_relaxed, loosened))) + "</span>"))
    for sp in _events(records, "self_parity")[:1]:
        verdict = "identical" if sp.ok else "<span class=bad>DIFFERENT</span>"
        margins = ", ".join(f"{k} {v:g}" for k, v in (sp.margins or {}).items()) or (sp.margins_error or "not measured")
        rows.append(("self-parity", f"{sp.identical}/{sp.prompts} prompts {verdict} ({_e(sp.regime)}); "
                                    f"reference margins (nats): {_e(margins)}"))
    calibration = [a for a in _events(records, "audit") if a.calibration]
    for a in calibration[:1]:
        rows.append(("audit A/A", _e(f"{a.tokens} tokens, {a.deficits.non_top1} not the reference's top-1 "
                                     f"({a.deficits.non_top1 / max(a.tokens, 1):.1%}), max deficit "
                                     f"{a.deficits.max:.3f} nats (p99 {a.deficits.p99:.3f}), hard bound "
                                     f"{a.tolerance_nats:g} nats")))
    for n in _events(records, "noise_floor")[:1]:
        rows.append(("noise floor", _e(f"A/A speedup {n.speedup:.4f}x [{n.ci_low:.4f}, {n.ci_high:.4f}], CV "
                                       f"{n.cv_incumbent:.3%}/{n.cv_peer:.3%}, log-ratio SD {n.log_ratio_sd:.4f}, "
                                       f"MDE {n.mde_speedup:.4f}x at {n.repetitions} pairs"
                                       + (f"; {n.warning}" if n.warning else ""))))
    return "<h2>The run at a glance</h2>" + _table(rows)


def funnel_counts(records: list[Record]) -> list[tuple[str, int]]:
    decisions = [e for e in _events(records, "decision") if e.candidate > 0]
    return [("proposed", len(_events(records, "proposal"))),
            ("applied", len({e.candidate for e in _events(records, "patch_applied")})),
            ("built", len({e.candidate for e in _events(records, "build") if e.candidate > 0})),
            ("parity passed", len({e.candidate for e in _events(records, "parity") if e.ok and e.candidate > 0})),
            ("benchmarked", sum(got_through(d, "benchmark") for d in decisions)),
            ("audit passed", sum(got_through(d, "audit") for d in decisions)),
            ("kept", sum(d.verdict == "keep" for d in decisions))]


def funnel(records: list[Record], figs: Figures) -> str:
    counts = funnel_counts(records)
    fig = go.Figure(go.Funnel(y=[c[0] for c in counts], x=[c[1] for c in counts], textinfo="value"))
    fig.update_layout(title="candidates by stage (in the loop's order)")
    return "<h2>Funnel</h2>" + figs.div(fig, 380)


def _bench_label(candidate: int, confirmation: int | None) -> str:
    return f"#{candidate}" + (f" conf {confirmation}" if confirmation else "")


def speedups(records: list[Record], figs: Figures) -> str:
    started: RunStarted = records[0].event
    min_speedup = Acceptance.model_validate(started.task.get("acceptance", {})).min_speedup
    verdicts = {d.candidate: d.verdict for d in _events(records, "decision")}
    reports: list[BenchReport] = _events(records, "benchmark")
    fig = go.Figure()
    for verdict in sorted({verdicts.get(b.candidate, "unfinished") for b in reports}):
        chosen = [b for b in reports if verdicts.get(b.candidate, "unfinished") == verdict]
        fig.add_trace(go.Scatter(
            x=[_bench_label(b.candidate, b.confirmation) for b in chosen],
            y=[b.speedup for b in chosen], mode="markers", name=verdict,
            marker=dict(size=10, color=VERDICT_COLORS.get(verdict)),
            error_y=dict(type="data", symmetric=False, array=[b.ci_high - b.speedup for b in chosen],
                         arrayminus=[b.speedup - b.ci_low for b in chosen])))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#999")
    fig.add_hline(y=min_speedup, line_dash="dash", line_color="#2ca02c", annotation_text=f"min {min_speedup}x")
    order = sorted({(b.candidate, b.confirmation or 0) for b in reports})
    fig.update_layout(title="speedup per benchmark, with its interval", xaxis_title="candidate",
                      yaxis_title="speedup (x)", xaxis=dict(
                          categoryorder="array",  # by number, not by the verdict's trace each first appears in
                          categoryarray=[_bench_label(n, c) for n, c in order]))
    by_sha = {r.sha256: r for r in records}
    times, values, labels, total = [0.0], [1.0], ["start"], 1.0
    for record in records:
        if isinstance(record.event, Commit):
            decision = by_sha.get(record.event.decision_sha256)
            speedup = decision.event.speedup if decision and isinstance(decision.event, Decision) else None
            total *= speedup or 1.0
            times.append((record.time - records[0].time) / 60)
            values.append(total)
            labels.append(f"#{record.event.candidate} {record.event.commit[:8]}")
    end = next((r for r in reversed(records) if isinstance(r.event, RunFinished)), records[-1])
    times.append((end.time - records[0].time) / 60)
    values.append(total)
    labels.append("end")
    cumulative = go.Figure(go.Scatter(x=times, y=values, mode="lines+markers", line_shape="hv", text=labels,
                                      hovertemplate="%{text}: %{y:.3f}x at %{x:.1f} min"))
    cumulative.update_layout(title="cumulative speedup of the branch", xaxis_title="minutes since start",
                             yaxis_title="speedup over the base (x)")
    return "<h2>Speedups</h2>" + figs.div(fig) + figs.div(cumulative, 320)


def _value(sample, metric: str) -> float:
    value = getattr(sample, metric, None)
    return value if value is not None else sample.total_tokens_per_s


def _schedule(sample) -> str:
    if sample.engine_steps is None:
        return "engine steps: not reported"
    occupancy = tokens_per_step(sample)
    return f"{sample.engine_steps} engine steps, " + (f"{occupancy:.1f} tokens per step" if occupancy else "no tokens")


def schedule_note(b: BenchReport) -> str:
    """Each side's engine steps and batch occupancy (tokens per step) over its passes, and the passes whose
    schedule was off (agent/stages/stats.py off_schedule); empty where the servers reported no steps."""
    parts = []
    for role in ("incumbent", "candidate"):
        steps = sorted(s.engine_steps for s in b.samples if s.role == role and s.engine_steps is not None)
        occupancy = sorted(o for s in b.samples if s.role == role and (o := tokens_per_step(s)) is not None)
        if steps:
            parts.append(f"{role}: engine steps {steps[0]}-{steps[-1]} (median {steps[len(steps) // 2]}), "
                         f"{occupancy[0]:.1f}-{occupancy[-1]:.1f} tokens per step" if occupancy else
                         f"{role}: engine steps {steps[0]}-{steps[-1]}")
    if not parts:
        return ""
    flagged = off_schedule(b.samples)
    off = "; ".join(f"{role} pass {rep}: {why}" for (role, rep), why in sorted(flagged.items()))
    return (f"<p class=note>{_e('; '.join(parts))}</p>"
            + (f"<p class=bad>{_e(off)}</p>" if off else ""))


def passes(records: list[Record], figs: Figures) -> str:
    reports: list[BenchReport] = _events(records, "benchmark")
    if not reports:
        return "<h2>Per-pass samples</h2><p class=note>no candidate was benchmarked</p>"
    divs = []
    for b in reports:
        fig = go.Figure()
        flagged = off_schedule(b.samples)
        for role, color in (("incumbent", "#7f7f7f"), ("candidate", "#1f77b4")):
            chosen = [s for s in b.samples if s.role == role]
            fig.add_trace(go.Scatter(x=[s.repetition for s in chosen], y=[_value(s, b.metric) for s in chosen],
                                     mode="lines+markers", name=role, line=dict(color=color),
                                     text=[_schedule(s) for s in chosen],
                                     marker=dict(symbol=["x" if (role, s.repetition) in flagged else "circle"
                                                         for s in chosen], size=9),
                                     hovertemplate="pass %{x}: %{y:.1f}<br>%{text}"))
        fig.update_layout(title=f"#{b.candidate}" + (f" confirmation {b.confirmation}" if b.confirmation else "")
                          + f": {b.speedup:.3f}x", xaxis_title="repetition", yaxis_title=b.metric,
                          legend=dict(orientation="h", y=-0.3))
        divs.append(f"<div>{figs.div(fig, 300)}{schedule_note(b)}</div>")
    return ("<h2>Per-pass samples, incumbent against candidate</h2><p class=note>hover a pass for its engine steps "
            "and batch occupancy (tokens per step, from the server's vllm:iteration_tokens_total); a cross marks a "
            "pass whose engine ran far more steps for the same tokens than its side's median</p>"
            "<div class=passes>" + "".join(divs) + "</div>")


def numerics(records: list[Record], figs: Figures) -> str:
    started: RunStarted = records[0].event
    margins = next((sp.margins for sp in _events(records, "self_parity") if sp.margins), None)
    out = ["<h2>Margins and audit deficits</h2>"]
    fig = go.Figure()
    for name, values in (("served (reference)", margins), ("checkpoint", started.model_margins)):
        if values:
            keys = [k for k in ("p10", "median", "p90") if k in values]
            fig.add_trace(go.Bar(x=keys, y=[values[k] for k in keys], name=name,
                                 text=[f"{values[k]:.3f}" for k in keys]))
    fig.update_layout(title="top-1 minus top-2 log-prob margins (nats), quantiles", barmode="group",
                      yaxis_title="nats")
    out.append(figs.div(fig, 320))
    if margins:
        out.append(f"<p class=note>{margins.get('positions', 0):.0f} positions; "
                   f"{margins.get('below_0_1', 0):.1%} below 0.1 nats</p>")
    audits: list[TokenAudit] = _events(records, "audit")
    deficits = go.Figure()
    if audits:
        labels = [("A/A" if a.calibration else f"#{a.candidate}") + (f" conf {a.confirmation}" if a.confirmation else "")
                  for a in audits]
        for key in ("p50", "p90", "p99", "max"):
            deficits.add_trace(go.Bar(x=labels, y=[getattr(a.deficits, key) for a in audits], name=key))
        deficits.add_hline(y=audits[-1].tolerance_nats, line_dash="dash", line_color="#d62728",
                           annotation_text=f"hard bound {audits[-1].tolerance_nats:g}")
    deficits.update_layout(title="token audit: deficits below the reference's top-1 (non-top-1 positions)",
                           barmode="group", yaxis_title="nats")
    out.append(figs.div(deficits, 360))
    judged = [a for a in audits if a.control is not None]
    if judged:
        rates = go.Figure()
        labels = [f"#{a.candidate}" + (f" conf {a.confirmation}" if a.confirmation else "") for a in judged]
        rates.add_trace(go.Bar(x=labels, y=[a.deficits.non_top1 / max(a.tokens, 1) for a in judged], name="candidate",
                               text=[a.verdict.test if a.verdict else "" for a in judged]))
        rates.add_trace(go.Bar(x=labels, y=[a.control.non_top1 / max(a.control.tokens, 1) for a in judged],
                               name="control (incumbent, same benchmark)"))
        rates.update_layout(title="token audit: share of tokens not the reference's top-1, candidate against its "
                                  "control", barmode="group", yaxis_tickformat=".1%")
        out.append(figs.div(rates, 340))
    violations = [v.deficit_nats for a in audits for v in a.violations]
    if violations:
        hist = go.Figure(go.Histogram(x=violations, marker_color="#d62728", nbinsx=40))
        hist.add_vline(x=audits[-1].tolerance_nats, line_dash="dash", annotation_text="hard bound")
        hist.update_layout(title=f"deficits of the recorded violations ({len(violations)}; at most 20 per audit)",
                           xaxis_title="nats below the reference's top-1", yaxis_title="positions")
        out.append(figs.div(hist, 300))
    return "".join(out)


VERDICTS = [("regression", "#d6604d"), ("no difference", "#e6e6e6"), ("faster, under min_speedup", "#92c5de"),
            ("faster than min_speedup", "#2166ac"), ("failed", "#762a83")]
"""A verify cell's colour: what its test decides from the interval, not the point estimate."""


def cell_verdict(cell: dict, min_speedup: float) -> int:
    """The index in VERDICTS: below 1 a regression, above min_speedup a win, an interval holding 1 none."""
    s = cell["speedup"]["total_token_throughput"]
    if cell["status"] == "failed":
        return 4
    return 0 if s["ci_high"] < 1.0 else 3 if accepts(s["ci_low"], min_speedup) else 2 if s["ci_low"] > 1.0 else 1


def grid_figure(verify: dict) -> go.Figure:
    g = verify["grid"]
    min_speedup = verify.get("min_speedup", Acceptance().min_speedup)  # the task default, as everywhere
    steps = len(VERDICTS)
    scale = [[edge / steps, color] for i, (_, color) in enumerate(VERDICTS) for edge in (i, i + 1)]
    cells = {(c["input_len"], c["output_len"], c["concurrency"]): c for c in verify["cells"]}
    fig = make_subplots(rows=1, cols=len(g["output_lens"]), subplot_titles=[f"output {o}" for o in g["output_lens"]],
                        shared_yaxes=True)
    for col, o in enumerate(g["output_lens"], start=1):
        z, text = [], []
        for i in g["input_lens"]:
            row_z, row_t = [], []
            for c in g["concurrency"]:
                cell = cells[(i, o, c)]
                rel = cell.get("relative")
                row_z.append(cell_verdict(cell, min_speedup) + 0.5 if rel is not None else math.nan)
                if cell["status"] == "skipped":
                    row_t.append("skipped")
                elif rel is None:
                    row_t.append("failed")
                else:
                    s = cell["speedup"]["total_token_throughput"]
                    mark = "▼ REGRESSION<br>" if cell["regression"] else ("✗ " if cell["status"] == "failed" else "")
                    row_t.append(f"{mark}{rel:.3f}x<br>[{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
            z.append(row_z)
            text.append(row_t)
        fig.add_trace(go.Heatmap(z=z, x=[f"c={c}" for c in g["concurrency"]], y=[f"in {i}" for i in g["input_lens"]],
                                 text=text, texttemplate="%{text}", colorscale=scale, zmin=0, zmax=steps,
                                 colorbar=dict(title="the interval says", tickvals=[i + 0.5 for i in range(steps)],
                                               ticktext=[name for name, _ in VERDICTS]), showscale=col == 1,
                                 hovertemplate="%{y}, %{x}: %{text}<extra></extra>"), row=1, col=col)
    fig.update_layout(title=f"verify: relative total token throughput (head / base), per cell; coloured by its "
                            f"{verify['confidence']:.0%} interval against 1 and min_speedup {min_speedup:g}")
    return fig


def verify_section(verify: dict | None, figs: Figures) -> str:
    if not verify:
        return ("<h2>Verify grid</h2><p class=note>not run yet: <code>nightshift verify RUN</code> measures the "
                "branch against its base over a grid of lengths and concurrency</p>")
    env = verify["environment"]
    rows = [("head", _e(f"{verify['head']['ref']} ({verify['head']['commit'][:12]}), flags "
                        f"{json.dumps(verify['head']['engine_args'], sort_keys=True)}")),
            ("base", _e(f"{verify['base']['ref']} ({verify['base']['commit'][:12]}), flags "
                        f"{json.dumps(verify['base']['engine_args'], sort_keys=True)}")),
            ("environment", _e(", ".join(f"{k} {v}" for k, v in env.items()))),
            ("grid", _e(f"{verify['grid']['repetitions']} paired passes per cell, max_model_len "
                        f"{verify['grid']['max_model_len']}, parity {verify['parity_regime']}, audit tolerance "
                        f"{verify['audit_tolerance_nats']:g} nats")),
            *([("relaxed checks", "<span class=bad>" + _e("; ".join(map(describe_relaxed, verify["relaxed"])))
                + "</span>")] if verify.get("relaxed") else []),
            ("regressions", f"<span class={'bad' if verify['regressions'] else 'good'}>"
                            f"{_e(', '.join(verify['regressions']) or 'none')}</span>"),
            ("failed", _e(", ".join(verify["failed"]) or "none")),
            ("skipped", "<br>".join(_e(f"{c['key']}: {c['reason']}") for c in verify["cells"]
                                    if c["status"] == "skipped") or "none")]
    height = 140 + 70 * len(verify["grid"]["input_lens"])
    return "<h2>Verify grid</h2>" + figs.div(grid_figure(verify), height) + _table(rows)


def diffs(run_dir: Path, records: list[Record]) -> str:
    from agent.replay.chain import _open_repo

    commits = [r.event for r in records if isinstance(r.event, Commit)]
    out = ["<h2>Kept commits</h2>"]
    if not commits:
        return out[0] + "<p class=note>no commit was kept: the branch did not move</p>"
    try:
        repo = _open_repo(run_dir, records)
    except (git.GitError, git.NoSuchPathError) as exc:
        return out[0] + f"<p class=bad>the branch cannot be read: {_e(exc)}</p>"
    for commit in commits:
        try:
            text = repo.git.show("--stat", "--patch", "--format=%H%n%s%n%n%b", commit.commit)
        except git.GitCommandError as exc:
            text = f"cannot show {commit.commit}: {exc}"
        if len(text) > DIFF_LIMIT:
            text = text[:DIFF_LIMIT] + f"\n... ({len(text) - DIFF_LIMIT} more characters)"
        out.append(f"<h3>#{commit.candidate} {commit.commit[:12]}</h3><pre class=diff>{_colored(text)}</pre>")
    return "".join(out)


def notebook(records: list[Record]) -> str:
    """The LLM proposer's lab notebook, one paragraph a candidate (none: no section)."""
    entries = _events(records, "notebook")
    if not entries:
        return ""
    return "<h2>Lab notebook</h2>" + "".join(f"<p id=notebook-{e.candidate}>{_e(e.summary)}</p>" for e in entries)


def _colored(text: str) -> str:
    lines = []
    for line in text.splitlines():
        css = ("add" if line.startswith("+") and not line.startswith("+++") else
               "del" if line.startswith("-") and not line.startswith("---") else
               "hunk" if line.startswith("@@") else "")
        lines.append(f"<span class={css}>{_e(line)}</span>" if css else _e(line))
    return "\n".join(lines)


def load_verify(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "verify" / "verify.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_report(run_dir: Path) -> Path:
    """runs/<id>/report.html; a folder with only a verify/ (verify on a checkout) gets the grid alone."""
    run_dir = Path(run_dir)
    verify = load_verify(run_dir)
    figs = Figures()
    if (run_dir / "trace.jsonl").is_file():
        records = read_trace(run_dir / "trace.jsonl")
        title = f"nightshift run {records[0].event.run_id}"
        body = [glance(records, verify), funnel(records, figs), speedups(records, figs), passes(records, figs),
                numerics(records, figs), verify_section(verify, figs), notebook(records), diffs(run_dir, records)]
    else:
        title = f"nightshift {verify['run_id'] if verify else run_dir.name}"
        body = [verify_section(verify, figs)]
    page = (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>{''.join(body)}</body></html>")
    path = run_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
