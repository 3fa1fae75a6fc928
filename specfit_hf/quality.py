"""Quality checks: ROUGE on CNN/DailyMail and final-answer accuracy on GSM8K.

SpecFit is lossless, so its greedy outputs must equal autoregressive decoding's token
for token; this check asserts exactly that and reports the task metrics of both (which
are then necessarily equal) so a regression in either shows up.

The metrics are ``evaluate`` metric modules.  ``evaluate.load("rouge")`` fetches its
script from the Hub, which this project cannot reach at run time, so the modules are
defined here on top of the same ``rouge_score`` package the Hub script uses.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

import datasets
import evaluate
import torch

__all__ = ["Rouge", "FinalAnswerAccuracy", "gsm8k_final_answer", "QualityReport", "quality_check"]


def _text_pairs() -> datasets.Features:
    """Features of a metric over (prediction, reference) strings."""
    return datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")})


class Rouge(evaluate.Metric):
    """ROUGE-1/2/L F-measure (``rouge_score``, Porter stemming), mean over examples."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="ROUGE-1, ROUGE-2 and ROUGE-L F-measure via rouge_score",
            citation="Lin, 2004. ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description="predictions: list of str; references: list of str",
            features=_text_pairs(),
        )

    def _compute(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
        from rouge_score import rouge_scorer

        types = ("rouge1", "rouge2", "rougeL")
        scorer = rouge_scorer.RougeScorer(list(types), use_stemmer=True)
        scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
        return {t: statistics.fmean(s[t].fmeasure for s in scores) if scores else 0.0 for t in types}


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def gsm8k_final_answer(text: str) -> str | None:
    """The final answer of a GSM8K-style solution: the number after ``####``, else the last number."""
    marker = text.find("####")
    scope = text[marker + 4:] if marker >= 0 else text
    numbers = _NUMBER.findall(scope)
    if not numbers:
        return None
    value = numbers[0] if marker >= 0 else numbers[-1]
    value = value.replace(",", "")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


class FinalAnswerAccuracy(evaluate.Metric):
    """Exact match of the extracted GSM8K final answers."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="exact match of GSM8K final answers (number after ####, else last number)",
            citation="Cobbe et al., 2021. Training Verifiers to Solve Math Word Problems.",
            inputs_description="predictions: list of str; references: list of str",
            features=_text_pairs(),
        )

    def _compute(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
        hits = [
            gsm8k_final_answer(p) is not None and gsm8k_final_answer(p) == gsm8k_final_answer(r)
            for p, r in zip(predictions, references)
        ]
        return {"accuracy": sum(hits) / len(hits) if hits else 0.0}


@dataclass
class QualityReport:
    """Task metrics of autoregressive and SpecFit outputs, and whether they are identical."""

    metrics: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # dataset -> policy -> metric
    identical: dict[str, bool] = field(default_factory=dict)
    prompts: dict[str, int] = field(default_factory=dict)


@torch.inference_mode()
def quality_check(
    target: Any,
    draft: Any,
    tokenizer: Any,
    *,
    n_prompts: int = 20,
    max_new_tokens: int = 64,
    policy: str = "specfit",
    max_source_chars: int = 1500,
    data_dir: str | None = None,
    progress: bool = True,
) -> QualityReport:
    """Greedy autoregressive vs ``policy`` on GSM8K and CNN/DailyMail test prompts.

    Raises ``AssertionError`` naming the first prompt whose outputs differ.
    """
    from tqdm.auto import tqdm

    from .data import load_prompts
    from .generation import SpecFitConfig

    report = QualityReport()
    metric_for = {"cnn_dailymail": Rouge(), "gsm8k": FinalAnswerAccuracy()}
    for name, metric in metric_for.items():
        rows = load_prompts(name, "test", n=n_prompts, data_dir=data_dir, max_source_chars=max_source_chars)
        outputs: dict[str, list[str]] = {"autoregressive": [], policy: []}
        for i, row in enumerate(tqdm(rows, desc=f"quality {name}", disable=not progress)):
            ids = tokenizer(row["prompt"], return_tensors="pt").input_ids.to(target.device)
            ar = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
            cfg = SpecFitConfig(policy=policy, do_sample=False, max_new_tokens=max_new_tokens)
            sf = target.generate(ids, assistant_model=draft, generation_config=cfg)
            if not torch.equal(ar, sf):
                raise AssertionError(f"{name} prompt {i}: {policy} output differs from autoregressive decoding")
            for label, seq in (("autoregressive", ar), (policy, sf)):
                outputs[label].append(tokenizer.decode(seq[0, ids.shape[1]:], skip_special_tokens=True))
        references = [r["reference"] for r in rows]
        report.metrics[name] = {
            label: metric.compute(predictions=preds, references=references) for label, preds in outputs.items()
        }
        report.identical[name] = True
        report.prompts[name] = len(rows)
    return report
