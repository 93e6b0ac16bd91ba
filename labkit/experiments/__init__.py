"""What each notebook runs: one module per notebook (``baseline``, ``diagnose``, ``kv_cache``, ``kernels``,
``quantization``, ``batching``, ``parallelism``, ``finetuning``, ``capstone``), a package where one needs several
files.

These functions measure, compare and tabulate; they call the product packages (``labkit.model``, ``kernels``,
``kvcache``, ``quant``, ``engine``, ``parallel``, ``finetune``, ``plan``) through their public names. Product code never
imports ``labkit.experiments``.
"""
