"""Notebook 06 (tensor vs pipeline parallelism): the rank functions ``labkit.parallel.launch`` runs on every rank
(``ranks.py``), the tables and plots that join their results (``report.py``), and the same questions at full size on
real GPUs for ``scripts/bench_multigpu.py`` (``multigpu.py``)."""

from labkit.experiments.parallelism import multigpu
from labkit.experiments.parallelism.ranks import (
    collectives_check,
    comm_check,
    dtensor_check,
    fail_on,
    hello,
    load_model_on,
    pp_bubble,
    pp_check,
    sequence,
    tp_check,
    tp_demo,
    tp_layers_check,
)
from labkit.experiments.parallelism.report import bubble_table, comm_fits, plot_comm, plot_schedule_timeline

__all__ = ["multigpu", "hello", "fail_on", "sequence", "collectives_check", "tp_layers_check", "load_model_on",
           "tp_check", "dtensor_check", "comm_check", "tp_demo", "pp_check", "pp_bubble", "bubble_table", "comm_fits",
           "plot_comm", "plot_schedule_timeline"]
