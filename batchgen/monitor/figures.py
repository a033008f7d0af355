"""The report's figures: plain data in, a PNG out. matplotlib with the Agg backend (no display).

Each function takes lists (never tables) so the job report and the bench report share them; an
empty input gives a figure that says "no data" rather than an error, since a job killed in its
first seconds has little to show.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from batchgen.errors import UsageError


class ReportDependencyError(UsageError):
    """matplotlib is missing (the `report` extra)."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportDependencyError("the report needs matplotlib: pip install 'batchgen[report]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


WIDTH_IN, HEIGHT_IN, DPI = 8.0, 3.6, 100  # 800 x 360 px: two side by side fit a laptop screen


def _new(title: str):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _whole_number_ticks(axis) -> None:
    """Ticks at whole numbers only: a count of rows has no 0.5 (matplotlib picks 0.5 steps for 1 to 3)."""
    _pyplot()  # matplotlib, or the report's missing-dependency error
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _no_data(ax, text: str = "no data yet") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5", fontsize=12)
    ax.set_xticks([])
    ax.set_yticks([])


def to_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _pyplot().close(fig)
    return buf.getvalue()


Series = dict[str, tuple[Sequence[float], Sequence[float]]]


def lines(title: str, xlabel: str, ylabel: str, series: Series, *, right: Series | None = None,
          right_label: str = "", vlines: Sequence[tuple[float, str]] = (), ylim0: bool = True) -> bytes:
    """Lines over a shared x axis; `right`: more lines on a second y axis; `vlines`: marked moments."""
    fig, ax = _new(title)
    if not any(len(xs) for xs, _ in series.values()):
        _no_data(ax)
        return to_png(fig)
    few = max(len(xs) for xs, _ in series.values()) < 30  # a short job: show the points themselves
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, label=label, linewidth=1.4, marker="o" if few else None, markersize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim0:
        ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    if right:
        ax2 = ax.twinx()
        for i, (label, (xs, ys)) in enumerate(right.items()):
            ax2.plot(xs, ys, label=label, linewidth=1.2, linestyle="--", color=f"C{len(series) + i}",
                     marker="o" if few else None, markersize=3)
        ax2.set_ylabel(right_label)
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    for x, label in vlines:
        ax.axvline(x, color="0.4", linestyle=":", linewidth=1)
        ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), xytext=(3, -12), textcoords="offset points",
                    fontsize=8, color="0.3")
    if len(labels) > 1:
        ax.legend(handles, labels, fontsize=8, loc="lower right")
    return to_png(fig)


def log_histogram(title: str, xlabel: str, series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[int]]],
                  *, marks: Sequence[tuple[float, str]] = ()) -> bytes:
    """Bars of (bucket low edge, bucket high edge, count) on a log x axis; one colour per series."""
    fig, ax = _new(title)
    if not any(len(c) for _, _, c in series.values()):
        _no_data(ax)
        return to_png(fig)
    for i, (label, (lows, highs, counts)) in enumerate(series.items()):
        widths = [h - lo for lo, h in zip(lows, highs, strict=True)]
        ax.bar(lows, counts, width=widths, align="edge", alpha=0.6 if len(series) > 1 else 0.85, label=label,
               color=f"C{i}", edgecolor="none")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 20, not 2 x 10^1
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("steps")
    for x, label in marks:
        ax.axvline(x, color="0.2", linestyle="--", linewidth=1)
        ax.annotate(label, (x, 0.95), xycoords=("data", "axes fraction"), xytext=(3, 0), textcoords="offset points",
                    fontsize=8)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return to_png(fig)


def scatter(title: str, xlabel: str, ylabel: str, xs: Sequence[float], ys: Sequence[float], *,
            note: str = "") -> bytes:
    """Points with the y = x diagonal: where a perfect prediction would lie."""
    fig, ax = _new(title)
    if not xs:
        _no_data(ax, "no rows with a prediction yet")
        return to_png(fig)
    ax.scatter(xs, ys, s=9, alpha=0.45, edgecolors="none")
    top = max(max(xs), max(ys)) * 1.05 or 1
    ax.plot([0, top], [0, top], color="0.3", linewidth=1, linestyle="--", label="actual = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="upper left")
    if note:
        ax.text(0.99, 0.02, note, ha="right", va="bottom", transform=ax.transAxes, fontsize=8, color="0.3")
    return to_png(fig)


def stacked_bars(title: str, xlabel: str, ylabel: str, categories: Sequence[str],
                 stacks: dict[str, Sequence[float]], *, counts: bool = False) -> bytes:
    """One bar per category, split into `stacks` (label -> a value per category); `counts`: whole
    numbers (rows), so the value axis has no fractional ticks."""
    fig, ax = _new(title)
    if not categories:
        _no_data(ax)
        return to_png(fig)
    bottom = [0.0] * len(categories)
    positions = list(range(len(categories)))
    for i, (label, values) in enumerate(stacks.items()):
        ax.bar(positions, values, bottom=bottom, label=label, color=f"C{i}", width=0.7 if len(positions) > 1 else 0.4)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    step = max(1, len(categories) // 30)  # at most ~30 tick labels
    ax.set_xticks(positions[::step], list(categories)[::step], rotation=0 if len(categories) < 12 else 90,
                  fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if counts:
        _whole_number_ticks(ax.yaxis)
    ax.legend(fontsize=8)
    return to_png(fig)


def horizontal_bars(title: str, xlabel: str, labels: Sequence[str], values: Sequence[float], *,
                    empty: str = "no data", counts: bool = False) -> bytes:
    """One bar per label; `counts`: whole numbers (rows), so no fractional ticks on the value axis."""
    fig, ax = _new(title)
    if not labels:
        _no_data(ax, empty)
        return to_png(fig)
    short = [label if len(label) <= 60 else label[:57] + "..." for label in labels]
    ax.barh(list(range(len(labels)))[::-1], values, color="C3", height=0.6)
    ax.set_ylim(-0.5 - max(0, 3 - len(labels)) / 2, len(labels) - 0.5 + max(0, 3 - len(labels)) / 2)  # thin bars
    ax.set_yticks(list(range(len(labels)))[::-1], short, fontsize=8)
    ax.set_xlabel(xlabel)
    if counts:
        _whole_number_ticks(ax.xaxis)
    for i, v in enumerate(values):
        ax.annotate(f"{v:g}", (v, len(labels) - 1 - i), xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=8)
    return to_png(fig)
