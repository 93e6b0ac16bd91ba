"""Accelerators: datasheet peaks, detection, and the ceilings measured on the device at hand.

Datasheet numbers are leads; every bound the workbook reports is taken against ceilings *measured* by
``measure_ceilings`` (a large device-to-device copy, a large bf16 matmul) on the machine that runs it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from labkit.checks import check_choice


@dataclass(frozen=True)
class Hardware:
    """Peak rates of one device. FLOP/s are dense (no sparsity); bandwidth in bytes/s; memory in bytes."""

    name: str
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    int8_ops: float
    mem_bandwidth: float
    mem_capacity: float
    source: str = "datasheet"

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which bf16 work is compute-bound."""
        return self.bf16_flops / self.mem_bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


# Dense peaks from NVIDIA's datasheets (SXM parts); the CPU row is a nominal placeholder replaced by measurement.
KNOWN: dict[str, Hardware] = {
    "h200": Hardware("NVIDIA H200", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12, int8_ops=1979e12,
                     mem_bandwidth=4.8e12, mem_capacity=141e9),
    "h100": Hardware("NVIDIA H100 SXM", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12,
                     int8_ops=1979e12, mem_bandwidth=3.35e12, mem_capacity=80e9),
    "a100": Hardware("NVIDIA A100 80GB", bf16_flops=312e12, fp8_flops=0.0, fp32_flops=19.5e12, int8_ops=624e12,
                     mem_bandwidth=2.039e12, mem_capacity=80e9),
    "cpu": Hardware("CPU", bf16_flops=1e11, fp8_flops=0.0, fp32_flops=1e11, int8_ops=0.0,
                    mem_bandwidth=2e10, mem_capacity=24e9, source="nominal"),
}


def get_hardware(key: str, name: str = "hardware") -> Hardware:
    """A ``Hardware`` row by key (``h200``, ``h100``, ``a100``, ``cpu``); an error names the caller's argument
    ``name``."""
    return KNOWN[check_choice(name, key, sorted(KNOWN))]


def device_name(device: torch.device | str | None = None) -> str:
    """The device's marketing name (``NVIDIA H200``) or ``cpu``."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.get_device_name(device)
    return "cpu"


def datasheet_row(name: str) -> Hardware | None:
    """The row of a device name (``device_name``'s: ``NVIDIA H200``, ``cpu``), or None for a part with none."""
    name = name.lower()
    if name == "cpu":
        return KNOWN["cpu"]
    return next((KNOWN[key] for key in ("h200", "h100", "a100") if key in name), None)


def detect(device: torch.device | str | None = None) -> Hardware:
    """The datasheet row of the present device (the CPU row when there is no GPU)."""
    hw = datasheet_row(device_name(device))
    if hw is None:
        raise ValueError(f"no datasheet row for {device_name(device)!r}; known: {sorted(KNOWN)}. "
                         "Use measure_ceilings() for measured numbers.")
    return hw


def _time(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after two warm-ups."""
    from labkit.bench import time_fn

    return time_fn(fn, device=device, warmup=2, iters=iters).median_s


def measure_copy_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None,
                           iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    nbytes = nbytes or (2 * 2**30 if dev.type == "cuda" else 256 * 2**20)
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), dev, iters)
    return 2 * src.numel() * 4 / seconds


def measure_matmul_flops(device: torch.device | str | None = None, n: int | None = None,
                         dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> float:
    """FLOP/s of an ``n x n x n`` matmul on random inputs (8192 on the GPU, 1024 on the CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    seconds = _time(lambda: a @ b, dev, iters)
    return 2 * n**3 / seconds


def measure_ceilings(device: torch.device | str | None = None, iters: int = 20) -> dict:
    """Measured copy bandwidth and bf16 (fp32 on the CPU) matmul rate of the device, with its name (and the
    datasheet's peak bandwidth beside them, None where there is no datasheet row)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    mm_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = {
        "device": device_name(dev),
        "copy_bytes_per_s": measure_copy_bandwidth(dev, iters=iters),
        "matmul_flops": measure_matmul_flops(dev, dtype=mm_dtype, iters=iters),
        "matmul_dtype": str(mm_dtype).replace("torch.", ""),
    }
    out["ridge_flop_per_byte"] = out["matmul_flops"] / out["copy_bytes_per_s"]
    out["datasheet_bytes_per_s"] = datasheet_bandwidth(dev)
    out["measure_s"] = time.perf_counter() - t0
    return out


def datasheet_bandwidth(device: torch.device | str | None = None, name: str | None = None) -> float | None:
    """The vendor's peak memory bandwidth (bytes/s) of the device (or of the device ``name``), or None without a
    datasheet row (the CPU, an unlisted GPU): no kernel reads faster, so it bounds every bandwidth-limited ratio from
    above."""
    hw = datasheet_row(device_name(device) if name is None else name)
    return hw.mem_bandwidth if hw is not None and hw.source == "datasheet" else None


def measured_hardware(ceilings: dict, base: Hardware | None = None) -> Hardware:
    """A ``Hardware`` whose bandwidth and bf16 rate are the measured ceilings (other peaks from ``base``)."""
    base = base or detect()
    return Hardware(name=ceilings["device"], bf16_flops=ceilings["matmul_flops"], fp8_flops=base.fp8_flops,
                    fp32_flops=base.fp32_flops, int8_ops=base.int8_ops,
                    mem_bandwidth=ceilings["copy_bytes_per_s"], mem_capacity=base.mem_capacity,
                    source="measured")
