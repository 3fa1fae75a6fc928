"""The shipped tiny model pair in model_cards/ loads with plain transformers calls and is trained.

These tests load the real (small) checkpoints: a 13M-parameter MoE target and its
EAGLE-3 draft. They check loadability, the documented shapes, the size budget and that
the weights are trained (perplexity far below uniform, non-collapsed routing, a
non-degenerate greedy continuation) without asserting any exact text.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from specfit_hf.data import default_model_paths, format_gsm8k_prompt

PATHS = default_model_paths()
SIZE_BUDGET_BYTES = 40 * 1000 * 1000  # target + draft, all files

# Two GSM8K *test* problems (never in training), copied from shared/data/gsm8k/test.jsonl
# so the test does not depend on the data folder.
GSM8K_TEST_SNIPPETS = [
    (
        "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
        "muffins for her friends every day with four. She sells the remainder at the farmers' market "
        "daily for $2 per fresh duck egg. How much in dollars does she make every day at the "
        "farmers' market?",
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 "
        "every day at the farmer\u2019s market.\n#### 18",
    ),
    (
        "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total "
        "does it take?",
        "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is 2+1=<<2+1=3>>3 "
        "bolts of fabric\n#### 3",
    ),
]


def _require(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        pytest.skip(f"{folder} is not in this checkout")


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require(PATHS.target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(PATHS.target).eval()
    tokenizer = AutoTokenizer.from_pretrained(PATHS.target)
    return model, tokenizer


def _front_matter(readme: Path) -> str:
    text = readme.read_text()
    match = re.match(r"^---\n(.*?)\n---\n", text, flags=re.S)
    assert match, f"{readme} lacks Hub YAML metadata"
    return match.group(1)


def test_size_budget():
    _require(PATHS.target)
    total = sum(f.stat().st_size for folder in PATHS for f in folder.rglob("*") if f.is_file())
    assert total <= SIZE_BUDGET_BYTES, f"model cards take {total / 1e6:.1f} MB > 40 MB"


def test_target_card_metadata_and_sections():
    _require(PATHS.target)
    meta = _front_matter(PATHS.target / "README.md")
    for key in ("license:", "datasets:", "tags:", "pipeline_tag:"):
        assert key in meta
    body = (PATHS.target / "README.md").read_text()
    for section in ("Intended use", "Training data", "Training procedure", "Evaluation", "Limitations"):
        assert f"## {section}" in body, section


def test_target_loads_with_documented_shape_in_fp32(target):
    model, tokenizer = target
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert cfg.num_experts == 64 and cfg.num_experts_per_tok == 4
    assert cfg.num_hidden_layers >= 6 and not cfg.mlp_only_layers
    assert cfg.vocab_size == len(tokenizer) <= 8192
    assert model.dtype == torch.float32  # bf16 on disk, fp32 runtime (config dtype)
    ids = tokenizer("Question: 12 + 7 = ?")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == cfg.bos_token_id
    assert tokenizer.eos_token_id == cfg.eos_token_id and tokenizer.pad_token_id is not None
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


@torch.no_grad()
def test_target_perplexity_on_heldout_gsm8k_far_below_uniform(target):
    model, tokenizer = target
    nll, n = 0.0, 0
    for question, answer in GSM8K_TEST_SNIPPETS:
        prompt = format_gsm8k_prompt(question)
        n_prompt = len(tokenizer(prompt)["input_ids"])
        ids = torch.tensor([tokenizer(prompt + " " + answer)["input_ids"]])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
        tok_nll = -logp.gather(1, ids[0, 1:, None])[:, 0][n_prompt - 1 :]
        nll += tok_nll.sum().item()
        n += tok_nll.numel()
    ppl = math.exp(nll / n)
    # Uniform guessing gives ppl = vocab size (4096); the trained target is ~2 orders below.
    assert ppl < len(tokenizer) / 50, ppl


@torch.no_grad()
def test_target_routing_uses_many_experts(target):
    model, tokenizer = target
    question, answer = GSM8K_TEST_SNIPPETS[0]
    ids = torch.tensor([tokenizer(format_gsm8k_prompt(question) + " " + answer)["input_ids"]])
    out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    for layer, logits in enumerate(out.router_logits):
        used = logits.topk(k, dim=-1).indices.unique().numel()
        # ~80 tokens x top-4: a collapsed router would touch only a handful of experts.
        assert used >= 16, f"layer {layer} routes {ids.shape[1]} tokens to only {used} experts"


@torch.no_grad()
def test_target_greedy_continuation_is_sane(target):
    model, tokenizer = target
    question, _ = GSM8K_TEST_SNIPPETS[1]
    enc = tokenizer(format_gsm8k_prompt(question), return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert new.numel() > 0
    assert len(set(new.tolist())) >= 5, f"degenerate continuation: {text!r}"
    assert re.search(r"\d", text), f"no number in a GSM8K answer: {text!r}"


# ----------------------------------------------------------------------------- draft


@pytest.fixture(scope="module")
def draft():
    _require(PATHS.draft)
    from specfit_hf.eagle3 import Eagle3DraftModel

    return Eagle3DraftModel.from_pretrained(PATHS.draft).eval()


def test_draft_card_metadata():
    _require(PATHS.draft)
    meta = _front_matter(PATHS.draft / "README.md")
    for key in ("license:", "base_model:", "tags:", "datasets:"):
        assert key in meta
    assert "specfit-tiny-qwen3moe" in meta


def test_draft_loads_and_matches_target(draft, target):
    model, tokenizer = target
    cfg = draft.config
    assert cfg.vocab_size == model.config.vocab_size
    assert cfg.target_hidden_size == model.config.hidden_size
    ep = cfg.expert_predictor
    assert ep is not None, "the shipped draft carries the expert-predictor heads"
    assert int(ep["num_experts"]) == model.config.num_experts
    assert int(ep["top_k"]) == model.config.num_experts_per_tok


@torch.no_grad()
def test_shipped_pair_speculates_losslessly_with_real_acceptance(draft, target):
    from specfit_hf.generation import SpecFitConfig

    model, tokenizer = target
    question, _ = GSM8K_TEST_SNIPPETS[0]
    enc = tokenizer(format_gsm8k_prompt(question), return_tensors="pt")
    greedy = model.generate(**enc, max_new_tokens=24, do_sample=False)
    config = SpecFitConfig(policy="eagle3", max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    out = model.generate(**enc, assistant_model=draft, generation_config=config)
    assert torch.equal(out.sequences, greedy)
    tau = sum(c.tokens_committed for c in out.cycles) / len(out.cycles)
    # A random draft commits ~1 token per cycle (just the bonus token); the trained one
    # averages ~4.4 on GSM8K test prompts.
    assert tau > 1.5, tau


def test_shipped_pair_speculates_under_inference_mode(target):
    # a draft loaded under torch.inference_mode holds inference tensors (rope frequencies, expert heads), which
    # keep no version counter for its cached tables to check: SpecFit must run with it and stay lossless
    from specfit_hf.eagle3 import Eagle3DraftModel
    from specfit_hf.generation import SpecFitConfig

    _require(PATHS.draft)
    model, tokenizer = target
    question, _ = GSM8K_TEST_SNIPPETS[1]
    enc = tokenizer(format_gsm8k_prompt(question), return_tensors="pt")
    with torch.inference_mode():
        draft = Eagle3DraftModel.from_pretrained(PATHS.draft).eval()
        greedy = model.generate(**enc, max_new_tokens=16, do_sample=False)
        config = SpecFitConfig(policy="specfit", max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
        out = model.generate(**enc, assistant_model=draft, generation_config=config)
    assert torch.equal(out.sequences, greedy)
