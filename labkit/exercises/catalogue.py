"""Every exercise, in notebook order (importing a module registers its exercises)."""

from labkit.exercises import (  # noqa: F401
    ex00_baseline,
    ex01_roofline,
    ex02_kvcache,
    ex03_kernels,
    ex04_quant,
    ex05_batching,
    ex06_parallel,
    ex07_lora,
    ex08_plan,
    ex09_speculative,
)
