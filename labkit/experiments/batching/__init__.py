"""Notebook 05 (continuous batching) and ``python -m labkit bench serve|decode``: the engine measured against HF
``generate`` (``measure.py``), where a decode step's time goes against each part's byte floor (``attribution.py``),
the figures a ``bench decode`` run derives (``decode_figures.py``) and the command line around them (``cli.py``)."""

from labkit.experiments.batching.attribution import (
    attribute_step,
    attribution_figures,
    attribution_rows,
    decode_attribution,
    decode_part_bytes,
    format_attribution,
    plot_attribution,
)
from labkit.experiments.batching.measure import (
    check_graph_replays,
    check_greedy_vs_hf,
    decode_rate,
    fifo_executions,
    fifo_sweep,
    free_device_memory,
    hf_greedy,
    profile_engine_decode,
    runner_step,
    serve_row,
    serve_sweep,
    token_gaps,
)

__all__ = ["attribute_step", "attribution_figures", "attribution_rows", "check_graph_replays", "check_greedy_vs_hf",
           "decode_attribution", "decode_part_bytes", "decode_rate", "fifo_executions", "fifo_sweep",
           "format_attribution", "free_device_memory", "hf_greedy", "plot_attribution", "profile_engine_decode",
           "runner_step", "serve_row", "serve_sweep", "token_gaps"]
