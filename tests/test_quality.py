"""The evaluate-based quality check on the embedded pair: SpecFit outputs equal autoregressive ones."""

import pytest
import torch

from specfit_hf.cli import load_pair
from specfit_hf.quality import quality_check


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    return load_pair(None, None, "cpu")


def test_quality_check_on_embedded_pair(pair):
    target, draft, tok = pair
    report = quality_check(target, draft, tok, n_prompts=2, max_new_tokens=16, progress=False)
    assert report.identical == {"cnn_dailymail": True, "gsm8k": True}
    assert report.prompts == {"cnn_dailymail": 2, "gsm8k": 2}
    rouge = report.metrics["cnn_dailymail"]
    assert set(rouge) == {"autoregressive", "specfit"}
    assert rouge["autoregressive"] == rouge["specfit"]  # identical outputs, identical scores
    assert 0.0 < rouge["specfit"]["rouge1"] <= 1.0  # the trained model writes news-like words
    assert 0.0 <= report.metrics["gsm8k"]["specfit"]["accuracy"] <= 1.0


def test_quality_check_flags_a_lossy_policy(pair, monkeypatch):
    """A generate path that alters outputs must make the check fail, not report metrics."""
    target, draft, tok = pair
    original = type(target).generate

    def lossy_generate(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if kwargs.get("assistant_model") is not None:
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % self.config.vocab_size
        return out

    monkeypatch.setattr(type(target), "generate", lossy_generate)
    with pytest.raises(AssertionError, match="differs from autoregressive"):
        quality_check(target, draft, tok, n_prompts=1, max_new_tokens=8, progress=False)
