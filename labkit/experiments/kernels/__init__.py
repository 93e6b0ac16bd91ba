"""What notebook 03 (custom kernels) runs: the kernel benchmarks (``bench``: the sweep, the ``kernels.*`` figures,
``python -m labkit bench kernels``; its cases in ``cases`` and ``gemv``), the arithmetic and experiments
(``study``), and a kernel that only reads, the floor the GEMVs are measured against (``stream_read``). Product code
never imports this package."""
