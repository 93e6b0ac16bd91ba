"""Notebook 08 (the capstone): the answer to the 175B question, rendered from ``results/summary.json`` and the
planner.

``table``: the technique x trade-off table as data (``TECHNIQUES``), the figures committed GPU records hold but the
summary does not (``derived_figures``) and plain rendering (``fill_template``). ``answer``: the two-minute answer,
the hints and the follow-ups as templates, rendered with each measured number labelled by the proxy and machine it
comes from (``answer``, ``proxy_labelled``), and the planner's layout as figures (``layout_figures``). ``kernels``:
which kernel each quantised number comes from, the planner's GPU counts with every measured kernel and with labkit's
own only (``plan_figures``), and the paragraph that says so (``KERNELS``).
"""

from labkit.experiments.capstone.answer import (
    ANSWER,
    GROUPS,
    HINTS,
    TIERS,
    answer,
    by_class,
    layout_figures,
    proxy_label,
    proxy_labelled,
    render_paragraph,
    templates,
)
from labkit.experiments.capstone.kernels import KERNELS, labkit_only, plan_figures
from labkit.experiments.capstone.table import (
    COLUMNS,
    TECHNIQUES,
    derived_figures,
    fill_template,
    markdown_digits,
    namespace,
    technique_table,
    word_count,
)

__all__ = ["ANSWER", "COLUMNS", "GROUPS", "HINTS", "KERNELS", "TECHNIQUES", "TIERS", "answer", "by_class",
           "derived_figures", "labkit_only", "layout_figures", "markdown_digits", "namespace", "plan_figures",
           "proxy_label", "proxy_labelled", "fill_template", "render_paragraph", "technique_table", "templates",
           "word_count"]
