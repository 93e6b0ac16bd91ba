"""Evaluate the shipped embedded model and write its model card (``data/pydocs-llama/README.md``).

Measures, on this machine, the held-out perplexity of the weights as shipped (bf16 safetensors, evaluated in
float32) next to an add-one unigram baseline on the same tokens; plots the training loss curve from the H200
training record; generates a few greedy samples; writes the record ``results/model/records/model_eval.json`` and
merges the figures ``model.heldout_ppl`` and ``model.unigram_ppl`` into ``results/summary.json``.

    python scripts/model_card.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from labkit.bench import record_figure, write_record
from labkit.data import EMBEDDED_MODEL_DIR, REPO_ROOT, split_tokens
from labkit.evaluate import perplexity, unigram_perplexity
from labkit.figures import merge_figures
from labkit.model import count_parameters, load_model

TRAIN_RECORD = REPO_ROOT / "results/h200/records/train_embedded_model.json"
OUT = REPO_ROOT / "results/model"
PROMPTS = ["The list type", "To open a file,", "Exceptions are raised when", "A decorator is"]


def loss_curve(record: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in record["runs"].items():
        steps = [e["step"] for e in run["log"]]
        ax.plot(steps, [e["loss"] for e in run["log"]], alpha=0.5, label=f"run {name}: train")
        ax.plot([e["step"] for e in run["evals"]], [e["heldout_loss"] for e in run["evals"]], "o-", ms=3,
                label=f"run {name}: held-out")
    chosen = record["runs"][record["chosen"]]
    ax.axvline(chosen["best_step"], color="k", ls=":", label=f"kept: run {record['chosen']}, step {chosen['best_step']}")
    ax.set(xlabel="step (64 x 512 tokens)", ylabel="cross-entropy (nats/token)", ylim=(0, 9),
           title="pydocs-llama training (H200)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    model, tok = load_model()
    heldout, train = split_tokens("heldout", tok), split_tokens("train", tok)
    ppl = perplexity(model, heldout, seq_len=512, batch_size=8, progress=True)
    uni = unigram_perplexity(train, heldout, tok.vocab_size)
    samples = {}
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
        samples[p] = tok.decode(out[0])
    record = json.loads(TRAIN_RECORD.read_text())
    loss_curve(record, EMBEDDED_MODEL_DIR / "loss_curve.png")
    rec = write_record("model_eval", {"heldout_ppl": ppl, "unigram_ppl": uni, "heldout_tokens": len(heldout),
                                      "train_tokens": len(train), "params": count_parameters(model),
                                      "seq_len": 512, "samples": samples}, out_dir=OUT)
    record_figure("model.heldout_ppl", ppl, "perplexity", rec, bar=f"<= unigram / 3 = {uni / 3:.0f}", out_dir=OUT)
    record_figure("model.unigram_ppl", uni, "perplexity", rec, out_dir=OUT)
    merge_figures(OUT / "figures.json", "results/model")
    write_card(record, ppl, uni, samples, count_parameters(model))
    print(f"held-out perplexity {ppl:.2f}, unigram {uni:.1f} (ratio {uni / ppl:.1f}x)")


def write_card(record: dict, ppl: float, uni: float, samples: dict, params: int) -> None:
    run = record["runs"][record["chosen"]]
    args = run["args"]
    cmd = (f"python scripts/train_embedded_model.py --out OUT --steps {args['steps']} --lr {args['lr']} "
           f"--attn-dropout {args['attn_dropout']}")
    others = ", ".join(f"run {k}: {v['heldout_ppl_fp32']:.2f}" for k, v in record["runs"].items())
    sample_text = "\n\n".join(f"**{p!r}** →\n```\n{s}\n```" for p, s in samples.items())
    (EMBEDDED_MODEL_DIR / "README.md").write_text(f"""# pydocs-llama

A {params / 1e6:.1f} M-parameter Llama-architecture causal language model trained from scratch by the labkit
project, shipped so that every accuracy measurement in the workbook runs on trained weights without a download.

| | |
| --- | --- |
| architecture | `LlamaForCausalLM`: 8 layers, hidden 256, 4 query heads sharing 2 KV heads (grouped-query attention), head dim 64, SwiGLU MLP of 768, RMSNorm, RoPE (theta 10,000), tied embeddings, 2,048 positions |
| parameters | {params:,} |
| weights | bf16 safetensors (two shards); load in float32 for accuracy work |
| tokenizer | byte-level BPE, 8,192 tokens, trained on the training split with `tokenizers` (`scripts/train_tokenizer.py`) |
| corpus | reStructuredText sources of the Python 3.11 documentation from Debian's `python3.11-doc` package (`usr/share/doc/python3.11/html/_sources`), split by file: see `data/pydocs/` and `scripts/prepare_corpus.py` |
| licence of the corpus | PSF License Agreement (Python documentation); the package's copyright file is `data/pydocs/LICENSE-python-docs.txt` |
| training data | {run['train_tokens']:,} tokens (files outside `c-api/`, 92% of them); the `c-api/` pages are held back for the fine-tuning notebook |
| held-out data | `data/pydocs/heldout.txt`, {run['heldout_tokens']:,} tokens (5% of the files, never trained on) |
| training hardware | one NVIDIA H200 ({run['env']['torch']}, transformers {run['env']['transformers']}), {run['train_s']:.0f} s |

## Training
```
python scripts/prepare_corpus.py          # corpus splits from python3.11-doc
python scripts/train_tokenizer.py         # tokenizer.json
{cmd}
```
AdamW (betas 0.9/0.95, weight decay {args['wd']}), peak learning rate {args['lr']} with {args['warmup']} warm-up steps and
cosine decay, batches of {args['batch']} x {args['seq_len']} tokens, bf16 autocast. Two runs were made in the same call
(without and with attention dropout 0.1; held-out perplexity {others}); the better was kept, at the step of its
lowest held-out loss (step {run['best_step']}): with 2.4 M training tokens the model over-fits after about 9
epochs, as the curve shows. Record: `results/h200/records/train_embedded_model.json`.

![loss curve](loss_curve.png)

## Evaluation (measured on the shipped weights by `python scripts/model_card.py`)
| | perplexity on the held-out split |
| --- | --- |
| pydocs-llama (512-token windows) | **{ppl:.2f}** |
| unigram baseline (add-one, fitted on the training split, same tokens) | {uni:.1f} |

The model's perplexity is {uni / ppl:.0f}x lower than the unigram baseline's (the bar is 3x). Record:
`results/model/records/model_eval.json`.

## Greedy samples
{sample_text}
""")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
