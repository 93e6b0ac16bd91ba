"""The flash-prefill account of notebook 03 (labkit.experiments.kernels.prefill_account): rows and reading come from
the record, and the reading's verbs follow its numbers."""

import copy

from labkit.experiments.kernels.prefill_account import account_reading, account_rows, load_account


def _record(product_us=1200.0, mma_us=850.0, no_exp_us=1100.0, cudnn_us=900.0):
    def row(name, kind, us, tile=(128, 64, 8, 3), error=None):
        return {"name": name, "kind": kind, "us": us, "tflop_s": 1e3 / us if us else None,
                "x_cudnn": cudnn_us / us if us else None, "tile": list(tile) if us and tile else None, "error": error}
    return {"env": {"device": "NVIDIA H100 80GB HBM3", "git_commit": "0518b54065eb"},
            "data": {"table": [row("sdpa_cudnn_gqa", "baseline", cudnn_us, None),
                               row("v0 product", "variant", product_us),
                               row("v3 TMA", "variant", 1300.0), row("v4 wide tune", "variant", 1150.0),
                               row("probe no-exp", "probe", no_exp_us), row("probe mma-only", "probe", mma_us),
                               row("v6 warp-specialize", "variant", None, error="no tile ran")]}}


def test_rows_name_the_product_and_keep_a_rung_that_did_not_run():
    rows = account_rows(_record())
    assert [r["kind"] for r in rows] == ["baseline", "product", "variant", "variant", "probe", "probe", "variant"]
    assert rows[1]["x cuDNN"] == 900.0 / 1200.0 and rows[1]["tile"] == "128x64x8x3"
    assert rows[-1]["us"] is None and rows[-1]["note"] == "no tile ran"


def test_reading_is_rendered_from_the_numbers():
    text = account_reading(_record())
    assert "runs at 0.75x SDPA-cuDNN (1200 against 900 us)" in text
    assert "'v4 wide tune', stays behind cuDNN at 0.78x" in text
    assert "Not timed (no tile ran correctly): v6 warp-specialize" in text
    assert "the two MMAs alone take 850 us, 1.06x cuDNN" in text and "costs 350 us a call, 100 of it the exp2" in text
    assert "tensor-core work alone beats cuDNN" in text


def test_reading_follows_the_data_when_the_mma_loop_is_behind_too():
    text = account_reading(_record(mma_us=950.0))
    assert "tensor-core work alone beats" not in text and "the tensor-core loop itself" in text
    faster = copy.deepcopy(_record())
    faster["data"]["table"][3]["us"] = 850.0
    assert "'v4 wide tune', passes cuDNN at 1.06x" in account_reading(faster)


def test_the_committed_h100_record_reads():
    record = load_account("h100")
    assert record is not None and record["env"]["device"].startswith("NVIDIA H100")
    rows = account_rows(record)
    assert any(r["kind"] == "product" for r in rows) and any(r["kernel"] == "sdpa_cudnn_gqa" for r in rows)
    assert "SDPA-cuDNN" in account_reading(record)
    assert load_account("no-such-machine") is None
