"""``python -m labkit``: run the workbook, measure the device, and keep the results summary.

    python -m labkit run [--profile auto|ci|cpu|gpu] [--only NN ...] [--out DIR]
    python -m labkit ceilings [--out DIR]
    python -m labkit merge OUT_DIR RECORD_ROOT        # figures.json of a run -> results/summary.json
    python -m labkit readme                           # regenerate the READMEs' results table and unmet bars
    python -m labkit build-notebooks [--check]        # notebooks/src/*.py -> notebooks/*.ipynb
    python -m labkit docs [--check]                   # docs/api.md from the exported names' docstrings
    python -m labkit bench kernels|serve|decode [ARGS...]  # the kernel, serving and decode benchmarks
    python -m labkit claims [--write]                 # every notebook claim x every machine of results/summary.json
    python -m labkit lab [ARGS...]                    # jupyter lab on notebooks/ (--allow-root when run as root)
    python -m labkit exercises [--status FILE]        # every exercise and this learner's status
    python -m labkit gpu-check record|table ...       # rows of scripts/gpu_check.sh, and their table
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
# quiet the kernels' start-up notices: platformdirs migration, and the debugger's frozen-modules warning
LAB_ENV = {"JUPYTER_PLATFORM_DIRS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}


def _ceilings(args) -> int:
    from labkit.bench import record_figure, write_record
    from labkit.hardware import measure_ceilings

    c = measure_ceilings()
    path = write_record("ceilings", c, out_dir=args.out)
    record_figure("ceiling.copy_tb_s", c["copy_bytes_per_s"] / 1e12, "TB/s", path, out_dir=args.out,
                  note="device-to-device copy, bytes read + written")
    record_figure("ceiling.bf16_mm_tflop_s" if c["matmul_dtype"] == "bfloat16" else "ceiling.fp32_mm_tflop_s",
                  c["matmul_flops"] / 1e12, "TFLOP/s", path, out_dir=args.out)
    print(f"{c['device']}: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, {c['matmul_dtype']} matmul "
          f"{c['matmul_flops'] / 1e12:.1f} TFLOP/s, ridge {c['ridge_flop_per_byte']:.0f} FLOP/B")
    return 0


class UsageError(Exception):
    """Bad command-line input: printed as an argparse error (exit 2), without a traceback."""


def _run(args) -> int:
    from labkit.workbook import list_notebooks, resolve_profile, run_workbook

    try:  # refuse bad arguments before anything runs
        resolve_profile(args.profile)
        list_notebooks(args.only)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return run_workbook(profile=args.profile, only=args.only, out=args.out, timeout=args.cell_timeout)


def _merge(args) -> int:
    from labkit.figures import merge_figures

    s = merge_figures(Path(args.out_dir) / "figures.json", args.record_root)
    print(f"results/summary.json: {len(s['figures'])} figures")
    return 0


def _readme(args) -> int:
    from labkit.workbook import update_readme_table

    update_readme_table()
    return 0


BENCHES = {"kernels": "labkit.experiments.kernels.bench", "serve": "labkit.experiments.batching.cli",
           "decode": "labkit.experiments.batching.cli"}
SUBCOMMANDS = ("serve", "decode")  # their module's own parser takes the benchmark's name first


def _bench(args) -> int:
    import importlib

    if args.what not in BENCHES:
        print(f"bench {args.what!r} is unknown; allowed: {sorted(BENCHES)}", file=sys.stderr)
        return 2
    rest = [args.what, *args.rest] if args.what in SUBCOMMANDS else args.rest
    return importlib.import_module(BENCHES[args.what]).main(rest)


def _claims(args) -> int:
    from labkit.claims import check_all
    from labkit.claims_report import claims_table, write_figures

    checks = check_all(args.summary, args.sources)
    print(claims_table(checks))
    if args.write:
        print(f"wrote {write_figures(checks, args.summary)}")
    return 1 if any(ch.status in ("false", "refused") for ch in checks) else 0


def _build(args) -> int:
    from labkit.workbook import build_notebooks

    stale = build_notebooks(check=args.check)
    print(("out of date: " if args.check else "built: ") + (", ".join(stale) or "none"))
    return 1 if (args.check and stale) else 0


def _docs(args) -> int:
    from labkit.docs import API_PAGE, write_api_page

    out = args.out or API_PAGE
    stale = write_api_page(out, check=args.check)
    print(f"{out}: " + ("out of date" if args.check and stale else "written" if stale else "up to date"))
    return 1 if (args.check and stale) else 0


def lab_command(rest: list[str], uid: int | None = None) -> list[str]:
    """The ``jupyter lab`` command line for ``notebooks/``: with ``--allow-root`` when run as root (uid 0; Jupyter
    refuses root without it), then ``rest``."""
    uid = os.getuid() if uid is None and hasattr(os, "getuid") else uid
    root = ["--allow-root"] if uid == 0 and "--allow-root" not in rest else []
    return [sys.executable, "-m", "jupyter", "lab", str(NOTEBOOKS), *root, *rest]


def _gpu_check(args) -> int:
    import json

    from labkit import gpu_check

    if args.action == "record":
        before = json.loads(Path(args.before).read_text()) if args.before and Path(args.before).exists() else {}
        row = gpu_check.stage_row(args.stage, args.rc, args.seconds, Path(args.log), Path(args.run), before)
        gpu_check.append_row(Path(args.out), row)
        print(f"{row['stage']}: {row['status']} in {row['seconds']:.0f} s"
              + (f", {row['false_claims']} false claims, {row['figures_written']} figures" if "notebook" in row
                 else ""))
        return 0
    rows = gpu_check.merge_rows([Path(p) for p in args.files])
    print(gpu_check.table(rows))
    if args.write:
        print(f"wrote {gpu_check.write_check(rows, Path(args.write))} and its figures into results/summary.json")
    return 0


def _lab(args) -> int:
    import subprocess

    cmd = lab_command(args.rest)
    print(" ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, env={**LAB_ENV, **os.environ})


def _exercises(args) -> int:
    from labkit.exercises import report

    print(report(args.status))
    return 0


def main(argv: list[str] | None = None) -> int:
    from labkit import __version__

    ap = argparse.ArgumentParser(prog="python -m labkit", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"labkit {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute the notebooks with papermill")
    r.add_argument("--profile", default="auto", choices=("auto", "ci", "cpu", "gpu"),
                   help="auto (gpu with CUDA, else cpu), ci, cpu or gpu")
    r.add_argument("--only", nargs="+", default=None, metavar="NN", help="notebook numbers or names, e.g. 00 01")
    r.add_argument("--out", default="out/workbook", help="folder for executed notebooks, records, summary")
    r.add_argument("--cell-timeout", type=int, default=1800, help="seconds one cell may run")
    r.set_defaults(fn=_run)
    c = sub.add_parser("ceilings", help="measure copy bandwidth and matmul rate of this device")
    c.add_argument("--out", default=None)
    c.set_defaults(fn=_ceilings)
    m = sub.add_parser("merge", help="merge a run's figures.json into results/summary.json")
    m.add_argument("out_dir")
    m.add_argument("record_root")
    m.set_defaults(fn=_merge)
    sub.add_parser("readme", help="regenerate the README results table and the READMEs' lists of bars not met"
                   ).set_defaults(fn=_readme)
    be = sub.add_parser("bench", help="benchmarks: kernels (Triton vs torch), serve or decode (the engine)")
    be.add_argument("what", help="kernels, serve or decode")
    be.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark (see its --help)")
    be.set_defaults(fn=_bench)
    cl = sub.add_parser("claims", help="check every notebook claim on every machine of results/summary.json it "
                                       "applies to (a table claim x machine); exit 1 if one is false or refused")
    cl.add_argument("--write", action="store_true",
                    help="also record workbook.claims_checked / claims_false / claims_vacuous")
    cl.add_argument("--summary", default=None, metavar="JSON", help="the summary to check against (default "
                    "results/summary.json)")
    cl.add_argument("--sources", nargs="+", type=Path, default=None, metavar="PY",
                    help="the notebook sources whose claims to check (default notebooks/src/*.py)")
    cl.set_defaults(fn=_claims)
    b = sub.add_parser("build-notebooks", help="build notebooks/*.ipynb from notebooks/src/*.py")
    b.add_argument("--check", action="store_true", help="only report notebooks out of date; exit 1 if any")
    b.set_defaults(fn=_build)
    d = sub.add_parser("docs", help="write docs/api.md from the docstrings of each package's exported names")
    d.add_argument("--out", default=None, help="the page to write (default: docs/api.md of the repository)")
    d.add_argument("--check", action="store_true", help="only report whether the page is out of date; exit 1 if so")
    d.set_defaults(fn=_docs)
    la = sub.add_parser("lab", help="jupyter lab on notebooks/ (passes --allow-root when run as root)")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="more jupyter lab arguments, e.g. --no-browser")
    la.set_defaults(fn=_lab)
    ex = sub.add_parser("exercises", help="list the exercises of notebooks 01-08 with your status (pass, fail, "
                                          "not tried)")
    ex.add_argument("--status", default=None, help="the status file (default: $LABKIT_EXERCISES_STATUS or "
                                                   "~/.labkit/exercises.json)")
    ex.set_defaults(fn=_exercises)
    g = sub.add_parser("gpu-check", help="scripts/gpu_check.sh's rows: record one stage, or print the table")
    g.add_argument("action", choices=("record", "table"))
    g.add_argument("files", nargs="*", help="table: gpu_check.json files of one machine and commit")
    g.add_argument("--write", default=None, metavar="RESULTS_DIR",
                   help="table: keep the merged rows as RESULTS_DIR/records/gpu_check.json (e.g. results/h100) and "
                        "merge workbook.gpu_notebooks_passed / gpu_run_seconds into results/summary.json")
    for flag, kind in (("--stage", str), ("--rc", int), ("--seconds", float), ("--log", str), ("--run", str),
                       ("--out", str), ("--before", str)):
        g.add_argument(flag, type=kind, default=None, help="record: " + flag[2:])
    g.set_defaults(fn=_gpu_check)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
