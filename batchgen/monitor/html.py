"""One self-contained HTML page: a title, a table of key figures, then the figures as embedded PNGs
(base64 data URIs), so the page can be mailed, attached to an Airflow task or opened offline.
With `png`, each figure is also written beside it as its own file.
"""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Figure:
    name: str  # file stem of its PNG
    title: str
    caption: str  # how to read it
    png: bytes


@dataclass(slots=True)
class Report:
    title: str
    subtitle: str
    facts: list[tuple[str, str]]  # (label, value) rows of the key-figures table
    figures: list[Figure]
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ReportFiles:
    html_path: Path | str  # a URL when the page was written into an object store
    png_paths: list[Path] | list[str]


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1680px;
       color: #1d1d1f; background: #fafafa; }
h1 { font-size: 22px; margin: 0 0 4px 0; } .sub { color: #555; margin-bottom: 16px; font-size: 14px; }
table.facts { border-collapse: collapse; margin-bottom: 18px; font-size: 13px; background: white; }
table.facts td { border: 1px solid #ddd; padding: 4px 10px; } table.facts td:first-child { color: #555; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(800px, 1fr)); gap: 14px; }
figure { margin: 0; background: white; border: 1px solid #e2e2e2; border-radius: 6px; padding: 8px; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 12.5px; color: #444; padding: 4px 6px 2px 6px; line-height: 1.4; }
.notes { font-size: 12.5px; color: #555; }
"""


def render_html(report: Report) -> str:
    facts = "\n".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in report.facts)
    figures = []
    for fig in report.figures:
        data = base64.b64encode(fig.png).decode("ascii")
        figures.append(f'<figure id="{html.escape(fig.name)}"><img alt="{html.escape(fig.title)}" '
                       f'src="data:image/png;base64,{data}"><figcaption><b>{html.escape(fig.title)}.</b> '
                       f"{html.escape(fig.caption)}</figcaption></figure>")
    notes = "".join(f"<p>{html.escape(n)}</p>" for n in report.notes)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(report.title)}"
            f"</title><style>{STYLE}</style></head><body>\n<h1>{html.escape(report.title)}</h1>"
            f"<div class=\"sub\">{html.escape(report.subtitle)}</div>\n<table class=\"facts\">{facts}</table>\n"
            f"<div class=\"grid\">{''.join(figures)}</div>\n<div class=\"notes\">{notes}</div></body></html>\n")


def write_report(report: Report, dest: Path, *, png: bool) -> ReportFiles:
    """`dest`/report.html (and `dest`/<figure>.png with `png`), each written atomically."""
    dest.mkdir(parents=True, exist_ok=True)
    html_path = dest / "report.html"
    _write_atomic(html_path, render_html(report).encode())
    pngs = []
    if png:
        for fig in report.figures:
            path = dest / f"{fig.name}.png"
            _write_atomic(path, fig.png)
            pngs.append(path)
    return ReportFiles(html_path, pngs)


def upload_report(report: Report, store, prefix: str, *, png: bool) -> ReportFiles:
    """The page (and PNGs) written into an object store (batchgen.io.store.store) under `prefix`/, one
    PUT each (whole or absent, as the local files' renames); their URLs."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="batchgen-report-") as temp:
        local = write_report(report, Path(temp), png=png)
        urls = []
        for path in [local.html_path, *local.png_paths]:
            store.write_bytes(f"{prefix}/{path.name}", path.read_bytes())
            urls.append(store / f"{prefix}/{path.name}")
    return ReportFiles(urls[0], urls[1:])


def _write_atomic(path: Path, data: bytes) -> None:
    # a browser refreshing the page of a running job never reads half a file
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)
