"""examples/acceptance_ceiling.py: chains with a scripted per-depth acceptance stay lossless and hit their rate."""

from __future__ import annotations

import pytest

from specfit_hf.cli import load_pair
from specfit_hf.offload import offload_experts

from test_generation import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def offloaded_pair():
    target, draft, tokenizer = load_pair(None, None, "cpu")
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    yield target, draft, tokenizer
    runtime.detach()


def test_scripted_acceptance_rates_and_lossless(offloaded_pair, example_module):
    target, draft, tokenizer = offloaded_pair
    module = example_module("acceptance_ceiling")
    prompts = [tokenizer(text, return_tensors="pt").input_ids
               for text in ("Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
                            "Article: The city council met on Monday to discuss the new park.\nSummary:")]
    method = draft.make_tree_drafter
    base, table = module.measure(target, draft, prompts, [0.0, 1.0, None], [1, 3], max_new_tokens=20)
    assert base > 0
    # every scripted run's output equals plain decoding's (measure raises otherwise); the rates are as scripted
    assert table[(0.0, 1)][2] == pytest.approx(1.0) and table[(0.0, 3)][2] == pytest.approx(1.0)
    assert table[(1.0, 1)][2] == pytest.approx(2.0, abs=0.15)  # the last cycle may be cut by max_new_tokens
    assert table[(1.0, 3)][2] > 3.2
    assert all(v[0] > 0 for v in table.values())
    assert draft.make_tree_drafter == method  # the draft is left as it was


def test_scripted_drafter_rejects_a_bad_alpha(example_module):
    module = example_module("acceptance_ceiling")
    with pytest.raises(ValueError, match="alpha"):
        module.ScriptedAcceptanceDrafter(None, [1, 2], 1.5, None, 10)
