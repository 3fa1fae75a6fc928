"""Evaluation prompts, training text and default model locations for specfit_hf.

One place decides how GSM8K and CNN/DailyMail rows become plain-text prompts, so the
tokenizer/target/draft trainers, the benchmark and the CLI all see the *same* format
the shipped tiny models were trained on (a format mismatch would silently lower
acceptance and make the tiny target look worse than it is).

The prompt format is chat-free plain text:

* GSM8K: ``"Question: {question}\\nAnswer:"`` followed by ``" {answer}"``, where the
  answer is the dataset's worked solution (with its ``<<a*b=c>>`` calculator
  annotations) ending in a ``"#### N"`` line.
* CNN/DailyMail: ``"Article: {article}\\nSummary:"`` followed by ``" {highlights}"``
  (the dataset's newline-separated highlight sentences).

Data live in ``shared/data`` next to the repository (``default_data_dir``); the
``SPECFIT_DATA_DIR`` environment variable overrides that. Files are read with
``datasets.load_dataset("json", ...)``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "DATASETS",
    "DefaultModelPaths",
    "TrainingText",
    "default_data_dir",
    "default_model_paths",
    "format_cnn_dailymail_prompt",
    "format_example",
    "format_gsm8k_prompt",
    "load_prompts",
    "load_training_text",
    "truncate_words",
]

#: Dataset name -> (sub-directory, available splits, category label). The category
#: labels match Spec-Bench's ("math_reasoning", "summarization") so results from
#: both sources can be grouped together.
DATASETS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "gsm8k": ("gsm8k", ("train", "test"), "math_reasoning"),
    "cnn_dailymail": ("cnn_dailymail", ("validation", "test"), "summarization"),
}

#: Corpus files used as general English training text.
CORPUS_FILES: tuple[str, ...] = (
    "gutenberg_nltk.txt",
    "us_presidential_speeches.txt",
    "tinyshakespeare.txt",
)

DATA_DIR_ENV = "SPECFIT_DATA_DIR"
TARGET_MODEL_ENV = "SPECFIT_TARGET_MODEL"
DRAFT_MODEL_ENV = "SPECFIT_DRAFT_MODEL"

_REPO_ROOT = Path(__file__).resolve().parent.parent

TARGET_MODEL_DIRNAME = "specfit-tiny-qwen3moe"
DRAFT_MODEL_DIRNAME = "specfit-tiny-qwen3moe-eagle3"


# --------------------------------------------------------------------------- locations


def default_data_dir() -> Path:
    """Directory holding ``gsm8k/``, ``cnn_dailymail/`` and ``corpus/``.

    ``$SPECFIT_DATA_DIR`` wins when set; otherwise ``<repo>/../shared/data``.

    Raises:
        FileNotFoundError: if the chosen directory does not exist (with the places tried).
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        path = Path(env).expanduser().resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"${DATA_DIR_ENV}={env!r} is not a directory")
        return path
    path = (_REPO_ROOT.parent / "shared" / "data").resolve()
    if not path.is_dir():
        raise FileNotFoundError(
            f"data directory not found at {path}; set ${DATA_DIR_ENV} to the folder "
            "that holds gsm8k/, cnn_dailymail/ and corpus/"
        )
    return path


class DefaultModelPaths(NamedTuple):
    """Folders of the shipped tiny model pair (Hub-style: config, safetensors, tokenizer)."""

    target: Path
    """``Qwen3MoeForCausalLM`` target; load with ``AutoModelForCausalLM.from_pretrained``."""
    draft: Path
    """EAGLE-3 draft; load with ``specfit_hf.eagle3.Eagle3DraftModel.from_pretrained``."""


def default_model_paths() -> DefaultModelPaths:
    """Paths of the default target/draft pair in ``<repo>/model_cards``.

    ``$SPECFIT_TARGET_MODEL`` / ``$SPECFIT_DRAFT_MODEL`` override either folder. The
    paths are returned whether or not they exist (the draft may not have been trained
    yet); callers should check ``path.is_dir()`` and fail with a clear message.
    """
    cards = _REPO_ROOT / "model_cards"
    target = Path(os.environ.get(TARGET_MODEL_ENV) or cards / TARGET_MODEL_DIRNAME)
    draft = Path(os.environ.get(DRAFT_MODEL_ENV) or cards / DRAFT_MODEL_DIRNAME)
    return DefaultModelPaths(target=target, draft=draft)


# --------------------------------------------------------------------------- formats


def format_gsm8k_prompt(question: str) -> str:
    """``"Question: {question}\\nAnswer:"`` — the model continues with the worked solution."""
    return f"Question: {question.strip()}\nAnswer:"


def format_cnn_dailymail_prompt(article: str) -> str:
    """``"Article: {article}\\nSummary:"`` — the model continues with the highlights."""
    return f"Article: {article.strip()}\nSummary:"


def truncate_words(text: str, max_chars: int) -> str:
    """Cut ``text`` to at most ``max_chars`` characters, at a word boundary when possible."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    text = text.strip()
    if len(text) <= max_chars:
        return text
    cut = text.rfind(" ", 0, max_chars + 1)
    return text[: cut if cut > 0 else max_chars].rstrip()


def format_example(dataset: str, row: dict, max_source_chars: int | None = None) -> tuple[str, str]:
    """Return ``(prompt, reference)`` for one raw dataset row.

    ``prompt + " " + reference`` is exactly the training text of that row (the
    reference starts after one space, as a continuation of the prompt).
    ``max_source_chars`` shortens the question/article (not the prompt markers), e.g.
    to keep CNN/DM prompts inside the tiny target's 1024-token training length.
    """
    if dataset == "gsm8k":
        source, reference, fmt = row["question"], row["answer"], format_gsm8k_prompt
    elif dataset == "cnn_dailymail":
        source, reference, fmt = row["article"], row["highlights"], format_cnn_dailymail_prompt
    else:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(DATASETS)}")
    if max_source_chars is not None:
        source = truncate_words(source, max_source_chars)
    return fmt(source), reference.strip()


# --------------------------------------------------------------------------- loading


def _resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    if data_dir is None:
        return default_data_dir()
    path = Path(data_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"data_dir {str(path)!r} is not a directory")
    return path


def _load_jsonl_rows(path: Path) -> list[dict]:
    """Rows of one JSON Lines file, in file order, via ``datasets``' json builder."""
    import datasets  # heavy import; only needed when data is actually read

    if not path.is_file():
        raise FileNotFoundError(f"missing data file {path}")
    ds = datasets.load_dataset("json", data_files=str(path), split="train")
    return ds.to_list()


def load_prompts(
    dataset: str,
    split: str = "test",
    n: int | None = None,
    data_dir: str | os.PathLike | None = None,
    max_source_chars: int | None = None,
) -> list[dict]:
    """Evaluation prompts in the shipped models' plain format.

    Args:
        dataset: ``"gsm8k"`` or ``"cnn_dailymail"``.
        split: ``"test"`` (default) or the training-side split (``"train"`` for GSM8K,
            ``"validation"`` for CNN/DailyMail).
        n: keep the first ``n`` rows (file order, deterministic); ``None`` keeps all.
        data_dir: folder holding the datasets; defaults to :func:`default_data_dir`.
        max_source_chars: if set, shorten each question/article to this many
            characters (word boundary) before formatting. CNN/DM articles average
            ~4,000 characters (~1,300 tokens of the shipped tokenizer), longer than the
            tiny target's 1,024-token training length; 2,500 keeps prompts inside it.

    Returns:
        A list of ``{"prompt": str, "reference": str, "category": str}`` dicts;
        ``category`` is ``"math_reasoning"`` (GSM8K) or ``"summarization"`` (CNN/DM).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(DATASETS)}")
    subdir, splits, category = DATASETS[dataset]
    if split not in splits:
        raise ValueError(f"dataset {dataset!r} has splits {splits}, not {split!r}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 or None, got {n}")
    rows = _load_jsonl_rows(_resolve_data_dir(data_dir) / subdir / f"{split}.jsonl")
    if n is not None:
        rows = rows[:n]
    out = []
    for row in rows:
        prompt, reference = format_example(dataset, row, max_source_chars)
        out.append({"prompt": prompt, "reference": reference, "category": category})
    return out


class TrainingText(NamedTuple):
    """Documents for language-model training, already split train / validation."""

    train: list[str]
    validation: list[str]


def _corpus_chunks(text: str, chunk_chars: int) -> list[str]:
    """Split plain text at blank lines into chunks of roughly ``chunk_chars`` characters."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        para = para.strip()
        if not para:
            continue
        current.append(para)
        size += len(para) + 2
        if size >= chunk_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def load_training_text(
    data_dir: str | os.PathLike | None = None,
    validation_fraction: float = 0.02,
    seed: int = 0,
    corpus_chunk_chars: int = 4000,
    include_corpus: bool = True,
) -> TrainingText:
    """Training documents for the tiny target (and its tokenizer), with a held-out split.

    Uses GSM8K *train* (prompt + worked solution), CNN/DailyMail *validation*
    (article + summary marker + highlights) and the public-domain corpus. GSM8K test
    and CNN/DailyMail test are never included: they are the evaluation prompts.

    The validation split is ``validation_fraction`` of the GSM8K and CNN/DM rows
    (seeded random choice) plus the last ``validation_fraction`` of each corpus file
    (a contiguous tail, so no paragraph of it leaks into training through a
    neighbouring chunk).
    """
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    root = _resolve_data_dir(data_dir)
    rng = random.Random(seed)
    train: list[str] = []
    validation: list[str] = []
    for dataset, split in (("gsm8k", "train"), ("cnn_dailymail", "validation")):
        for row in load_prompts(dataset, split=split, data_dir=root):
            doc = f"{row['prompt']} {row['reference']}"
            (validation if rng.random() < validation_fraction else train).append(doc)
    if include_corpus:
        for name in CORPUS_FILES:
            path = root / "corpus" / name
            if not path.is_file():
                raise FileNotFoundError(f"missing corpus file {path}")
            text = path.read_text(encoding="utf-8")
            cut = int(len(text) * (1.0 - validation_fraction))
            # Move the cut to a paragraph boundary so the tail starts cleanly.
            boundary = text.find("\n\n", cut)
            cut = boundary if boundary != -1 else cut
            train.extend(_corpus_chunks(text[:cut], corpus_chunk_chars))
            validation.extend(_corpus_chunks(text[cut:], corpus_chunk_chars))
    rng.shuffle(train)
    return TrainingText(train=train, validation=validation)
