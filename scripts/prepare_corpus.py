"""Build the embedded model's corpus and tokenizer from Debian's python3.11-doc package.

The corpus is the reStructuredText sources of the Python 3.11 documentation (``html/_sources/**/*.rst.txt``),
licensed under the PSF License Agreement (the package's copyright file is copied beside the splits). Files are
assigned to splits by a hash of their path, so the split is stable and no file straddles two splits:

* ``heldout.txt``  about 5% of the files outside ``c-api/``: perplexity only, never trained or calibrated on
* ``calib.txt``    about 3% of the files outside ``c-api/``: calibration of GPTQ/AWQ and KV quantisation
* ``train.txt.gz`` the rest outside ``c-api/``: pre-training the embedded model
* ``task_train.txt`` / ``task_heldout.txt``: the ``c-api/`` pages, unseen in pre-training, for fine-tuning

Run (here, where Debian's registry is reachable)::

    python scripts/prepare_corpus.py            # downloads python3.11-doc with apt-get, writes data/pydocs/
    python scripts/prepare_corpus.py --deb path/to/python3.11-doc_*.deb
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "pydocs"
SOURCES = "usr/share/doc/python3.11/html/_sources"
SKIP = {"whatsnew/changelog.rst.txt"}  # a machine-made list of issue titles, not prose
SEP = "\n\n<|endoftext|>\n\n"


def bucket(rel: str) -> int:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100


def extract(deb: Path, dest: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    return dest / SOURCES


def split_files(src: Path) -> dict[str, list[Path]]:
    splits: dict[str, list[Path]] = {k: [] for k in ("train", "calib", "heldout", "task_train", "task_heldout")}
    for f in sorted(src.rglob("*.rst.txt")):
        rel = f.relative_to(src).as_posix()
        if rel in SKIP:
            continue
        b = bucket(rel)
        if rel.startswith("c-api/"):
            splits["task_heldout" if b < 15 else "task_train"].append(f)
        elif b < 5:
            splits["heldout"].append(f)
        elif b < 8:
            splits["calib"].append(f)
        else:
            splits["train"].append(f)
    return splits


def join(files: list[Path]) -> str:
    return SEP.join(f.read_text(encoding="utf-8").strip() for f in files) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deb", type=Path, help="python3.11-doc .deb (default: apt-get download it)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=tmp, check=True)
            deb = next(tmp.glob("python3.11-doc_*.deb"))
        src = extract(deb, tmp / "x")
        OUT.mkdir(parents=True, exist_ok=True)
        for name, files in split_files(src).items():
            text = join(files)
            if name == "train":
                with gzip.open(OUT / "train.txt.gz", "wt", encoding="utf-8", compresslevel=9) as fh:
                    fh.write(text)
            else:
                (OUT / f"{name}.txt").write_text(text, encoding="utf-8")
            print(f"{name:13s} {len(files):4d} files {len(text) / 1e6:6.2f} MB")
        shutil.copy(tmp / "x/usr/share/doc/python3.11-doc/copyright", OUT / "LICENSE-python-docs.txt")
        (OUT / "SOURCE.txt").write_text(f"Debian package: {deb.name}\nFiles: {SOURCES}/**/*.rst.txt\n")


if __name__ == "__main__":
    main()
