"""The run's pages for a reader without Jupyter: ``index.html`` in the run's output folder.

``write_site(out_dir, timings, failures)`` renders every executed notebook of the folder to ``NN_topic.html``
with nbconvert (plots are the notebooks' own PNG outputs, embedded as data URIs, so each page is one file),
``summary.md`` to ``summary.html``, and writes ``index.html`` linking them all, the capstone's answer (notebook
08) first. Every page carries the same bar of links (index, summary, answer, each notebook), so any page is one
click from any other.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

CAPSTONE_PREFIX = "08_"
_STYLE = ("<style>.lk-nav{position:sticky;top:0;z-index:1000;background:#f4f4f4;border-bottom:1px solid #ccc;"
          "padding:6px 12px;font:14px sans-serif}.lk-nav a{margin-right:12px;color:#0645ad;text-decoration:underline}"
          "body.lk-page{max-width:1100px;margin:auto;font:15px/1.5 sans-serif;padding:0 12px}"
          "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}</style>")


def _title(nb) -> str:
    """The first markdown heading of a notebook, without its '#'s."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


def _nav(pages: list[tuple[str, str]], here: str) -> str:
    links = [f'<a href="{href}"{" aria-current=page" if href == here else ""}>{html.escape(label)}</a>'
             for href, label in pages]
    return f'<nav class="lk-nav">{"".join(links)}</nav>'


def _with_nav(page: str, nav: str) -> str:
    """Insert the style and the link bar right after ``<body ...>`` (and the style in ``<head>``)."""
    page = page.replace("</head>", _STYLE + "</head>", 1)
    m = re.search(r"<body[^>]*>", page)
    if m is None:
        raise ValueError("nbconvert's page has no <body> tag to put the links under")
    return page[:m.end()] + nav + page[m.end():]


def _page(title: str, body: str, nav: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>{_STYLE}</head>"
            f"<body class='lk-page'>{nav}{body}</body></html>\n")


def render_notebook(path: Path) -> tuple[str, str]:
    """One executed notebook as a standalone HTML page (nbconvert's ``lab`` template, no MathJax from the network);
    returns ``(title, html)``."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(path), as_version=4)
    exporter = HTMLExporter(template_name="lab", mathjax_url="")
    body, _ = exporter.from_notebook_node(nb)
    return _title(nb) or path.stem, body


def write_site(out_dir: Path | str, timings: dict[str, float] | None = None,
               failures: dict[str, str] | None = None) -> Path:
    """Render the executed notebooks (``NN_*.ipynb``) and ``summary.md`` of ``out_dir``; write ``index.html``.

    ``timings``: seconds per notebook stem; ``failures``: notebook stem -> the error of a failed run (its page is
    still rendered from the cells that ran). Returns the path of ``index.html``.
    """
    import mistune

    out = Path(out_dir)
    if not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} is not a folder")
    timings, failures = timings or {}, failures or {}
    nbs = sorted(out.glob("[0-9][0-9]_*.ipynb"))
    rendered = {nb.stem: render_notebook(nb) for nb in nbs}
    capstone = next((s for s in rendered if s.startswith(CAPSTONE_PREFIX)), None)
    pages = [("index.html", "index"), ("summary.html", "summary")]
    if capstone:
        pages.append((f"{capstone}.html", "the answer (08)"))
    pages += [(f"{s}.html", s[:2]) for s in rendered if s != capstone]
    for stem, (_, body) in rendered.items():
        (out / f"{stem}.html").write_text(_with_nav(body, _nav(pages, f"{stem}.html")))

    summary_md = out / "summary.md"
    summary = mistune.html(summary_md.read_text()) if summary_md.exists() else "<p>No summary.md in this run.</p>"
    (out / "summary.html").write_text(_page("labkit run: summary", summary, _nav(pages, "summary.html")))

    from labkit.provenance import stale_executed

    stale = stale_executed(out)
    rows = []
    for stem, (title, _) in rendered.items():
        status = f"failed: {html.escape(failures[stem])}" if stem in failures else "ran"
        if f"{stem}.ipynb" in stale:
            status += f"; {html.escape(stale[f'{stem}.ipynb'])}"
        secs = f"{timings[stem]:.1f}" if stem in timings else ""
        rows.append(f"<tr><td><a href='{stem}.html'>{html.escape(stem)}</a></td><td>{html.escape(title)}</td>"
                    f"<td>{secs}</td><td>{status}</td></tr>")
    answer = (f"<p><b>The answer to the scenario:</b> <a href='{capstone}.html'>{html.escape(rendered[capstone][0])}"
              f"</a> (notebook 08, rebuilt from the figures at every run).</p>") if capstone else \
        "<p>Notebook 08 (the capstone's answer) was not part of this run.</p>"
    body = (f"<h1>labkit workbook run</h1>{answer}<p><a href='summary.html'>Summary of the figures</a> (this run's "
            f"values beside each machine's committed value, each marked against its bar on its machine).</p>"
            f"<h2>Executed notebooks</h2><table><tr><th>notebook</th><th>title</th><th>seconds</th><th>status</th>"
            f"</tr>{''.join(rows)}</table>")
    index = out / "index.html"
    index.write_text(_page("labkit workbook run", body, _nav(pages, "index.html")))
    return index
