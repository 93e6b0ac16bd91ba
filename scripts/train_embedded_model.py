"""Train the embedded model (``data/pydocs-llama``) from scratch on the Python-docs corpus.

A Llama-architecture causal LM (RoPE, RMSNorm, SwiGLU, grouped-query attention: 4 query heads share 2 KV heads)
of the shape ``labkit.model.TINY`` (8.4 M parameters, tied embeddings), trained with AdamW in bf16 autocast on
random 512-token windows of ``data/pydocs/train.txt.gz``, tokenised by ``data/pydocs-llama/tokenizer.json``.
Held-out loss is evaluated every ``--eval-every`` steps and the best checkpoint is kept (early stopping): with
2.4 M training tokens, more steps over-fit.

Made for one GPU (it ran on an H200; see the model card), it runs anywhere, slowly on a CPU:

    python scripts/train_embedded_model.py --out OUT_DIR [--steps 2400] [--batch 64] [--lr 2e-3]

Writes ``OUT_DIR/model/`` (HF format, bf16 safetensors in shards of under 10 MB) and ``OUT_DIR/train_record.json``
(every logged loss, the held-out evaluations, the environment and the command).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from labkit.bench import environment
from labkit.data import EMBEDDED_MODEL_DIR, split_tokens
from labkit.evaluate import perplexity, unigram_perplexity
from labkit.model import TINY


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(tokens: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator, device):
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=gen)
        rows = torch.stack([tokens[s:s + seq_len + 1] for s in starts]).to(device, non_blocking=True)
        yield rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def heldout_loss(model, heldout: torch.Tensor, seq_len: int) -> float:
    model.eval()
    ppl = perplexity(model, heldout, seq_len=seq_len, batch_size=32)
    model.train()
    return math.log(ppl)


def train(args, spec=TINY) -> dict:
    """Train a model of ``spec`` (the embedded model's shape by default; the draft model passes its own)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)
    train_ids, heldout_ids = split_tokens("train", tok), split_tokens("heldout", tok)
    config = spec.to_hf_config()
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    config.attention_dropout = args.attn_dropout
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    data = batches(train_ids, args.batch, args.seq_len, gen, device)
    log, evals, best = [], [], (float("inf"), -1, None)
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x, y = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0:
            log.append({"step": step, "loss": loss.item(), "lr": opt.param_groups[0]["lr"],
                        "tokens": (step + 1) * args.batch * args.seq_len, "s": time.perf_counter() - t0})
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            h = heldout_loss(model, heldout_ids, args.seq_len)
            evals.append({"step": step + 1, "heldout_loss": h, "s": time.perf_counter() - t0})
            print(f"step {step + 1:5d} train {loss.item():.3f} heldout {h:.3f} ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
            if h < best[0]:
                best = (h, step + 1, {k: v.detach().clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    model.eval()
    model.config.attention_dropout = 0.0
    train_s = time.perf_counter() - t0
    ppl = perplexity(model, heldout_ids, seq_len=args.seq_len)
    uni = unigram_perplexity(train_ids, heldout_ids, config.vocab_size)
    return {"model": model, "log": log, "evals": evals, "best_step": best[1], "heldout_ppl_fp32": ppl,
            "unigram_ppl": uni, "train_s": train_s, "train_tokens": len(train_ids),
            "heldout_tokens": len(heldout_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--attn-dropout", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    res = train(args)
    model = res.pop("model")
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out / "model", max_shard_size="9MB")
    record = {"env": environment(), "args": {k: str(v) for k, v in vars(args).items()}, **res}
    (args.out / "train_record.json").write_text(json.dumps(record, indent=1))
    print(f"best step {res['best_step']}: held-out ppl {res['heldout_ppl_fp32']:.2f} "
          f"(unigram {res['unigram_ppl']:.1f}), {res['train_s']:.0f}s")


if __name__ == "__main__":
    main()
