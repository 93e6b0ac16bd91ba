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


def test_datasheet_bandwidth_of_known_and_unknown_parts():
    import labkit.hardware as hw

    assert hw.datasheet_bandwidth("cpu") is None  # the CPU row is nominal, not a datasheet
    assert hw.datasheet_bandwidth(name="NVIDIA H200") == 4.8e12
    assert hw.datasheet_bandwidth(name="NVIDIA B200") is None and hw.datasheet_row("NVIDIA B200") is None


def test_measure_ceilings_carries_the_datasheet_bandwidth():
    c = measure_ceilings("cpu", iters=2)
    assert "datasheet_bytes_per_s" in c and c["datasheet_bytes_per_s"] is None
