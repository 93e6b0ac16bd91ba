"""index.html of a run: every executed notebook rendered, the summary and the capstone, one click from each other.

The browser test opens the pages in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
which ``.ci/run`` installs; Selenium from requirements.txt drives it) and checks that every notebook page and every
plot image is there and loads. Outside CI it is skipped when no Chromium is installed; in CI it must run.
"""

import base64
import io
import json
import os
import shutil
from pathlib import Path

import nbformat
import pytest

from labkit.figures import bar_holds
from labkit.site import write_site
from labkit.workbook import summary_markdown


def _png(color: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1.5))
    ax.plot([0, 1], [0, 1], color=color)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _executed(path: Path, title: str, plots: int) -> None:
    cells = [nbformat.v4.new_markdown_cell(f"# {title}\nwhat it asks")]
    for i in range(plots):
        c = nbformat.v4.new_code_cell(f"plot({i})", execution_count=i + 1)
        c.outputs = [nbformat.v4.new_output("display_data", data={"image/png": _png(f"C{i}"), "text/plain": "fig"})]
        cells.append(c)
    nbformat.write(nbformat.v4.new_notebook(cells=cells), str(path))


@pytest.fixture
def run_dir(tmp_path):
    _executed(tmp_path / "05_batching.ipynb", "05 · Serving", plots=2)
    _executed(tmp_path / "07_finetuning.ipynb", "07 · Fine-tuning", plots=1)
    _executed(tmp_path / "08_capstone.ipynb", "08 · The answer", plots=1)
    (tmp_path / "summary.md").write_text("# labkit workbook run (ci profile)\n\n| a | b |\n| --- | --- |\n| 1 | 2 |\n")
    write_site(tmp_path, {"05_batching": 1.5, "07_finetuning": 2.0, "08_capstone": 0.5},
               failures={"07_finetuning": "cell 3: boom"})
    return tmp_path


def test_site_pages_and_links(run_dir):
    index = (run_dir / "index.html").read_text()
    for page in ("05_batching.html", "07_finetuning.html", "08_capstone.html", "summary.html"):
        assert (run_dir / page).exists()
        assert f"href='{page}'" in index or f'href="{page}"' in index, page
        text = (run_dir / page).read_text()
        assert 'href="index.html"' in text and 'href="08_capstone.html"' in text  # one click back
    assert "The answer to the scenario" in index and "failed: cell 3: boom" in index
    assert (run_dir / "05_batching.html").read_text().count('src="data:image/png;base64,') == 2
    assert "<table>" in (run_dir / "summary.html").read_text()


def test_site_refuses_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="out_dir=.* is not a folder"):
        write_site(tmp_path / "nope")


def _chromium():
    for browser, driver in (("/usr/bin/chromium", "/usr/bin/chromedriver"),):
        if Path(browser).exists() and Path(driver).exists():
            return browser, driver
    b, d = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    return (b, d) if b and d else None


def _expected_pages(run_dir: Path) -> dict[str, tuple[str, int]]:
    """Each executed notebook's page -> (its title, how many PNG plots its outputs hold), read from the .ipynb."""
    out = {}
    for path in sorted(run_dir.glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        title = next(ln.lstrip("#").strip() for c in nb.cells if c.cell_type == "markdown"
                     for ln in c.source.splitlines() if ln.startswith("#"))
        plots = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        out[f"{path.stem}.html"] = (title, plots)
    return out


def check_site_in_browser(run_dir: Path) -> None:
    """Open ``run_dir/index.html`` in headless Chromium; from it, click to every notebook's page and check its title
    and that every plot of the notebook is on the page and loaded, then click to the summary and check its table."""
    found = _chromium()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install chromium and chromium-driver (.ci/run does) for the browser test")
        pytest.skip("no Chromium here: apt-get install chromium chromium-driver (as .ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    expected = _expected_pages(run_dir)
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=found[1]))
    try:
        driver.get((run_dir / "index.html").as_uri())
        assert "labkit workbook run" in driver.title
        links = {a.get_attribute("href").rsplit("/", 1)[-1] for a in driver.find_elements(By.CSS_SELECTOR, "table a")}
        assert links == set(expected)
        for page, (title, plots) in expected.items():
            driver.get((run_dir / "index.html").as_uri())
            driver.find_element(By.CSS_SELECTOR, f"table a[href='{page}']").click()  # one click from the index
            assert title in driver.find_element(By.TAG_NAME, "h1").text, page
            imgs = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img")
            assert len(imgs) == plots, f"{page}: {len(imgs)} plots on the page, {plots} in the notebook"
            loaded = driver.execute_script(
                "return Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
            assert all(loaded), f"{page}: an image did not load"
            driver.find_element(By.CSS_SELECTOR, "nav.lk-nav a[href='summary.html']").click()
            assert driver.find_elements(By.CSS_SELECTOR, "table td")
    finally:
        driver.quit()


def test_site_opens_in_headless_chromium(run_dir):
    check_site_in_browser(run_dir)


@pytest.mark.skipif(not os.environ.get("LABKIT_SITE_DIR"), reason="set LABKIT_SITE_DIR to a run's output folder")
def test_a_real_runs_site_opens_in_headless_chromium():
    """``LABKIT_SITE_DIR=out/workbook pytest tests/test_site.py``: the same check on a real run's index.html."""
    check_site_in_browser(Path(os.environ["LABKIT_SITE_DIR"]))


def test_summary_puts_each_machines_value_beside_and_marks_bars_on_their_machine():
    figures = {"engine.x": {"value": 1.2, "unit": "x", "machine": "cpu", "record": "r.json", "bar": ">= 2"},
               "engine.y": {"value": 0.5, "unit": "s", "machine": "cpu", "record": "r.json"}}
    committed = {"format": 2, "figures": {"engine.x": {"unit": "x", "bar": ">= 2", "machines": {
        "h200": {"value": 2.35, "machine": "NVIDIA H200", "record": "g.json", "run": "a"},
        "h100": {"value": 1.9, "machine": "NVIDIA H100 80GB HBM3", "record": "h.json", "run": "b"}}}}}
    md = summary_markdown(figures, {"05_batching": 10.0}, "cpu", committed)
    assert "| figure | unit | bar | this run | committed h100 | committed h200 |" in md
    row = next(ln for ln in md.splitlines() if "`engine.x`" in ln)
    assert "| >= 2 | 1.2 ✗ (cpu) | 1.9 ✗ | 2.35 ✓ |" in row  # each value judged on its own machine
    row_y = next(ln for ln in md.splitlines() if "`engine.y`" in ln)
    assert "| 0.5 (cpu) |  |  |" in row_y
    assert "| **total** | 10.0 | 0.0 |" in md
    gpu_run = {"engine.x": dict(figures["engine.x"], machine="NVIDIA H200", value=2.5)}
    assert "| 2.5 ✓ (h200) |" in summary_markdown(gpu_run, {}, "gpu", committed)


def test_bar_holds():
    assert bar_holds(">= 2", 2.35) is True and bar_holds("<= 0.15", 0.2) is False
    assert bar_holds("<= 0.15 (goal 0.08)", 0.1) is True  # a parenthesised remark does not make a bar prose
    assert bar_holds("true", True) is True and bar_holds("true", False) is False
    assert bar_holds("< int4 RTN (0.0159)", 0.01) is None and bar_holds(None, 1.0) is None


def test_readme_table_has_one_column_per_machine(tmp_path):
    from labkit.figures import summary_table

    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"format": 2, "figures": {
        "engine.x": {"unit": "x", "bar": ">= 2", "machines": {
            "h200": {"value": 2.35, "machine": "NVIDIA H200", "record": "results/h200/records/05.json", "run": "a"},
            "h100": {"value": 1.5, "machine": "NVIDIA H100 80GB HBM3", "record": "results/h100/records/05.json",
                     "run": "b"}}},
        "finetune.y": {"unit": "f", "bar": "<= 0.15", "machines": {
            "cpu": {"value": 0.2, "machine": "cpu", "record": "results/cpu/records/07.json", "run": "c"}}}}}))
    table = summary_table(path)
    assert "| figure | unit | bar | h100 | h200 | cpu |" in table
    assert ("| `engine.x` | x | >= 2 | [1.5](results/h100/records/05.json) ✗ | [2.35](results/h200/records/05.json) ✓ "
            "|  |") in table
    assert "| `finetune.y` | f | <= 0.15 |  |  | [0.2](results/cpu/records/07.json) ✗ |" in table


def test_run_workbook_writes_summary_and_index(tmp_path):
    """``run_workbook`` (notebook execution stubbed through its ``execute`` argument): summary.md and index.html land
    in the output folder, a failed notebook is named in both the exit code and the index."""
    import labkit.workbook as wb

    def fake_execute(nb, out_dir, profile, timeout):
        _executed(out_dir / nb.name, f"{nb.stem[:2]} · stub", plots=1)
        if nb.stem.startswith("07"):
            raise RuntimeError(f"{nb.name} failed at cell 3: boom")
        return 1.25

    assert wb.run_workbook(profile="ci", only=["05", "07"], out=tmp_path, execute=fake_execute) == 1
    index = (tmp_path / "index.html").read_text()
    assert "05_batching.html" in index and "07_finetuning.html" in index and "failed: 07_finetuning.ipynb" in index
    assert "| 05_batching | 1.2 |" in (tmp_path / "summary.md").read_text()
