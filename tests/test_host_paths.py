"""The host-side fast paths of a drafting cycle equal the plain torch computations they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specfit_hf.eagle3.kv import causal_mask as draft_causal_mask
from specfit_hf.generation.drafter import frontier_nodes, newest_to_expand
from specfit_hf.generation.tree_mask import (
    additive_mask,
    ancestor_matrix,
    causal_mask,
    grow_ancestors,
    tree_attention_mask,
    visibility_to_mask,
)
from specfit_hf.generation.verify import _row_argmax
from specfit_hf.testing import tiny_draft, tiny_draft_config
from specfit_hf.tree import DraftTree


def _torch_mask(visible: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    q, k = visible.shape
    mask = torch.zeros((1, 1, q, prefix_len + k), dtype=dtype)
    mask[0, 0, :, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_masks_match_torch_construction(dtype):
    g = torch.Generator().manual_seed(0)
    for q in (1, 2, 3, 6):
        for prefix in (0, 1, 9):
            visible = torch.rand(q, q + 2, generator=g) < 0.5
            assert torch.equal(additive_mask(visible.numpy(), prefix, dtype), _torch_mask(visible, prefix, dtype))
            got = visibility_to_mask(visible, prefix, dtype)
            assert got.dtype == dtype and torch.equal(got, _torch_mask(visible, prefix, dtype))
            causal = torch.ones(q, q, dtype=torch.bool).tril()
            for fn in (causal_mask, draft_causal_mask):
                got = fn(q, prefix, dtype, torch.device("cpu"))
                assert got.dtype == dtype and torch.equal(got, _torch_mask(causal, prefix, dtype))
    hidden = torch.tensor([0, 2])
    want = _torch_mask(torch.ones(2, 2, dtype=torch.bool).tril(), 4, dtype)
    want[0, 0, :, hidden] = torch.finfo(dtype).min
    assert torch.equal(tree_attention_mask(torch.tensor([-1, 0]), 4, dtype, prefix_hidden=hidden), want)


def test_grow_ancestors_matches_ancestor_matrix():
    parents = [-1, -1, 0, 0, 1, 2, 4, 4, 6]
    anc = torch.zeros(0, 0, dtype=torch.bool)
    for lo, hi in ((0, 2), (2, 5), (5, 8), (8, 9)):  # a block's parents precede it
        rows, anc = grow_ancestors(anc, torch.tensor(parents[lo:hi]))
        full = ancestor_matrix(torch.tensor(parents[:hi]))
        assert torch.equal(anc, full) and torch.equal(rows, full[lo:hi])


def test_add_level_dtypes_and_values():
    tree = DraftTree(root_token=3)
    tree.add_level(torch.tensor([5, 6]), torch.tensor([-1, -1]), torch.tensor([0.5, 0.25]))
    tree.add_level(torch.tensor([[7]]), torch.tensor([1]), torch.tensor([0.5], dtype=torch.float64))
    assert tree.tokens.dtype == tree.parents.dtype == tree.depths.dtype == torch.long
    assert tree.draft_probs.dtype == tree.path_probs.dtype == torch.float64
    assert tree.depths.tolist() == [1, 1, 2] and tree.path_probs.tolist() == [0.5, 0.25, 0.125]
    # a level with parents at the root and in the tree; user-made float32 fields are promoted
    made = DraftTree(root_token=3, tokens=torch.tensor([5]), parents=torch.tensor([-1]), depths=torch.tensor([1]),
                     draft_probs=torch.tensor([0.5]), path_probs=torch.tensor([0.5]), num_levels=1)
    assert made.add_level(torch.tensor([8, 9]), torch.tensor([0, -1]), torch.tensor([0.5, 0.75])).tolist() == [1, 2]
    assert made.path_probs.dtype == torch.float64 and made.path_probs.tolist() == [0.5, 0.25, 0.75]
    assert made.depths.tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match="already be in the tree"):
        made.add_level(torch.tensor([1]), torch.tensor([3]), torch.tensor([0.5]))


def test_frontier_with_known_newest_level():
    tree = DraftTree(root_token=3)
    tree.add_level(torch.tensor([5, 6]), torch.tensor([-1, -1]), torch.tensor([0.5, 0.25]))
    tree.add_level(torch.tensor([7, 8, 9]), torch.tensor([0, 0, 1]), torch.tensor([0.1, 0.8, 0.9]))
    newest = range(2, 5)
    for expand in (None, torch.tensor([4, 2]), [3]):
        for width in (1, 2, 5):
            want = frontier_nodes(tree, expand, width)
            assert newest_to_expand(tree, expand, width, newest).tolist() == want.tolist()
    for known in (None, newest):
        with pytest.raises(ValueError, match="newest level"):
            newest_to_expand(tree, torch.tensor([1]), 2, known)


def test_row_argmax_matches_torch():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randint(-2, 3, (3, 40), generator=g).float()  # many ties
        x[1, 7] = float("nan")
        assert _row_argmax(x) == x.argmax(dim=-1).tolist()


def _check_rotary(model, positions):
    h = torch.zeros(1, model.config.hidden_size)
    cos, sin = model.rotary_rows(positions, h)
    want_cos, want_sin = model.rotary(h, torch.as_tensor(list(positions)))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize("rope", [None, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}])
def test_rotary_rows_match_rotary(rope):
    model = tiny_draft() if rope is None else tiny_draft(rope_parameters=rope)
    for positions in (range(0, 5), range(7, 8), np.array([9]), np.array([4, 4, 4]), np.array([3, 1, 6]),
                      range(250, 300), np.array([600, 2])):  # the last ones grow the table
        _check_rotary(model, positions)


def test_draft_helpers_match_module_calls():
    model = tiny_draft().eval()
    ids = torch.tensor([[0, 5, 63]])
    assert np.array_equal(model.draft_to_target_host_fn()(ids.numpy()), model.draft_to_target(ids).numpy())
    post = tiny_draft(norm_output=True)
    x = torch.randn(1, 3, post.config.hidden_size)
    assert torch.equal(post.next_hidden_fn()(x), post.norm(x))
    assert tiny_draft_config().hidden_feedback == "pre_norm" and model.next_hidden_fn()(x) is x


def test_nonnegative_ridge_closed_form_matches_the_normal_equations_with_bounds():
    from specfit_hf.selection.calibration import nonnegative_ridge

    def reference(xtx, xty, prior, ridge):
        m = xtx + ridge * np.eye(2)
        r = xty + ridge * prior
        c = np.linalg.solve(m, r)
        if (c >= 0).all():
            return c
        fits = [np.array([max(r[0] / m[0, 0], 0.0), 0.0]), np.array([0.0, max(r[1] / m[1, 1], 0.0)])]
        return min(fits, key=lambda f: float(f @ m @ f - 2 * r @ f))

    rng = np.random.default_rng(0)
    clipped = 0
    for _ in range(2000):
        x = rng.normal(size=(5, 2)) * rng.uniform(0, 3, size=2)
        y = rng.normal(size=5) * 3
        prior, ridge = rng.uniform(0, 2, size=2), rng.uniform(0.01, 2)
        got = nonnegative_ridge(x.T @ x, x.T @ y, prior, ridge)
        assert np.allclose(got, reference(x.T @ x, x.T @ y, prior, ridge), atol=1e-9)
        clipped += int((got == 0).any())
    assert clipped > 100  # the bound is exercised, not only the interior solution


def test_decayed_ridge_fits_the_same_bits_as_numpy_normal_equations():
    """The per-cycle loads fits keep their normal equations in floats: every update and fit gives exactly what
    numpy's decayed 2 x 2 arrays and ``nonnegative_ridge`` gave (the policy's decisions are unchanged)."""
    from specfit_hf.selection.calibration import DecayedRidge, nonnegative_ridge

    rng = np.random.default_rng(1)
    clipped = 0
    for prior, ridge, decay in [((0.0, 1.0), 1.0, 0.9), ((0.3, 0.5), 0.25, 0.95)]:
        fit = DecayedRidge(prior, ridge)
        assert fit.fit() == prior and fit.weight == 0.0  # no data: the prior
        xtx, xty = np.zeros((2, 2)), np.zeros(2)
        for _ in range(300):
            x = np.array([float(rng.uniform(0, 4)), float(rng.integers(0, 6))])
            y = float(rng.integers(-3, 8))
            fit.add(float(x[0]), float(x[1]), y, decay)
            xtx, xty = decay * xtx + np.outer(x, x), decay * xty + x * y
            expected = nonnegative_ridge(xtx, xty, np.array(prior), ridge)
            assert fit.fit() == tuple(expected.tolist())  # bit for bit
            assert fit.weight == xtx[0, 0]
            clipped += int(min(fit.fit()) == 0.0)
    assert clipped > 10  # the bound is exercised too


def test_add_level_grows_in_place_without_changing_earlier_views():
    """Levels are written into host buffers behind the fields: a field read earlier keeps its values,
    growth past the first buffer keeps every row, and numpy inputs are taken as tensors are."""
    tree = DraftTree(root_token=3)
    tree.add_level(np.array([10]), np.array([-1]), np.array([0.5]))
    first_tokens, first_paths = tree.tokens, tree.path_probs
    for depth in range(1, 40):  # a chain past the initial capacity
        tree.add_level(np.array([10 + depth]), np.array([depth - 1]), torch.tensor([0.5]))
    assert first_tokens.tolist() == [10] and first_paths.tolist() == [0.5]
    assert tree.tokens.tolist() == list(range(10, 50))
    assert tree.parents.tolist() == list(range(-1, 39))
    assert tree.depths.tolist() == list(range(1, 41))
    assert tree.path_probs.tolist() == [0.5 ** d for d in range(1, 41)]
    # fields replaced from outside are what the next level builds on
    tree.tokens = tree.tokens.clone()
    tree.tokens[0] = 99
    tree.add_level(np.array([7, 8]), np.array([39, -1]), np.array([1.0, 0.25]))
    assert tree.tokens[0].item() == 99 and tree.tokens[-2:].tolist() == [7, 8]
    assert tree.depths[-2:].tolist() == [41, 1] and tree.path_probs[-1].item() == 0.25
