"""Tests for specfit_hf.data: prompt format, loading, splits and default locations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specfit_hf import data


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    """A miniature copy of shared/data with recognisable sentinel texts per split."""
    _write_jsonl(
        tmp_path / "gsm8k" / "train.jsonl",
        [{"question": f"TRAINQ{i} How many?", "answer": f"It is {i}.\n#### {i}"} for i in range(50)],
    )
    _write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl",
        [{"question": f"TESTQ{i} How many?", "answer": f"Step.\n#### {i}"} for i in range(5)],
    )
    _write_jsonl(
        tmp_path / "cnn_dailymail" / "validation.jsonl",
        [{"id": str(i), "article": f"VALART{i} words " * 3, "highlights": f"VALHL{i} .\nMore ."} for i in range(20)],
    )
    _write_jsonl(
        tmp_path / "cnn_dailymail" / "test.jsonl",
        [{"id": str(i), "article": f"TESTART{i} news today", "highlights": f"TESTHL{i} ."} for i in range(4)],
    )
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in data.CORPUS_FILES:
        paras = [f"{name} paragraph {i} " + "text " * 20 for i in range(100)]
        (corpus / name).write_text("\n\n".join(paras))
    return tmp_path


def test_prompt_formats_are_plain_and_stable():
    assert data.format_gsm8k_prompt("  What is 2+2? ") == "Question: What is 2+2?\nAnswer:"
    assert data.format_cnn_dailymail_prompt("Some news.") == "Article: Some news.\nSummary:"
    prompt, ref = data.format_example("gsm8k", {"question": "Q?", "answer": "A.\n#### 4\n"})
    assert (prompt, ref) == ("Question: Q?\nAnswer:", "A.\n#### 4")
    with pytest.raises(ValueError, match="unknown dataset"):
        data.format_example("mmlu", {})


def test_truncate_words_cuts_at_word_boundary():
    assert data.truncate_words("alpha beta gamma", 100) == "alpha beta gamma"
    assert data.truncate_words("alpha beta gamma", 12) == "alpha beta"
    assert data.truncate_words("abcdefghij", 4) == "abcd"  # no space: hard cut
    with pytest.raises(ValueError):
        data.truncate_words("x", 0)


def test_load_prompts_rows_order_and_categories(data_dir: Path):
    rows = data.load_prompts("gsm8k", "test", n=3, data_dir=data_dir)
    assert [r["prompt"] for r in rows] == [f"Question: TESTQ{i} How many?\nAnswer:" for i in range(3)]
    assert rows[2]["reference"] == "Step.\n#### 2"
    assert {r["category"] for r in rows} == {"math_reasoning"}

    cnn = data.load_prompts("cnn_dailymail", data_dir=data_dir)
    assert len(cnn) == 4
    assert cnn[0] == {
        "prompt": "Article: TESTART0 news today\nSummary:",
        "reference": "TESTHL0 .",
        "category": "summarization",
    }
    short = data.load_prompts("cnn_dailymail", n=1, data_dir=data_dir, max_source_chars=11)
    assert short[0]["prompt"] == "Article: TESTART0\nSummary:"
    assert data.load_prompts("gsm8k", n=0, data_dir=data_dir) == []


def test_load_prompts_rejects_bad_input(data_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="unknown dataset"):
        data.load_prompts("squad", data_dir=data_dir)
    with pytest.raises(ValueError, match="splits"):
        data.load_prompts("gsm8k", split="validation", data_dir=data_dir)
    with pytest.raises(ValueError, match="n must be"):
        data.load_prompts("gsm8k", n=-1, data_dir=data_dir)
    with pytest.raises(FileNotFoundError):
        data.load_prompts("gsm8k", data_dir=tmp_path / "nowhere")


def test_training_text_excludes_test_splits_and_holds_out_validation(data_dir: Path):
    text = data.load_training_text(data_dir, validation_fraction=0.2, seed=0)
    everything = "\n".join(text.train + text.validation)
    assert "TESTQ" not in everything and "TESTART" not in everything and "TESTHL" not in everything
    # Every training-side row lands in exactly one split, in the plain prompt format.
    for i in range(50):
        doc = f"Question: TRAINQ{i} How many?\nAnswer: It is {i}.\n#### {i}"
        assert (doc in text.train) + (doc in text.validation) == 1
    n_val_rows = sum(d.startswith(("Question:", "Article:")) for d in text.validation)
    assert 0 < n_val_rows < 70 * 0.5
    assert any("VALART" in d and "\nSummary: VALHL" in d for d in text.train + text.validation)
    # Corpus: the held-out tail shares no paragraph with the training chunks.
    train_paras = {p for d in text.train for p in d.split("\n\n")}
    val_paras = [p for d in text.validation for p in d.split("\n\n") if "paragraph" in p]
    assert val_paras and not train_paras.intersection(val_paras)
    # Seeded: same split again.
    again = data.load_training_text(data_dir, validation_fraction=0.2, seed=0)
    assert again.train == text.train and again.validation == text.validation
    with pytest.raises(ValueError):
        data.load_training_text(data_dir, validation_fraction=1.0)


def test_default_data_dir_env_override(monkeypatch, data_dir: Path, tmp_path: Path):
    monkeypatch.setenv(data.DATA_DIR_ENV, str(data_dir))
    assert data.default_data_dir() == data_dir.resolve()
    assert len(data.load_prompts("gsm8k", n=2)) == 2  # data_dir=None follows the override
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=data.DATA_DIR_ENV):
        data.default_data_dir()


def test_default_model_paths(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(data.TARGET_MODEL_ENV, raising=False)
    monkeypatch.delenv(data.DRAFT_MODEL_ENV, raising=False)
    paths = data.default_model_paths()
    assert paths.target.name == "specfit-tiny-qwen3moe"
    assert paths.draft.name == "specfit-tiny-qwen3moe-eagle3"
    assert paths.target.parent.name == "model_cards" == paths.draft.parent.name
    monkeypatch.setenv(data.TARGET_MODEL_ENV, str(tmp_path / "t"))
    assert data.default_model_paths().target == tmp_path / "t"


def test_real_shared_data_when_present():
    try:
        root = data.default_data_dir()
    except FileNotFoundError:
        pytest.skip("shared/data not available")
    rows = data.load_prompts("gsm8k", n=2, data_dir=root)
    first = json.loads((root / "gsm8k" / "test.jsonl").open().readline())
    assert rows[0]["prompt"] == data.format_gsm8k_prompt(first["question"])
    assert rows[0]["reference"].splitlines()[-1].startswith("#### ")
    cnn = data.load_prompts("cnn_dailymail", n=1, data_dir=root)
    assert cnn[0]["prompt"].startswith("Article: ") and cnn[0]["prompt"].endswith("\nSummary:")
