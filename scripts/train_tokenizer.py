"""Train the embedded model's byte-level BPE tokenizer on the pre-training split and save it in HF format.

    python scripts/train_tokenizer.py        # writes data/pydocs-llama/tokenizer.json and its config
"""

from __future__ import annotations

import argparse
from pathlib import Path

from labkit.data import EMBEDDED_MODEL_DIR, read_split
from labkit.model import TINY

SPECIALS = ["<|pad|>", "<|bos|>", "<|endoftext|>"]  # ids 0, 1, 2: the config's pad, bos and eos


def train(vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = read_split("train")
    docs = text.split("<|endoftext|>")
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|endoftext|>", model_max_length=TINY.max_position_embeddings)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    ids = fast(docs[0][:200])["input_ids"]
    print(f"vocab {fast.vocab_size}; '{docs[0][:60]!r}' -> {ids[:16]}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab-size", type=int, default=TINY.vocab_size)
    ap.add_argument("--out", type=Path, default=EMBEDDED_MODEL_DIR)
    a = ap.parse_args()
    train(a.vocab_size, a.out)
