"""CausalLMTreeDrafter: every drafted node carries the draft model's own probability for its path,
across cycles (the draft cache keeps only accepted paths; unseen accepted leaves are fed later)."""

from __future__ import annotations

import pytest
import torch

from specfit_hf.generation import CausalLMTreeDrafter, SpecFitConfig, make_drafter
from specfit_hf.tree import DraftTree, VerifyResult

from test_generation import VOCAB, one_thread, tiny_llama, tiny_qwen3_moe  # noqa: F401  (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _linear_probs(draft, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.softmax(draft(torch.tensor([seq])).logits[0, -1].float(), dim=-1)


@pytest.mark.parametrize("draft_kind", ["llama", "qwen3_moe"])
def test_tree_matches_linear_draft_across_cycles(draft_kind):
    draft = tiny_llama(5, layers=2) if draft_kind == "llama" else tiny_qwen3_moe(5)
    target = tiny_llama(0)
    drafter = make_drafter(draft, target, SpecFitConfig(tree_top_k=3))
    assert isinstance(drafter, CausalLMTreeDrafter)
    seq = [3, 14, 15, 9, 26]
    drafter.start(torch.tensor([seq]), None)
    root = 5
    g = torch.Generator().manual_seed(0)
    # levels drafted per cycle; 0 = a plain decode step (nothing drafted)
    for levels in [3, 2, 0, 4, 1, 3]:
        tree = DraftTree(root_token=root)
        for _ in range(levels):
            drafter.draft_level(tree)
        context = seq + [root]
        for node in range(len(tree)):
            path = tree.ancestors(node)
            probs = _linear_probs(draft, context + [int(tree.tokens[j]) for j in path[:-1]])
            tok = int(tree.tokens[node])
            torch.testing.assert_close(float(tree.draft_probs[node]), float(probs[tok]), atol=1e-5, rtol=1e-4)
            assert probs[tok] >= probs.topk(3).values[-1] - 1e-6  # one of the top-3 children
        if levels:
            assert tree.num_levels == levels and tree.hidden.shape[0] == len(tree)
            assert tree.root_hidden is not None
        # Accept the path to a random node (often a leaf the draft never ran).
        if len(tree):
            node = int(torch.randint(len(tree), (1,), generator=g))
            accepted = tree.ancestors(node)
        else:
            accepted = []
        bonus = int(torch.randint(VOCAB, (1,), generator=g))
        new_tokens = [int(tree.tokens[j]) for j in accepted] + [bonus]
        # Block positions are only read by the target-side commit; any consistent values do here.
        result = VerifyResult(accepted=accepted, accepted_positions=list(range(len(accepted) + 1)),
                              new_tokens=new_tokens, bonus_token=bonus)
        drafter.commit(tree, result, None)
        seq = context + new_tokens[:-1]
        root = bonus
    # The draft cache never holds more than the committed sequence.
    assert drafter.cache.get_seq_length() <= len(seq)


def test_make_drafter_uses_model_factory():
    class Factory(torch.nn.Module):
        def make_tree_drafter(self, target, config):
            return "not a drafter"

    with pytest.raises(TypeError, match="does not implement"):
        make_drafter(Factory(), tiny_llama(0), SpecFitConfig())


def test_candidate_generator_contract():
    """get_candidates follows transformers' CandidateGenerator contract: input ids + candidates."""
    from specfit_hf.generation import TreeCandidateGenerator
    from specfit_hf.selection import get_policy
    from specfit_hf.tree import CycleContext

    target = tiny_llama(0)
    cfg = SpecFitConfig(max_depth=2, tree_top_k=2, max_verify_nodes=5)
    drafter = make_drafter(tiny_llama(6, layers=1), target, cfg)
    prompt = torch.tensor([[1, 2, 3, 4]])
    drafter.start(prompt[:, :-1], None)  # the last prompt token plays the root
    gen = TreeCandidateGenerator(drafter, get_policy("eagle3", cfg), CycleContext(target, cfg), 2, "cpu",
                                 torch.float32)
    ids, logits = gen.get_candidates(prompt)
    cand = gen.last_candidates
    assert logits is None and ids.shape[1] == prompt.shape[1] + cand.num_nodes
    assert cand.num_nodes == 5 and len(cand.tree) == 2 + 2 * 2
    assert torch.equal(ids[:, : prompt.shape[1]], prompt)
    assert cand.attention_mask.shape == (1, 1, 6, 3 + 6)
    assert cand.position_ids[0].tolist() == [3 + d for d in cand.depths.tolist()]


def test_draft_level_benchmark_times_chains(example_module):
    """examples/bench_draft_level.py grows 1-child chains of the asked depth and reports a per-level time."""
    from transformers import AutoModelForCausalLM

    from specfit_hf import Eagle3DraftModel
    from specfit_hf.data import default_model_paths

    module = example_module("bench_draft_level")
    paths = default_model_paths()
    target = AutoModelForCausalLM.from_pretrained(paths.target)
    draft = Eagle3DraftModel.from_pretrained(paths.draft)
    seconds = module.chain_level_seconds(target, draft, prompt_len=16, depth=4, reps=2, trees_per_rep=1)
    assert 0.0 < seconds < 1.0


@pytest.mark.parametrize("policy_name", ["eagle3", "plan3"])
def test_drafting_plan_of_several_levels(policy_name):
    """A selection with ``levels = n`` drafts n levels before the policy is asked again: the fixed
    shapes (eagle3) ask twice a cycle whatever their depth, and the tree is the one drafted level by level."""
    from specfit_hf.generation import TreeCandidateGenerator
    from specfit_hf.selection import get_policy
    from specfit_hf.selection.policy import SelectionPolicy
    from specfit_hf.tree import CycleContext, Selection

    class PlanThree(SelectionPolicy):  # a 1-child chain, three levels planned at once, then verified
        def select(self, tree, ctx):
            if len(tree) == 0:
                return Selection(nodes=torch.empty(0, dtype=torch.long), stop=False, children=1, levels=3)
            return Selection(nodes=torch.arange(len(tree)), stop=True)

    target = tiny_llama(0)
    depth = 4 if policy_name == "eagle3" else 3
    cfg = SpecFitConfig(max_depth=depth, tree_top_k=2, max_verify_nodes=5)
    calls = []

    def counted(policy):
        inner = policy.select
        policy.select = lambda tree, ctx: calls.append(len(tree)) or inner(tree, ctx)
        return policy

    def grown(plan: bool):
        drafter = make_drafter(tiny_llama(6, layers=1), target, cfg)
        drafter.start(torch.tensor([[1, 2, 3]]), None)
        if plan:
            policy = counted(get_policy("eagle3", cfg) if policy_name == "eagle3" else PlanThree(cfg))
            gen = TreeCandidateGenerator(drafter, policy, CycleContext(target, cfg), depth, "cpu", torch.float32)
            return gen.propose(4, 3).tree
        tree = DraftTree(root_token=4)  # the same drafter's rule, one level per call
        for _ in range(depth):
            drafter.draft_level(tree, children=1 if policy_name == "plan3" else None)
        return tree

    planned, stepwise = grown(True), grown(False)
    assert calls == [0, len(planned)]  # before drafting, and once the planned levels are in
    assert planned.num_levels == depth
    assert planned.tokens.tolist() == stepwise.tokens.tolist()
    assert planned.parents.tolist() == stepwise.parents.tolist()
    if policy_name == "plan3":
        assert len(planned) == 3  # one child a level
    else:
        assert len(planned) == 2 + 2 * 2 * 3  # the drafter's own rule: top-2 of the newest level, 2 children each
