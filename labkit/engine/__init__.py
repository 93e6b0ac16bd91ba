"""The serving engine: requests, schedulers (FIFO, static, continuous), workloads and metrics."""
