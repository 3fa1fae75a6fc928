#!/usr/bin/env python
"""Train the byte-level BPE tokenizer of the shipped tiny SpecFit model pair.

Trains on the training side of the data only (GSM8K train, CNN/DailyMail validation,
public-domain corpus; see ``specfit_hf.data.load_training_text``) and saves a
``PreTrainedTokenizerFast`` that ``AutoTokenizer.from_pretrained`` loads.

Digits are split one per token: GSM8K arithmetic is far easier for a tiny model when
"1234" is four digit tokens instead of an arbitrary BPE merge.

Every encoded text starts with ``<|bos|>`` (added by the post-processor), so training
and inference tokenise prompts identically. ``<|eos|>`` ends documents; ``<|pad|>`` pads.

Example::

    .venv/bin/python examples/train_tokenizer.py --out runs/tokenizer --vocab-size 4096
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from specfit_hf.data import load_training_text

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with individual digits; returns the transformers wrapper."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=4096,
        padding_side="left",  # batched generation pads on the left
        clean_up_tokenization_spaces=False,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/tokenizer"))
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 259 < args.vocab_size <= 65536:
        p.error("--vocab-size must be in (259, 65536]")

    t0 = time.perf_counter()
    text = load_training_text(args.data_dir, seed=args.seed)
    print(f"training documents: {len(text.train)} (validation held out: {len(text.validation)})")
    tokenizer = train_tokenizer(text.train, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)

    # Report compression on the held-out text: tokens per character drives both the
    # sequence length the target needs and how fast it can be trained.
    n_chars = sum(len(d) for d in text.validation)
    n_tokens = sum(len(ids) for ids in tokenizer(text.validation)["input_ids"])
    stats = {
        "vocab_size": len(tokenizer),
        "validation_chars_per_token": round(n_chars / max(n_tokens, 1), 3),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    (args.out / "train_stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats))
    sample = "Question: Natalia sold 48/2 = 24 clips.\nAnswer: #### 72"
    print(sample, "->", tokenizer.tokenize(sample))


if __name__ == "__main__":
    main()
