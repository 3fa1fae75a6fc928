"""Sampling is lossless: committed tokens follow the target's (processed) distribution exactly.

Two levels:
* ``accept`` on a hand-built tree and fixed target logits, many draws (strong test);
* ``generate(do_sample=True)`` end to end on a tiny-vocabulary model (wiring test: the
  standard temperature / top-k / top-p processors reach the tree acceptance).
Fixed seeds make the outcomes deterministic; alpha = 1e-3 per chi-square test.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specfit_hf.generation import Drafter, SpecFitConfig, TreeCandidateGenerator, accept
from specfit_hf.selection import get_policy
from specfit_hf.tree import CycleContext, DraftTree

from test_generation import noisy_copy, one_thread, tiny_llama  # noqa: F401  (one_thread is a fixture)

ALPHA = 1e-3


pytestmark = pytest.mark.usefixtures("one_thread")


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Chi-square goodness of fit; categories with zero probability must never occur."""
    counts = counts.double()
    probs = probs.double()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"{what}: sampled a token with zero target probability"
    n = counts.sum()
    expected = probs[~zero] / probs[~zero].sum() * n
    stat, pvalue = chisquare(counts[~zero].numpy(), expected.numpy())
    assert pvalue > ALPHA, f"{what}: chi-square p={pvalue:.2e}\nobserved {counts.tolist()}\nexpected {expected.tolist()}"


class ScriptedDrafter(Drafter):
    """Adds predetermined levels: ``levels[d]`` = (tokens, parents) of depth d+1."""

    def __init__(self, levels):
        self.levels = levels

    def start(self, prompt_ids, target_features):
        pass

    def draft_level(self, tree: DraftTree) -> None:
        tokens, parents = self.levels[tree.num_levels]
        probs = torch.full((len(tokens),), 0.5)
        tree.add_level(torch.tensor(tokens), torch.tensor(parents), probs)

    def commit(self, tree, result, target_features):
        pass


def _candidates(levels, max_verify_nodes=100):
    cfg = SpecFitConfig(max_depth=len(levels), tree_top_k=4, max_verify_nodes=max_verify_nodes)
    policy = get_policy("eagle3", cfg)
    ctx = CycleContext(target=None, config=cfg)
    gen = TreeCandidateGenerator(ScriptedDrafter(levels), policy, ctx, cfg.max_depth, "cpu", torch.float32)
    return gen.propose(root_token=0, prefix_len=3)


# root children: tokens 1, 2, 5 (node 0, 1, 2); node 0 (token 1) has children 3, 1 (nodes 3, 4);
# node 1 (token 2) has child 4 (node 5).
LEVELS = [([1, 2, 5], [-1, -1, -1]), ([3, 1, 4], [0, 0, 1])]
V = 7


@pytest.mark.parametrize(
    "processors",
    [
        LogitsProcessorList([TemperatureLogitsWarper(1.0)]),
        LogitsProcessorList([TemperatureLogitsWarper(0.5)]),
        LogitsProcessorList([TemperatureLogitsWarper(1.7), TopKLogitsWarper(4)]),
        LogitsProcessorList([TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.85)]),
    ],
    ids=["T1", "T0.5", "T1.7-topk4", "T0.8-topp0.85"],
)
def test_rejection_sampling_is_lossless(processors):
    cand = _candidates(LEVELS)
    g = torch.Generator().manual_seed(1234)
    logits = torch.randn(cand.input_ids.shape[1], V, generator=g) * 2.0
    # Make drafted children likely enough that accept and reject paths both occur at two levels.
    logits[0, 1] += 2.0
    logits[0, 2] += 1.5
    logits[1, 3] += 3.0
    sequence = torch.tensor([[4, 4, 6, 0]])
    processed = processors(sequence, logits.clone())  # path-independent processors: same rows for every path
    target = torch.softmax(processed, dim=-1)

    n = 6000
    first = torch.zeros(V, dtype=torch.long)
    second_after = {tok: torch.zeros(V, dtype=torch.long) for tok in (1, 2)}  # given an accepted root child
    accepted_depths = torch.zeros(3, dtype=torch.long)
    for _ in range(n):
        res = accept(logits, cand, sequence, processors, do_sample=True, generator=g).result
        toks = res.new_tokens
        first[toks[0]] += 1
        if len(toks) >= 2 and toks[0] in second_after:
            second_after[toks[0]][toks[1]] += 1
        accepted_depths[len(res.accepted)] += 1
    _assert_matches(first, target[0], "first token")
    # Block row of the node holding token 1 (node 0 -> block 1) and token 2 (node 1 -> block 2).
    for tok, row in ((1, 1), (2, 2)):
        assert second_after[tok].sum() > 200, "too few accepted children to test the next level"
        _assert_matches(second_after[tok], target[row], f"token after accepted child {tok}")
    assert accepted_depths[1] > 0 and accepted_depths[2] > 0  # the test exercised deep acceptance


def test_greedy_accept_follows_argmax():
    cand = _candidates(LEVELS)
    logits = torch.full((cand.input_ids.shape[1], V), -5.0)
    logits[0, 1] = 5.0  # root -> token 1 (node 0, block 1)
    logits[1, 1] = 5.0  # node 0 -> token 1 (node 4, block 5)
    logits[5, 6] = 5.0  # bonus 6
    res = accept(logits, cand, torch.tensor([[0]]), LogitsProcessorList(), do_sample=False).result
    assert res.new_tokens == [1, 1, 6] and res.bonus_token == 6
    assert res.accepted == [0, 4] and res.accepted_positions == [0, 1, 5]


def _exact_two_token_distribution(model, prompt, processors):
    """P(t1, t2) under the processed target distribution, by enumeration."""
    with torch.no_grad():
        v = model.config.vocab_size
        l1 = model(prompt).logits[:, -1].float()
        p1 = torch.softmax(processors(prompt, l1), dim=-1)[0]
        seqs = torch.cat([prompt.repeat(v, 1), torch.arange(v)[:, None]], dim=1)
        l2 = model(seqs).logits[:, -1].float()
        p2 = torch.stack([torch.softmax(processors(seqs[i : i + 1], l2[i : i + 1]), dim=-1)[0] for i in range(v)])
    return p1[:, None] * p2


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_generate_sampling_matches_target_distribution(temperature, top_k, top_p):
    v = 8
    target = tiny_llama(21, vocab=v)
    target.generation_config.eos_token_id = None  # every token is an ordinary token here
    with torch.no_grad():  # a few likely tokens per step (a random head is nearly uniform): where the
        target.lm_head.weight.mul_(4.0)  # draft's children hold most of the mass, sampler bugs show
    draft = noisy_copy(target, scale=0.5, seed=22)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    processors = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    # The second token is committed by the tree cycle (the first comes from the prefill).
    exact = _exact_two_token_distribution(target, prompt, processors).reshape(-1)
    # max_new_tokens=2: t1 from the prefill, t2 from the first tree cycle (its first committed
    # token follows the target's distribution whatever the cycle accepts).
    # policy "eagle3": every cycle verifies a tree (a cost-driven policy may skip drafting on a
    # CPU, and then the rejection step would never run).
    cfg = SpecFitConfig(max_new_tokens=2, do_sample=True, temperature=temperature, top_k=top_k or None,
                        top_p=top_p, policy="eagle3", max_depth=3, tree_top_k=3, max_verify_nodes=8, pad_token_id=0,
                        return_dict_in_generate=True)
    torch.manual_seed(0)
    counts = torch.zeros(v * v, dtype=torch.long)
    verified = 0
    for _ in range(DRAWS):
        out = target.generate(prompt, assistant_model=draft, generation_config=cfg)
        t1, t2 = out.sequences[0, prompt.shape[1]].item(), out.sequences[0, prompt.shape[1] + 1].item()
        counts[t1 * v + t2] += 1
        verified += sum(c.nodes_verified for c in out.cycles)
    assert verified >= DRAWS  # the tree's rejection sampling decided t2
    # The tree-committed token alone (8 categories, P(t2) = sum over t1): the most powerful
    # check of the rejection step (a sampler without the residual renormalisation, or one
    # that does not zero rejected children before the bonus draw, fails it).
    _assert_matches(counts.reshape(v, v).sum(0), exact.reshape(v, v).sum(0), f"t2 at T={temperature}")
    # The joint (t1, t2); pool rare outcomes so chi-square expectations stay >= 5.
    order = torch.argsort(exact, descending=True)
    expected = exact[order] * counts.sum()
    keep = int((expected >= 5).sum())
    pooled_counts = torch.cat([counts[order[:keep]], counts[order[keep:]].sum()[None]])
    pooled_probs = torch.cat([exact[order[:keep]], exact[order[keep:]].sum()[None]])
    _assert_matches(pooled_counts, pooled_probs, f"(t1, t2) at T={temperature}")


DRAWS = 1500


def test_generate_sampling_with_lookup_chains_matches_target_distribution():
    """Prompt lookup's chains are point-mass proposals: the token they commit keeps the target's law."""
    v = 8
    target = tiny_llama(21, vocab=v)
    target.generation_config.eos_token_id = None
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1]])  # every token repeats: most t1 find a match
    processors = LogitsProcessorList([TemperatureLogitsWarper(1.0)])
    exact = _exact_two_token_distribution(target, prompt, processors).reshape(v, v)
    cfg = SpecFitConfig(max_new_tokens=2, do_sample=True, policy="lookup", max_depth=3, pad_token_id=0,
                        return_dict_in_generate=True)
    torch.manual_seed(0)
    counts = torch.zeros(v, v, dtype=torch.long)
    verified = 0
    for _ in range(DRAWS):
        out = target.generate(prompt, assistant_model=target, generation_config=cfg)
        t1, t2 = out.sequences[0, prompt.shape[1]].item(), out.sequences[0, prompt.shape[1] + 1].item()
        counts[t1, t2] += 1
        verified += any(c.nodes_verified and c.source == "lookup" for c in out.cycles)
    assert verified >= DRAWS // 4  # a lookup chain's rejection step decided t2 in many draws (482 of 1500)
    _assert_matches(counts.sum(0), exact.sum(0), "t2 after a lookup chain")
    for t1 in range(v):  # t2 given each frequent t1: the chain proposed after t1 differs with t1
        if counts[t1].sum() >= 200:
            _assert_matches(counts[t1], exact[t1] / exact[t1].sum(), f"t2 | t1={t1} after a lookup chain")
