"""Prompt lookup: the n-gram index, its proposals, the acceptance learnt from committed tokens,
the optimal prefix, and lossless generation with lookup chains (greedy and sampled)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from specfit_hf.generation import SpecFitConfig
from specfit_hf.generation.lookup import PromptLookup
from specfit_hf.selection import SelectionPolicy, register_policy
from specfit_hf.selection.lookup import LookupAcceptance, best_lookup_prefix
from specfit_hf.testing import tiny_draft, tiny_llama, tiny_qwen3_moe, tiny_target
from specfit_hf.tree import CycleContext, DraftTree, LookupProposal, Selection, VerifyResult


def _brute_force_proposal(seq: list[int], max_ngram: int, max_tokens: int, prompt_len: int = 0) -> LookupProposal | None:
    """The definition, spelled out: longest suffix with an earlier occurrence, its latest one."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        suffix = seq[len(seq) - n:]
        for start in range(len(seq) - n - 1, -1, -1):  # occurrences that end before the last token
            if seq[start:start + n] == suffix:
                return LookupProposal(tuple(seq[start + n:start + n + max_tokens]), n, start + n < prompt_len,
                                      source=start + n)
    return None


def test_proposal_is_the_continuation_of_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, max_tokens=4)
    lookup.start([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2], prompt_len=9)
    # suffix [1, 2] occurred at 1 and 6; the latest (6) is followed by 3, 7, 1, 2 (3 is in the prompt)
    assert lookup.propose() == LookupProposal((3, 7, 1, 2), 2, from_prompt=True, source=8)
    lookup.extend([3])
    # now [1, 2, 3] matches (twice): the latest continuation is 7, 1, 2, 3 (generated)
    assert lookup.propose() == LookupProposal((7, 1, 2, 3), 3, from_prompt=False, source=9)
    lookup.extend([4])
    assert lookup.propose() is None  # 4 never occurred before
    assert len(lookup) == 14


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_matches_the_definition(seed):
    g = np.random.default_rng(seed)
    seq = g.integers(0, 4 + seed, size=60).tolist()
    lookup = PromptLookup(max_ngram=4, max_tokens=5)
    lookup.start(seq[:3])
    for i in range(3, len(seq)):
        assert lookup.propose() == _brute_force_proposal(seq[:i], 4, 5, prompt_len=3), i
        lookup.extend(seq[i:i + 1])


def test_bad_lookup_settings_are_errors():
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup(max_ngram=0)
    with pytest.raises(ValueError, match="max_tokens"):
        PromptLookup(max_tokens=0)


def test_proposal_tree_is_a_point_mass_chain():
    tree = LookupProposal((4, 5, 6), 2).tree(root_token=3, length=2)
    assert tree.source == "lookup" and tree.root_token == 3 and tree.num_levels == 2
    assert tree.tokens.tolist() == [4, 5] and tree.parents.tolist() == [-1, 0] and tree.depths.tolist() == [1, 2]
    assert tree.draft_probs.tolist() == [1.0, 1.0] and tree.path_probs.tolist() == [1.0, 1.0]
    assert tree.subtree([0]).source == "lookup"
    assert len(LookupProposal((), 1).tree(3)) == 0


def test_acceptance_follows_proposals_over_cycles():
    acc = LookupAcceptance(max_ngram=4, max_depth=8)
    before = acc.acceptance(2, 3).copy()
    # proposal (n = 2) of three tokens: the first cycle commits two of them, the next the third
    acc.observe(LookupProposal((7, 8, 9), 2), [7, 8])
    acc.observe(None, [9, 1])
    accepted, tried = acc.counts
    np.testing.assert_allclose(tried[1, :3], [0.99, 0.99, 1.0])  # one cycle of decay on the first two
    np.testing.assert_allclose(accepted[1, :3], [0.99, 0.99, 1.0])
    assert tried[1, 3:].sum() == 0 and tried[[0, 2, 3]].sum() == 0  # the proposal ended; other rows untouched
    assert (acc.acceptance(2, 3) > before).all()
    # a miss at depth 2 ends the proposal there: depth 3 is never tried
    acc.observe(LookupProposal((7, 5, 9), 9), [7, 8, 9])
    accepted, tried = acc.counts
    assert tried[3, :3].tolist() == [1.0, 1.0, 0.0] and accepted[3, :2].tolist() == [1.0, 0.0]
    assert acc.acceptance(4, 12).shape == (12,)
    # a proposal copied from the prompt is counted apart from one copied from the generated text
    acc.observe(LookupProposal((4,), 1, from_prompt=True), [4])
    assert acc.counts[1, 4, 0] == 1.0 and acc.counts[1, 0, 0] == 0.0
    assert acc.acceptance(1, 1, from_prompt=True)[0] > acc.acceptance(1, 1)[0]


def test_acceptance_prefers_longer_matches_once_measured():
    acc = LookupAcceptance(max_ngram=4, max_depth=4)
    g = np.random.default_rng(0)
    for _ in range(300):
        n = int(g.integers(1, 5))
        right = g.random() < 0.2 * n  # longer matches are right more often
        acc.observe(LookupProposal((1,), n), [1 if right else 2])
    q = [float(acc.acceptance(n, 1)[0]) for n in (1, 2, 3, 4)]
    assert q == sorted(q) and q[0] < 0.35 and q[3] > 0.65


@pytest.mark.parametrize("seed", range(20))
def test_best_prefix_is_the_throughput_optimum(seed):
    g = np.random.default_rng(seed)
    q = g.random(int(g.integers(1, 9)))
    root, node = float(g.uniform(0.5, 2.0)), float(g.uniform(0.01, 1.5))
    h, expected, seconds = best_lookup_prefix(q, root, node)
    rates = [(1 + sum(np.prod(q[:j + 1]) for j in range(k))) / (root + k * node) for k in range(1, q.size + 1)]
    assert h == 1 + int(np.argmax(rates))
    assert expected / seconds == pytest.approx(max(rates))
    with pytest.raises(ValueError):
        best_lookup_prefix(np.array([]), 1.0, 1.0)


def _looping_prompts(vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    """Prompts that repeat a short random pattern: a random target continues them partly in kind,
    so the context keeps offering lookup chains that are sometimes right."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        pattern = torch.randint(0, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        out.append(pattern.repeat(int(torch.randint(2, 5, (1,), generator=g)))[None])
    return out


@pytest.mark.parametrize("policy,tree", [("lookup", {"max_depth": 1}), ("lookup", {"max_depth": 5}),
                                         ("specfit", {"max_depth": 4, "tree_top_k": 3})])
def test_greedy_with_lookup_chains_matches_generate(policy, tree):
    torch.set_num_threads(1)
    target = tiny_qwen3_moe(0)
    draft = tiny_llama(7, layers=1)
    lookup_tokens = 0
    for ids in _looping_prompts(target.config.vocab_size, 12, seed=3):
        ref = target.generate(ids, do_sample=False, max_new_tokens=20)
        cfg = SpecFitConfig(policy=policy, max_new_tokens=20, do_sample=False, return_dict_in_generate=True, **tree)
        out = target.generate(ids, assistant_model=draft, generation_config=cfg)
        assert torch.equal(out.sequences, ref), (policy, tree, ids.tolist())
        lookup_tokens += sum(c.tokens_accepted for c in out.cycles)
    if policy == "lookup":
        assert lookup_tokens > 10  # lookup chains were verified and accepted, not only plain steps


def test_lookup_policy_verifies_the_proposal_and_never_drafts():
    torch.set_num_threads(1)
    target = tiny_llama(3)
    draft = tiny_llama(7, layers=1)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]])
    cfg = SpecFitConfig(policy="lookup", max_depth=3, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    out = target.generate(ids, assistant_model=draft, generation_config=cfg)
    assert all(c.draft_seconds == 0 and c.levels_drafted == 0 for c in out.cycles)
    seq = out.sequences[0].tolist()
    end = ids.shape[1] + 1  # the context of the first cycle ends with the prefill's token
    for cycle in out.cycles:
        proposal = _brute_force_proposal(seq[:end], 8, 3)
        assert cycle.nodes_verified == (0 if proposal is None else len(proposal.tokens))
        end += cycle.tokens_committed
    assert sum(c.nodes_verified for c in out.cycles) > 0


def test_eagle3_drafter_commits_a_lookup_chain_as_read_later():
    """After a lookup cycle the EAGLE-3 draft reads the root and the accepted tokens with the next
    tree, exactly as if they had come from plain steps."""
    target = tiny_target()
    vocab = target.config.vocab_size
    a, b = tiny_draft(), tiny_draft()
    drafters = [d.make_tree_drafter(target, type("C", (), {"tree_top_k": 3})()) for d in (a, b)]
    idx = drafters[0].target_feature_indices
    prompt = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(2))
    tokens = [3, 11, 12, 5]  # root, two accepted lookup tokens, the bonus

    def features(seq):
        with torch.no_grad():
            out = target(input_ids=seq, output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in idx], dim=-1)

    feats = features(torch.cat([prompt, torch.tensor([tokens[:3]])], 1))
    for d in drafters:
        d.start(prompt, feats[:, :prompt.shape[1]])
    # drafter 0: one lookup cycle accepting two tokens; drafter 1: three plain steps
    chain = LookupProposal((11, 12, 13), 3).tree(tokens[0])
    drafters[0].commit(chain, VerifyResult([0, 1], [0, 1, 2], tokens[1:], tokens[3]), feats[:, -3:])
    for i in range(3):
        drafters[1].commit(DraftTree(tokens[i]), VerifyResult([], [0], [tokens[i + 1]], tokens[i + 1]),
                           feats[:, prompt.shape[1] + i:prompt.shape[1] + i + 1])
    trees = _next_trees(drafters, tokens[3])
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    torch.testing.assert_close(trees[0].draft_probs, trees[1].draft_probs)
    drafters[0].commit(trees[0], VerifyResult([], [0], [6], 6), feats[:, -1:])
    foreign = DraftTree(6)  # a drafted tree this drafter did not grow: accepting its nodes is an error
    foreign.add_level(torch.tensor([1]), torch.tensor([-1]), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="never expanded"):
        drafters[0].commit(foreign, VerifyResult([0], [0, 1], [1, 2], 2), feats[:, :2])


def test_specfit_learns_lookup_acceptance_from_every_cycle():
    """The specfit policy compares each cycle's proposal with the committed tokens (plain cycles too)."""
    from specfit_hf.clock import simulated
    from specfit_hf.selection import SpecFitPolicy

    torch.set_num_threads(1)
    target = tiny_llama(3)
    draft = tiny_llama(7, layers=1)
    seen = []
    original = SpecFitPolicy.observe

    def spy(self, tree, selection, result, record):
        original(self, tree, selection, result, record)
        seen.append(float(self.gate.state.lookup.counts[1].sum()))

    SpecFitPolicy.observe = spy
    try:
        ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]])
        cfg = SpecFitConfig(max_new_tokens=16, do_sample=False, max_depth=3, tree_top_k=2,
                            policy_kwargs={"share_drafting": False})
        with simulated():
            target.generate(ids, assistant_model=draft, generation_config=cfg)
    finally:
        SpecFitPolicy.observe = original
    assert seen and seen[-1] > 0  # proposals were tried against committed tokens


def test_lookup_tokens_option_is_checked():
    with pytest.raises(ValueError, match="lookup_tokens"):
        SpecFitConfig(policy_kwargs={"lookup_tokens": -1})
    assert SpecFitConfig(policy_kwargs={"lookup_tokens": 0}).policy_kwargs == {"lookup_tokens": 0}


def test_every_short_pattern_proposes_like_the_definition():
    """Exhaustive over all sequences of length 7 on 3 symbols (2,187 contexts)."""
    for seq in itertools.product(range(3), repeat=7):
        lookup = PromptLookup(max_ngram=3, max_tokens=3)
        lookup.start(seq)
        assert lookup.propose() == _brute_force_proposal(list(seq), 3, 3, prompt_len=7), seq


def _policy_with_measurements(chain_accepts: dict[int, bool]):
    """A specfit policy whose gate has measured plain steps (10 ms) and 2-level chains (12 ms), the chains
    accepted whole in the lookup classes that ``chain_accepts`` marks True and rejected in the others."""
    from specfit_hf.selection import SpecFitPolicy
    from specfit_hf.tree import CycleContext

    cfg = SpecFitConfig(policy="specfit", max_depth=4, tree_top_k=2,
                        policy_kwargs={"share_drafting": False, "share_acceptance": False})
    policy = SpecFitPolicy(cfg)
    policy.reset(CycleContext(target=None, config=cfg))
    gate = policy.gate
    for _ in range(30):
        gate.observe("plain", 1, 0.010)
        for context, right in chain_accepts.items():
            gate.observe("chain:2", 3 if right else 1, 0.012, nodes=2, accepted=2 if right else 0, context=context)
    return policy


def test_lookup_chain_replaces_a_plain_step_only_when_it_pays():
    from specfit_hf.selection.lookup import lookup_context

    proposal = LookupProposal((5, 6, 7, 8), ngram=8)
    policy = _policy_with_measurements({})
    policy._kind, policy._context = "plain", lookup_context(proposal)
    for _ in range(50):  # lookup proposals after 8-gram matches are always right
        policy.gate.state.lookup.observe(proposal, [5, 6, 7, 8])
    chain = policy._lookup_cycle(proposal)
    assert chain is not None and chain.lookup and chain.nodes.tolist() == list(range(len(chain.nodes)))
    assert chain.throughput > 1 / 0.010  # predicted faster than a plain step
    for _ in range(300):  # ... and then never
        policy.gate.state.lookup.observe(proposal, [9, 9, 9, 9])
    assert policy._lookup_cycle(proposal) is None
    policy._kind = "chain:3"  # nor a deeper chain (not measured here)
    assert policy._lookup_cycle(LookupProposal((5, 6, 7, 8), ngram=8)) is None


def test_lookup_chain_replaces_a_deeper_chain_only_where_its_cycles_commit_little():
    """A deep chain verifying a short prefix on fresh text commits what a short chain does, and a lookup
    chain replaces it like one; where the deep chain commits many tokens the draft takes the repeats."""
    from specfit_hf.selection.lookup import lookup_context
    from specfit_hf.selection.specfit import _LOOKUP_TOKENS

    proposal = LookupProposal((5, 6, 7, 8), ngram=8)
    decisions = {}
    for committed, verified in ((2, 2), (8, 7)):
        policy = _policy_with_measurements({lookup_context(proposal): True})
        for _ in range(30):  # chain:7's own cycles: drafted 7 levels, verified a prefix
            policy.gate.observe("chain:7", committed, 0.012, nodes=verified, accepted=committed - 1,
                                context=lookup_context(proposal))
        for _ in range(50):  # lookup proposals after 8-gram matches are always right
            policy.gate.state.lookup.observe(proposal, [5, 6, 7, 8])
        policy._kind, policy._context = "chain:7", lookup_context(proposal)
        tokens = policy.gate.ranked_figures()["chain:7"][0]
        decisions[committed] = (tokens, policy._lookup_cycle(proposal))
    tokens, chain = decisions[2]
    assert tokens <= _LOOKUP_TOKENS and chain is not None and chain.lookup
    tokens, chain = decisions[8]
    assert tokens > _LOOKUP_TOKENS and chain is None


def test_lookup_chain_must_beat_the_draft_where_the_text_repeats():
    """Where chains accept everything after this class of match, a lookup chain does not replace them."""
    from specfit_hf.selection.lookup import lookup_context

    strong, weak = LookupProposal((5, 6), ngram=8), LookupProposal((5, 6), ngram=1)
    c_strong, c_weak = lookup_context(strong), lookup_context(weak)
    decisions = {}
    for context, proposal in ((c_strong, strong), (c_weak, weak)):
        policy = _policy_with_measurements({c_strong: True, c_weak: False})
        for _ in range(50):  # both proposals are right half the time
            policy.gate.state.lookup.observe(proposal, [5, 6] if _ % 2 else [9, 9])
        policy._kind, policy._context = "chain:2", context
        decisions[context] = policy._lookup_cycle(proposal)
    assert decisions[c_strong] is None  # the draft's chain is right every time here
    assert decisions[c_weak] is not None and decisions[c_weak].lookup  # here it never is


def test_context_routing_keeps_every_positions_routing_in_order():
    from specfit_hf.selection.forecast import ContextRouting

    memory = ContextRouting()
    assert not memory.active and memory.at(0, 1) is None
    prompt = np.arange(3 * 2 * 2).reshape(3, 2, 2)  # 3 positions, 2 layers, top-2
    memory.start(prompt)
    for step in range(5):  # grows past its first size
        memory.append(np.full((2, 2, 2), 100 + step))
    assert memory.length == 13
    np.testing.assert_array_equal(memory.at(0, 3), prompt)
    np.testing.assert_array_equal(memory.at(3, 2), np.full((2, 2, 2), 100))
    tail = memory.at(12, 3)  # the last known position, then two not routed yet
    np.testing.assert_array_equal(tail[0], np.full((2, 2), 104))
    assert (tail[1:] == -1).all()
    assert memory.at(-1, 2) is None
    memory.append(np.zeros((1, 3, 2), dtype=np.int64))  # another shape: it stops rather than misalign
    assert not memory.active and memory.at(0, 1) is None


def test_context_routing_reads_a_verifys_routing_only_when_asked_and_in_order():
    """``append_later`` keeps the read for later: the positions count at once, the read is made when a
    caller asks for any position, in the order the verifies ran, each taking its accepted rows."""
    from specfit_hf.selection.forecast import ContextRouting

    memory = ContextRouting()
    memory.start(np.zeros((2, 2, 2), dtype=np.int64))
    reads = []

    def verify(value, rows):
        def read():
            reads.append(value)
            return np.stack([np.full((2, 2), value + row) for row in range(rows)])
        return read

    memory.append_later(verify(10, 3), [0, 2])  # root and the second node accepted
    memory.append_later(verify(20, 1), [0])
    assert memory.length == 5 and reads == []  # counted, not read
    memory.append(np.full((1, 2, 2), 30))  # an array appended after them lands after them
    np.testing.assert_array_equal(memory.at(2, 4)[:, 0, 0], [10, 12, 20, 30])
    assert reads == [10, 20]
    memory.append_later(verify(40, 2), [1])
    assert memory.known(6, 1)[0, 0, 0] == 41 and reads == [10, 20, 40]
    memory.append_later(lambda: np.zeros((1, 3, 2), dtype=np.int64), [0])  # another shape, read later: stops
    assert memory.length == 8 and memory.at(0, 1) is None and not memory.active


class _Residents:
    """A read-only view stand-in: fixed residents, and the routing of a 'last forward'."""

    def __init__(self, resident: np.ndarray, routing: np.ndarray | None = None) -> None:
        self._resident, self.routing = resident, routing

    def resident(self) -> np.ndarray:
        return self._resident.copy()

    def last_routing(self, rows: int | None = None) -> np.ndarray | None:
        if self.routing is None or (rows is not None and rows != self.routing.shape[0]):
            return None
        return self.routing

    def last_routing_later(self, rows: int | None = None):
        routing = self.last_routing(rows)
        return None if routing is None else (lambda: routing)


def test_lookup_misses_count_what_the_repeated_text_routed_to():
    """The root is guessed by the match's last position, each copied token by its original: a prefix
    pays the non-resident experts it adds, and adds distinct experts in roots' worth."""
    from specfit_hf.selection.forecast import ExpertForecast

    resident = np.zeros((2, 8), dtype=bool)
    resident[:, :4] = True  # experts 0-3 of both layers are on the device
    prompt = np.array([[[0, 1], [0, 1]],    # position 0
                       [[0, 5], [1, 2]],    # 1: the match's last token (the root's guess): misses 5 in layer 0
                       [[5, 6], [2, 3]],    # 2: the first copied token: adds 6 (miss) in layer 0, 3 (resident)
                       [[7, 6], [0, 7]]])   # 3: the second: adds 7 in layer 0 and 0, 7 in layer 1
    view = _Residents(resident, routing=prompt)
    forecast = ExpertForecast(None, view)
    forecast.start_context(view.last_routing(rows=4))
    misses, added = forecast.lookup_misses(LookupProposal((9, 9, 9), 2, source=2))
    np.testing.assert_array_equal(misses, [1, 2, 4, 4])  # the third copied token is not routed yet
    np.testing.assert_allclose(added, np.array([0, 2, 5, 5]) / 4)
    assert forecast.lookup_misses(LookupProposal((9,), 1)) is None  # no source position: no guess
    assert forecast.lookup_misses(None) is None
    # a verify of the root (position 4) and one node, the root and the node accepted: two more positions
    view.routing = np.array([[[1, 2], [1, 2]], [[3, 4], [3, 4]]])
    forecast.remember(4, 1, [0, 1])
    assert forecast.context.length == 6
    np.testing.assert_array_equal(forecast.context.at(5, 1)[0], [[3, 4], [3, 4]])
    forecast.remember(9, 0, [0])  # a root the context does not reach: the positions no longer line up
    assert not forecast.context.active


def test_specfits_context_routing_is_the_targets_routing_of_every_position():
    """After a generation with lookup and drafted cycles, the remembered routing of each position is
    what the target routes that token to when it reads the whole sequence at once."""
    from specfit_hf import offload_experts
    from specfit_hf.clock import simulated
    from specfit_hf.selection import SpecFitPolicy

    torch.set_num_threads(1)
    target = tiny_qwen3_moe(0)
    draft = tiny_llama(7, layers=1)
    runtime = offload_experts(target, device="cpu", slots_per_layer=4)
    seen = []
    original = SpecFitPolicy.observe

    def spy(self, tree, selection, result, record):
        original(self, tree, selection, result, record)
        seen.append((self, tree.source, self._context_guess))

    SpecFitPolicy.observe = spy
    try:
        matched = total = 0
        for ids in _looping_prompts(target.config.vocab_size, 6, seed=5):
            seen.clear()
            cfg = SpecFitConfig(max_new_tokens=24, do_sample=False, max_depth=3, tree_top_k=2,
                                return_dict_in_generate=True, policy_kwargs={"share_drafting": False})
            with simulated():
                out = target.generate(ids, assistant_model=draft, generation_config=cfg)
            memory = seen[-1][0].forecast.context
            seq = out.sequences
            assert memory.active and memory.length == seq.shape[1] - 1  # all but the last bonus token
            with torch.no_grad():
                target(seq[:, :memory.length])
            whole = runtime.view().last_routing()
            remembered = memory.at(0, memory.length)
            same = (np.sort(whole, axis=-1) == np.sort(remembered, axis=-1)).all(axis=(1, 2))
            matched, total = matched + int(same.sum()), total + same.size
            assert any(guess is not None for _, _, guess in seen)  # plain steps / lookup chains were guessed
        seen.clear()  # without lookup proposals nothing reads the context: it is not kept
        cfg = SpecFitConfig(max_new_tokens=8, do_sample=False, max_depth=3, tree_top_k=2,
                            policy_kwargs={"share_drafting": False, "lookup_tokens": 0})
        with simulated():
            target.generate(ids, assistant_model=draft, generation_config=cfg)
        assert seen and not seen[-1][0].forecast.context.active
    finally:
        SpecFitPolicy.observe = original
        runtime.detach()
    assert matched >= 0.98 * total  # an incremental forward may flip a near-tie of the router


def test_lookup_chain_and_the_plain_step_it_replaces_share_this_cycles_root():
    """A lookup chain competes with the plain step of *its* cycle: where the text it repeats says the root's
    experts are resident, that step is cheap and the copied tokens' loads must pay against it, not against
    the mean plain step (which, once lookups take the repeats, is the novel text's costly one)."""
    from specfit_hf.selection.lookup import lookup_context

    proposal = LookupProposal((5, 6, 7, 8), ngram=8)
    decisions = {}
    for root_misses in (0, 8):
        policy = _policy_with_measurements({})
        for _ in range(30):  # plain steps: 5 ms of compute and 8 loads of 10 ms each
            policy.gate.observe("plain", 1, 0.085, loads=8, root_loads=8, t_expert=0.010)
        for _ in range(50):  # these proposals are right half the time
            policy.gate.state.lookup.observe(proposal, [5, 6, 7, 8] if _ % 2 else [9, 9, 9, 9])
        policy._kind, policy._context = "plain", lookup_context(proposal)
        # the repeat's routing: the root's misses, then two more for every copied token
        guess = (np.array([root_misses + 2 * i for i in range(5)]), np.arange(5, dtype=np.float64))
        policy._repeat_guess = lambda _proposal, guess=guess: guess
        decisions[root_misses] = policy._lookup_cycle(proposal)
    assert decisions[0] is None  # a 5 ms plain step beats paying 20 ms a copied token
    assert decisions[8] is not None and decisions[8].lookup  # an 85 ms one does not


@register_policy("test-lookup-after-a-level")
class _LookupAfterALevel(SelectionPolicy):
    """Drafts a level, then verifies the prompt-lookup chain where there is one (the drafted node dropped),
    else the drafted node: every cycle with a proposal abandons a drafted tree for it."""

    lookup_tokens = 4  # the loop offers prompt-lookup proposals this long

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        if len(tree) == 0:
            return Selection(nodes=torch.empty(0, dtype=torch.long), stop=False, children=1)
        if ctx.lookup is not None and ctx.lookup.tokens:
            return Selection(nodes=torch.arange(len(ctx.lookup.tokens)), stop=True, lookup=True)
        return Selection(nodes=torch.arange(1), stop=True)


@pytest.mark.parametrize("draft_kind", ["eagle3", "causal"])
def test_greedy_matches_generate_when_lookup_chains_replace_drafted_levels(draft_kind):
    torch.set_num_threads(1)
    if draft_kind == "eagle3":
        target, draft = tiny_target(), tiny_draft()
    else:
        target, draft = tiny_qwen3_moe(0), tiny_llama(7, layers=1)
    switched = 0
    for ids in _looping_prompts(target.config.vocab_size, 10, seed=5):
        ref = target.generate(ids, do_sample=False, max_new_tokens=24)
        cfg = SpecFitConfig(policy="test-lookup-after-a-level", max_depth=4, max_new_tokens=24, do_sample=False,
                            return_dict_in_generate=True)
        out = target.generate(ids, assistant_model=draft, generation_config=cfg)
        assert torch.equal(out.sequences, ref), (draft_kind, ids.tolist())
        switched += sum(c.source == "lookup" and c.draft_seconds > 0 for c in out.cycles)
    assert switched > 10  # drafted levels were dropped for lookup chains, many times


def _drafters_after_a_dropped_level(drafters, target, prompt, tokens, features):
    """Drafter 0 drafts a level below ``tokens[0]``, then commits a lookup chain that accepted two tokens;
    drafter 1 commits the same chain without drafting.  Returns each drafter's next tree (two levels)."""
    feats = features(torch.cat([prompt, torch.tensor([tokens[:3]])], 1))  # None: a drafter that reads none
    for d in drafters:
        d.start(prompt, None if feats is None else feats[:, :prompt.shape[1]])
    drafted = DraftTree(tokens[0])
    drafters[0].draft_level(drafted)
    chain = LookupProposal((11, 12, 13), 3).tree(tokens[0])
    for d in drafters:
        d.commit(chain, VerifyResult([0, 1], [0, 1, 2], tokens[1:], tokens[3]), None if feats is None else feats[:, -3:])
    return _next_trees(drafters, tokens[3])


def _next_trees(drafters, root: int) -> list[DraftTree]:
    """Each drafter's next tree below ``root``, two levels."""
    trees = []
    for d in drafters:
        tree = DraftTree(root)
        for _ in range(2):
            d.draft_level(tree)
        trees.append(tree)
    return trees


def test_eagle3_drafter_drops_its_levels_when_a_lookup_chain_is_verified_instead():
    """A tree the EAGLE-3 draft began and the policy replaced by a lookup chain: the root it read is kept, its
    drafted level dropped, and the next tree is the one a drafter that never drafted there grows."""
    target = tiny_target()
    a, b = tiny_draft(), tiny_draft()
    drafters = [d.make_tree_drafter(target, type("C", (), {"tree_top_k": 3})()) for d in (a, b)]
    idx = drafters[0].target_feature_indices
    prompt = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))

    def features(seq):
        with torch.no_grad():
            out = target(input_ids=seq, output_hidden_states=True)
        return torch.cat([out.hidden_states[i] for i in idx], dim=-1)

    trees = _drafters_after_a_dropped_level(drafters, target, prompt, [3, 11, 12, 5], features)
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    torch.testing.assert_close(trees[0].draft_probs, trees[1].draft_probs)
    # a lookup chain below another root than the tree this drafter began (root 5) is an error, not a mix-up
    with pytest.raises(ValueError, match="another root"):
        drafters[0].commit(LookupProposal((7,), 1).tree(9), VerifyResult([], [0], [7], 7), torch.zeros(1, 1, 1))


def test_causal_lm_drafter_drops_its_levels_when_a_lookup_chain_is_verified_instead():
    from specfit_hf.generation.causal_lm_drafter import CausalLMTreeDrafter

    target = tiny_llama(3)
    drafters = [CausalLMTreeDrafter(tiny_llama(7, layers=1), target, type("C", (), {"tree_top_k": 3})())
                for _ in range(2)]
    prompt = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    trees = _drafters_after_a_dropped_level(drafters, target, prompt, [3, 11, 12, 5], lambda seq: None)
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    torch.testing.assert_close(trees[0].draft_probs, trees[1].draft_probs)
    assert drafters[0].cache.get_seq_length() == drafters[1].cache.get_seq_length()


def test_a_chain_whose_first_token_is_the_lookups_verifies_the_lookup_only_where_it_pays():
    """After a chain's first level agrees with the lookup proposal, the lookup chain replaces it where the
    lookup's tokens are right and the chains in such cycles are not; never before that class is measured."""
    from specfit_hf.selection.lookup import lookup_context

    proposal = LookupProposal((5, 6, 7, 8), ngram=8)
    context = lookup_context(proposal)
    tree = DraftTree(4)
    tree.add_level(torch.tensor([5]), torch.tensor([-1]), torch.tensor([0.9]))
    decisions = {}
    for lookup_right, chain_right, agreed_cycles in ((True, False, 30), (False, True, 30), (True, False, 1)):
        policy = _policy_with_measurements({})
        for _ in range(agreed_cycles):  # 2-level chains whose first token was the lookup's: the second right or not
            policy.gate.observe("chain:2", 3 if chain_right else 2, 0.012, nodes=2, accepted=2 if chain_right else 1,
                                context=context, agreed=True)
        for _ in range(50):
            policy.gate.state.lookup.observe(proposal, [5, 6, 7, 8] if lookup_right else [5, 9, 9, 9])
        policy._kind, policy._context, policy._proposal = "chain:2", context, proposal
        decisions[lookup_right, agreed_cycles] = policy._agreed_lookup(tree)
    chain = decisions[True, 30]
    assert chain is not None and chain.lookup and len(chain.nodes) == 4
    assert decisions[False, 30] is None  # the chain's tokens are right there and the lookup's are not: it goes on
    assert decisions[True, 1] is None  # the agreed class has hardly been measured: the chain runs and measures it


def test_measurements_carried_over_from_fewer_lookup_classes_gain_the_agreed_ones():
    """Measurements exported before the agreed classes existed (8 lookup classes, no agreed seconds) still load."""
    from specfit_hf.selection.gate import DraftingGate, DraftingMeasurements, chain_kinds
    from specfit_hf.selection.lookup import AGREED, LOOKUP_CONTEXTS

    old = DraftingMeasurements(interval=8)
    old.depth_context = old.depth_context[:AGREED].copy()
    old.depth_context[2, 1, 0] = 3.0
    del old.agreed_seconds
    gate = DraftingGate(old, True, chain_kinds(4), 8, 16)
    assert old.depth_context.shape[0] == LOOKUP_CONTEXTS and gate.context_trials(2) == 3.0
    gate.observe("chain:2", 2, 0.01, nodes=2, accepted=1, context=2, agreed=True)
    assert gate.context_trials(2 + AGREED) > 0 and old.agreed_seconds.shape == (LOOKUP_CONTEXTS, 2)


def test_chains_stop_to_compare_with_the_lookup_less_often_where_it_never_replaces_them():
    from specfit_hf.selection.gate import _CHECK_EVERY, DraftingGate, DraftingMeasurements, chain_kinds

    gate = DraftingGate(DraftingMeasurements(interval=8), True, chain_kinds(4), 8, 16)
    assert gate.agreed_check_due(3)  # a class never checked
    for _ in range(10):  # checked, the chain always stayed
        gate.state.cycle += 1
        gate.agreed_checked(3, False)
    assert not gate.agreed_check_due(3)
    gate.state.cycle += _CHECK_EVERY
    assert gate.agreed_check_due(3)  # ... but it is checked again now and then
    for _ in range(3):  # where the lookup is verified instead now and then, every chain checks
        gate.state.cycle += 1
        gate.agreed_checked(5, True)
        gate.agreed_checked(5, False)
    gate.agreed_checked(5, False)
    assert gate.agreed_check_due(5)
