"""Notebook 05 (continuous batching) and ``python -m labkit bench serve|decode``: the engine measured against HF
``generate`` (``measure.py``) and the command line around it (``cli.py``)."""

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

__all__ = ["check_graph_replays", "check_greedy_vs_hf", "decode_rate", "fifo_executions", "fifo_sweep",
           "free_device_memory", "hf_greedy", "profile_engine_decode", "runner_step", "serve_row", "serve_sweep",
           "token_gaps"]
