import pytest

from labkit.hardware import KNOWN, detect, get_hardware, measure_ceilings, measured_hardware


def test_datasheet_rows():
    h200 = get_hardware("h200")
    assert h200.mem_bandwidth == 4.8e12 and h200.mem_capacity == 141e9
    assert 150 < h200.ridge_point < 250
    assert KNOWN["h100"].bf16_flops == h200.bf16_flops


def test_measure_ceilings_on_this_machine():
    c = measure_ceilings(iters=3)
    assert c["copy_bytes_per_s"] > 1e8 and c["matmul_flops"] > 1e8
    hw = measured_hardware(c, detect())
    assert hw.source == "measured" and hw.mem_bandwidth == c["copy_bytes_per_s"]


def test_unknown_hardware():
    with pytest.raises(ValueError, match="hardware='tpu' is unknown; allowed"):
        get_hardware("tpu")
