"""Train the draft model for speculative decoding (``data/pydocs-llama-draft``) and write its model card.

The embedded model's recipe (``scripts/train_embedded_model.py``: same corpus, same tokenizer, AdamW with warm-up
and cosine decay, early stopping on held-out loss) on a shape a sixth of its size, ``DRAFT``: 2 layers, hidden
128, 2 query heads sharing 1 KV head, SwiGLU of 384, tied embeddings (1.4 M parameters, 2.9 MB in bf16). It
shares ``data/pydocs-llama/tokenizer.json`` (a draft must share the target's vocabulary), so the directory ships
no tokenizer of its own. Made to train on a CPU in about a quarter of an hour:

    python scripts/train_draft_model.py [--steps 700] [--batch 16] [--seq-len 256]

Writes ``data/pydocs-llama-draft/`` (config, bf16 safetensors, README.md: the model card) and
``results/model/records/train_draft_model.json``.
"""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path

import torch

from labkit.bench import environment
from labkit.data import DATA_DIR, REPO_ROOT
from labkit.model import TINY, ModelConfig, count_parameters

# the embedded model's training loop, from the script beside this one (scripts/ is not a package)
train = runpy.run_path(str(Path(__file__).with_name("train_embedded_model.py")))["train"]

DRAFT = ModelConfig(name="pydocs-llama-draft", vocab_size=8192, hidden_size=128, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=64, intermediate_size=384, tie_word_embeddings=True,
                    max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5)
DRAFT_DIR = DATA_DIR / "pydocs-llama-draft"
RECORD = REPO_ROOT / "results/model/records/train_draft_model.json"

ARCH = ("| architecture | `LlamaForCausalLM`: 2 layers, hidden 128, 2 query heads sharing 1 KV head, head dim 64, "
        "SwiGLU MLP of 384, RMSNorm, RoPE (theta 10,000), tied embeddings, 2,048 positions |")
TRAINING = ("| training | {steps} steps of {batch} x {seq_len} tokens ({tokens:,} tokens), AdamW (0.9/0.95, wd 0.1), "
            "peak lr {lr}, cosine decay, fp32 on the CPU, {train_s:.0f} s; kept the step of lowest held-out loss "
            "({best_step}) |")
CARD = """# pydocs-llama-draft

A {params:,}-parameter Llama-architecture draft model for speculative decoding (notebook 09), trained from scratch
by the labkit project with the recipe of the embedded model `data/pydocs-llama` ({ratio:.0f}x fewer parameters), on
the same corpus and with the same tokenizer.

| | |
| --- | --- |
{arch}
| parameters | {params:,} ({embed:,} of them the tied embedding table) |
| weights | bf16 safetensors, {mb:.2f} MB |
| tokenizer | the embedded model's: `data/pydocs-llama/tokenizer.json` (a draft must share its target's vocabulary) |
| corpus | as `data/pydocs-llama` (Python 3.11 documentation sources; PSF licence, see `data/pydocs/`) |
{training}
| held-out perplexity | **{ppl:.2f}** (the target's: 23.39; unigram baseline {uni:.1f}) |

```
python scripts/train_draft_model.py --steps {steps} --batch {batch} --seq-len {seq_len} --lr {lr} \\
    --warmup {warmup} --eval-every {eval_every}
```
Record: `results/model/records/train_draft_model.json`. What it is for, and how often the target accepts its
tokens: `notebooks/09_speculative.ipynb`.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DRAFT_DIR)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--attn-dropout", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    res = train(args, spec=DRAFT)
    model = res.pop("model")
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    params = count_parameters(model)
    mb = sum(p.stat().st_size for p in args.out.glob("*.safetensors")) / 1e6
    (args.out / "README.md").write_text(CARD.replace("{arch}", ARCH).replace("{training}", TRAINING).format(
        params=params, ratio=TINY.num_params / params, embed=DRAFT.vocab_size * DRAFT.hidden_size, mb=mb,
        steps=args.steps, batch=args.batch, seq_len=args.seq_len, tokens=args.steps * args.batch * args.seq_len,
        lr=args.lr, warmup=args.warmup, eval_every=args.eval_every, train_s=res["train_s"],
        best_step=res["best_step"], ppl=res["heldout_ppl_fp32"],
        uni=res["unigram_ppl"]))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    record = {"env": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "params": params, **res}
    RECORD.write_text(json.dumps(record, indent=1))
    print(f"best step {res['best_step']}: held-out ppl {res['heldout_ppl_fp32']:.2f}, {params:,} params, "
          f"{mb:.2f} MB, {res['train_s']:.0f}s")


if __name__ == "__main__":
    main()
