"""The study's report: one self-contained HTML file, rendered from a ``StudyAnalysis``.

``analysis.study`` computes every figure from ``results.jsonl`` (and ``run.json``, ``quality.json``) and
``prose`` words the verdict; this module writes ``summary.json`` (the analysis as JSON) and draws the plots
and the HTML from it, so ``cartspec report --run DIR`` rebuilds the same report at any time.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

from markupsafe import Markup

from ..analysis.cost_model import PointPrediction
from ..analysis.models import StudyAnalysis, StudyRow
from ..analysis.study import analyse_run
from ..quality.models import QualityReport
from .classes import by_class_html
from .prose import with_prose
from .quality import quality_html
from .template import render_html


@dataclass
class Report:
    html: Path
    summary: Path
    verdict: str
    rows: list[StudyRow]
    analysis: StudyAnalysis


# --- plots ------------------------------------------------------------------------


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _series(rows, key):
    """deployment -> sorted [(load, value)], per (temperature, request_set) panel."""
    panels: dict[tuple, dict[str, list]] = {}
    for r in rows:
        if not r.ok or getattr(r, key) is None:
            continue
        panels.setdefault((r.temperature, r.request_set), {}).setdefault(r.deployment, []).append(
            (r.load_value, getattr(r, key)))
    for p in panels.values():
        for d in p:
            p[d].sort()
    return dict(sorted(panels.items()))


def _load_ticks(ax, rows) -> None:
    """Log-2 load axis labelled with the loads themselves (1, 2, 4...), not powers."""
    loads = sorted({r.load_value for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{x:g}" for x in loads])
    ax.minorticks_off()


def _xlabel(rows) -> str:
    return "concurrency (requests in flight)" if all(r.mode == "closed" for r in rows) else "arrival rate (req/s)"


@dataclass
class Figure:
    """One plot of the report: an inline PNG with its anchor, title and caption."""

    id: str
    title: str
    caption: str
    src: str


def plots(rows: list[StudyRow], slo: float) -> list[Figure]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figs = []
    ok = [r for r in rows if r.ok]
    if not ok:
        return figs
    xl = _xlabel(ok)
    deps = sorted({r.deployment for r in ok}, key=lambda d: (d != "baseline", d))
    colours = {d: plt.cm.tab10(i % 10) for i, d in enumerate(deps)}

    def line_panels(key, title, ylabel, fmt=None, extra=None, second=None):
        panels = _series(ok, key)
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False, layout="constrained")
        for ax, ((temp, rs), series) in zip(axes[0], panels.items()):
            for d, pts in series.items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colours[d], label=d)
            if second:
                for d, pts in _series(ok, second).get((temp, rs), {}).items():
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", color=colours[d], alpha=0.6)
            if extra:
                extra(ax)
            ax.set_ylim(bottom=0)
            _load_ticks(ax, ok)
            ax.set_xlabel(xl)
            ax.set_ylabel(ylabel)
            ax.set_title(f"T={temp:g}, {rs}")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title)
        return fig

    figs.append(Figure(title="Output throughput vs load", id="throughput",
                       caption="Output tokens per second of wall time, per deployment.",
                       src=_png(line_panels("output_throughput", "Output throughput", "tokens/s"))))
    figs.append(Figure(title="E2EL p50 (solid) and p99 (dashed) vs load", id="latency",
                       caption=f"End-to-end latency per request; the red line is the {slo:g} s SLO.",
                       src=_png(line_panels("e2el_p50", "E2EL p50 / p99", "seconds", second="e2el_p99",
                                            extra=lambda ax: ax.axhline(slo, color="red", lw=0.8)))))
    figs.append(Figure(title="TTFT p50 (solid, left) and TPOT p50 (dashed, right) vs load", id="ttft-tpot",
                       caption="TTFT is start → first content chunk; TPOT is (E2EL − TTFT)/(tokens − 1).",
                       src=_png(_ttft_tpot(ok, colours, xl))))
    figs.append(Figure(title=f"Goodput under the {slo:g} s E2EL SLO", id="goodput",
                       caption="Requests per second that met the SLO (errors never do).",
                       src=_png(line_panels("goodput", "Goodput", "req/s"))))

    spec = [r for r in ok if r.speedup_vs_baseline is not None and r.method != "none"]
    if spec:
        temps = sorted({r.temperature for r in spec})
        labels = sorted({r.deployment for r in spec}, key=lambda d: (
            next(r.gamma or 0 for r in spec if r.deployment == d), d))
        loads = sorted({r.load_value for r in spec})
        fig, axes = plt.subplots(1, len(temps), figsize=(len(temps) * (1.1 * len(loads) + 4.5),
                                                         0.6 * len(labels) + 2.4),
                                 squeeze=False, layout="constrained")
        for ax, temp in zip(axes[0], temps):
            grid = np.full((len(labels), len(loads)), np.nan)
            for r in spec:
                if r.temperature == temp:
                    grid[labels.index(r.deployment), loads.index(r.load_value)] = r.speedup_vs_baseline
            from matplotlib.colors import TwoSlopeNorm

            finite = grid[np.isfinite(grid)]
            lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (1.0, 1.0)
            # white at 1.0 (no change), red below, green above, whatever the range
            norm = TwoSlopeNorm(vmin=min(lo, 0.95), vcenter=1.0, vmax=max(hi, 1.05))
            im = ax.imshow(grid, cmap="RdYlGn", norm=norm, aspect="auto")
            for i in range(len(labels)):
                for j in range(len(loads)):
                    if np.isfinite(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=9)
            ax.set_xticks(range(len(loads)), [f"{x:g}" for x in loads])
            ax.set_yticks(range(len(labels)), labels)
            ax.set_xlabel(xl)
            ax.set_title(f"T={temp:g}")
            fig.colorbar(im, ax=ax, shrink=0.8)
        fig.suptitle("Speedup over baseline (output throughput ratio; >1 is faster)")
        figs.append(Figure(title="Speedup heatmap: γ × load × temperature", id="speedup",
                           caption="Each cell: deployment's output throughput / baseline's at the same load and T.",
                           src=_png(fig)))

    acc = [r for r in ok if r.acceptance_per_position and r.method != "none"]
    if acc:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
        labels = sorted({(r.deployment, r.temperature) for r in acc})
        width = 0.8 / len(labels)
        for k, (d, temp) in enumerate(labels):
            pts = [r for r in acc if r.deployment == d and r.temperature == temp]
            n = max(len(r.acceptance_per_position) for r in pts)
            mean = [np.mean([r.acceptance_per_position[i] for r in pts if len(r.acceptance_per_position) > i])
                    for i in range(n)]
            ax1.bar(np.arange(n) + k * width, mean, width, label=f"{d}, T={temp:g}", color=colours[d],
                    hatch="//" if temp > 0 else None, edgecolor="white" if temp > 0 else None)
        ax1.set_ylabel("accepted / drafts")
        ax1.set_title("Acceptance per position (mean over loads)")
        ax1.legend(fontsize=8)
        npos = max(len(r.acceptance_per_position) for r in acc)
        ax1.set_xticks(np.arange(npos) + width * (len(labels) - 1) / 2, [str(i + 1) for i in range(npos)])
        ax1.set_xlabel("draft position")
        ax1.set_ylim(0, 1)
        acc_panels = _series(acc, "acceptance_rate")
        temp0 = None
        if acc_panels:
            (temp0, _rs), series = next(iter(acc_panels.items()))
            for d, pts in series.items():
                ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colours[d], label=d)
        _load_ticks(ax2, acc)
        ax2.set_ylim(0, 1)
        ax2.set_xlabel(xl)
        ax2.set_ylabel("accepted / proposed")
        ax2.set_title(f"Acceptance rate vs load (T={temp0:g})" if temp0 is not None else "Acceptance rate")
        ax2.grid(alpha=0.3)
        figs.append(Figure(title="Acceptance", id="acceptance",
                           caption="From vLLM's /metrics counters, differenced around each point (warm-up excluded).",
                           src=_png(fig)))
    return figs


def _ttft_tpot(ok, colours, xl):
    import matplotlib.pyplot as plt

    ttft, tpot = _series(ok, "ttft_p50"), _series(ok, "tpot_p50")
    fig, axes = plt.subplots(1, len(ttft) or 1, figsize=(5.6 * max(len(ttft), 1), 3.6), squeeze=False, layout="constrained")
    for ax, (panel, series) in zip(axes[0], ttft.items()):
        right = ax.twinx()
        for d, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colours[d], label=d)
        for d, pts in tpot.get(panel, {}).items():
            right.plot([p[0] for p in pts], [1000 * p[1] for p in pts], "s--", color=colours[d], alpha=0.6)
        _load_ticks(ax, ok)
        ax.set_xlabel(xl)
        ax.set_ylabel("TTFT p50 (s, solid)")
        right.set_ylabel("TPOT p50 (ms, dashed)")
        ax.set_title(f"T={panel[0]:g}, {panel[1]}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return fig


# --- the cost model ----------------------------------------------------------------------------------


def _cost_model_plot(preds: list[PointPrediction]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.6), layout="constrained")
    deps = sorted({p.deployment for p in preds}, key=lambda d: (d != "baseline", d))
    for i, d in enumerate(deps):
        for temp, marker in ((0.0, "o"), (None, "^")):
            pts = [p for p in preds if p.deployment == d and ((p.temperature == 0) == (temp == 0.0))]
            if pts:
                ax.scatter([p.measured for p in pts], [p.predicted for p in pts], marker=marker,
                           color=plt.cm.tab10(i % 10), label=f"{d}, {'T=0' if temp == 0.0 else 'T>0'}")
    lo = min(min(p.measured, p.predicted) for p in preds) * 0.9
    hi = max(max(p.measured, p.predicted) for p in preds) * 1.1
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, label="predicted = measured")
    if hi / lo > 8:  # one stream and thirty-two differ tenfold: equal relative errors look equal
        from matplotlib.ticker import FuncFormatter

        plain = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "125" else "")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured output tokens/s")
    ax.set_ylabel("predicted output tokens/s")
    ax.set_title("Cost model: predicted vs measured")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


# --- the whole report ---------------------------------------------------------------------------------


def render_report(analysis: StudyAnalysis, run_dir: str | Path) -> Report:
    """Write ``summary.json`` and ``report.html`` for ``analysis`` into ``run_dir``."""
    run_dir = Path(run_dir)
    summary_path = analysis.save(run_dir)
    quality = analysis.quality_report()
    cost = analysis.cost_model
    cost_plot = _cost_model_plot(cost.points) if cost.fitted and cost.points else None
    html_path = run_dir / "report.html"
    html_path.write_text(render_html(
        summary=analysis, figures=plots(analysis.points, analysis.slo_e2el_s), rows=analysis.points,
        caps=analysis.capacity, comparison=analysis.published_comparison, verdict=analysis.verdict,
        slo=analysis.slo_e2el_s, target=analysis.target_rps, tests=analysis.quality_tests, cost=cost,
        cost_plot=cost_plot, adaptive=analysis.adaptive, pairs=analysis.hybrid_pairs or [],
        by_class_html=Markup(by_class_html(analysis.acceptance_by_class)), quality_html=_quality_html(quality)))
    return Report(html=html_path, summary=summary_path, verdict=analysis.verdict, rows=analysis.points,
                  analysis=analysis)


def _quality_html(quality: QualityReport | None):
    return Markup(quality_html(quality)) if quality else ""


def build_report(run_dir: str | Path, target_rps: float | None = None, slo: float | None = None) -> Report:
    """Analyse a run directory and render its report (``cartspec report --run DIR``)."""
    return render_report(with_prose(analyse_run(run_dir, target_rps=target_rps, slo=slo)), run_dir)
