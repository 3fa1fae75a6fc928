"""examples/regenerate_draft_data.py: self-distillation rows are the target's own greedy continuations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specfit_hf.embedded import embedded_pair

from test_generation import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rows_are_the_targets_greedy_continuations(tmp_path, example_module):
    target = embedded_pair().target
    if not (target / "config.json").is_file():
        pytest.skip("the embedded target is not in this checkout")
    questions = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
                 "A box holds 12 eggs. How many eggs are in 4 boxes?",
                 "Sam reads 10 pages a day for a week. How many pages does he read?"]
    _write(tmp_path / "data" / "gsm8k" / "train.jsonl",
           [{"question": q, "answer": "x\n#### 1"} for q in questions])
    out = tmp_path / "rows.jsonl"
    module = example_module("regenerate_draft_data")
    summary = module.regenerate("gsm8k", "train", None, 12, 2, target, out, data_dir=tmp_path / "data", check=3)
    assert summary["rows"] == 3 and summary["check_rows"] == 3
    assert summary["check_mismatches"] == 0  # batched (left padding) equals one prompt at a time
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for q, row in zip(questions, rows):
        prompt = f"Question: {q}\nAnswer:"
        assert row["text"].startswith(prompt)
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            greedy = model.generate(**enc, max_new_tokens=12, do_sample=False)[0, enc.input_ids.shape[1]:]
        eos = tok.eos_token_id
        want = greedy.tolist()
        want = want[: want.index(eos) + 1] if eos in want else want
        assert row["new_tokens"] == len(want)
        assert row["text"] == prompt + tok.decode(want, skip_special_tokens=True) or row["text"] == tok.decode(
            tok(prompt)["input_ids"] + want, skip_special_tokens=True)
    with pytest.raises(ValueError, match="test split"):
        module.regenerate("gsm8k", "test", None, 4, 2, target, out, data_dir=tmp_path / "data")
