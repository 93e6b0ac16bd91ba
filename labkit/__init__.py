"""labkit: measure, then optimise, LLM inference on a real transformer.

Importing labkit sets ``TRITON_INTERPRET=1`` when no CUDA device is present, so that every Triton kernel in
``labkit.kernels`` runs on the CPU through Triton's interpreter. This must happen before ``triton`` is first
imported, which is why it lives here and why notebooks import labkit before anything that pulls in triton. It
also quiets the torch profiler's per-profile ``USDT`` lines (``device.quiet_profiler_logs``).
"""

from labkit.device import configure_triton_for_host, quiet_profiler_logs

configure_triton_for_host()
quiet_profiler_logs()

__version__ = "0.1.0"
