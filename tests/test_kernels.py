"""Fused expert kernels (specfit_kernels) on CPU: the real Triton kernels through the interpreter.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``. So this module imports a *fresh* copy of ``specfit_kernels.fused_moe`` with the
variable set, then puts the environment and ``sys.modules`` back exactly as they were: other test
modules keep whatever copy (or none) they had, and nothing here leaks into their triton imports.
"""

from __future__ import annotations

import pytest
import torch

import specfit_kernels  # noqa: F401
from specfit_kernels import align_pairs_by_slot, fused_experts, fused_experts_reference
from specfit_kernels.align import padded_capacity

from kernel_import import import_fresh_kernels

fm = import_fresh_kernels(interpret=True)
assert fm.INTERPRETED, "the kernel copy under test must run in the Triton interpreter"

# |kernel - reference| <= ATOL + RTOL * |reference|, outputs are O(1). The reference shares the
# kernel's rounding points, so what remains is fp32 summation order plus an occasional one-ulp flip
# of the rounded intermediate.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def make_problem(
    num_tokens,
    top_k,
    hidden,
    inter,
    num_slots,
    dtype=torch.float32,
    *,
    routing="random",
    gpt_oss=False,
    seed=0,
):
    """Random inputs for one call; weights scaled so activations and outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gu = torch.randn(num_slots, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_dn = torch.randn(num_slots, hidden, inter, generator=gen) / inter**0.5
    if routing == "random":  # distinct slots per token (like top-k), some slots never used
        used = max(top_k, num_slots - 2)
        slots = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(num_tokens)])
    elif routing == "one_slot":  # every token's every choice on one slot
        slots = torch.full((num_tokens, top_k), num_slots - 1, dtype=torch.long)
    else:
        raise ValueError(routing)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    kwargs = {}
    if gpt_oss:
        x = x * 4  # pushes some gate/up values past the swiglu clamp limit
        kwargs = dict(
            gate_up_bias=torch.randn(num_slots, 2 * inter, generator=gen),
            down_bias=torch.randn(num_slots, hidden, generator=gen) * 0.1,
            transposed=True,
            interleaved=True,
            activation="swiglu_oai",
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
        )
        w_gu, w_dn = w_gu.transpose(1, 2).contiguous(), w_dn.transpose(1, 2).contiguous()
        kwargs["gate_up_bias"] = kwargs["gate_up_bias"].to(dtype)
        kwargs["down_bias"] = kwargs["down_bias"].to(dtype)
    return (x.to(dtype), w_gu.to(dtype), w_dn.to(dtype), slots, weights.to(dtype)), kwargs


def naive_experts(x, w_gu, w_dn, slots, weights, **kw):
    """Per-pair float64 loop straight from the formula: an oracle independent of the reference."""
    transposed, interleaved = kw.get("transposed", False), kw.get("interleaved", False)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            wgu = w_gu[s].double().T if transposed else w_gu[s].double()  # [2I, H]
            wdn = w_dn[s].double().T if transposed else w_dn[s].double()  # [H, I]
            gu = wgu @ x[t].double()
            if kw.get("gate_up_bias") is not None:
                gu = gu + kw["gate_up_bias"][s].double()
            gate, up = (gu[0::2], gu[1::2]) if interleaved else gu.chunk(2)
            if kw.get("activation", "silu") == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                lim, alpha = kw["swiglu_limit"], kw["swiglu_alpha"]
                gate, up = gate.clamp(max=lim), up.clamp(-lim, lim)
                act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            y = wdn @ act
            if kw.get("down_bias") is not None:
                y = y + kw["down_bias"][s].double()
            out[t] += weights[t, j].double() * y
    return out


def assert_close_to_reference(args, kwargs, dtype):
    got = fm.fused_experts_triton(*args, **kwargs)
    want = fused_experts_reference(*args, **kwargs)
    assert got.dtype == dtype and got.shape == args[0].shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    return got


# (T, k, H, I, S): T from 1 to 64; H and I include non-multiples of the 16/32/64 tiles.
SHAPES = [
    (1, 1, 32, 16, 2),
    (1, 4, 48, 40, 8),
    (5, 2, 40, 24, 6),
    (17, 3, 64, 72, 12),
    (64, 2, 24, 20, 16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}k{}H{}I{}S{}".format(*s))
def test_fp32_random_routing_matches_reference_and_formula(shape):
    args, kwargs = make_problem(*shape)
    got = assert_close_to_reference(args, kwargs, torch.float32)
    torch.testing.assert_close(got.double(), naive_experts(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_on_one_slot(top_k):
    # 40 * k pairs on one slot: several BLOCK_M blocks of the same slot, the others unused.
    args, kwargs = make_problem(40, top_k, 32, 24, 5, routing="one_slot", seed=1)
    got = assert_close_to_reference(args, kwargs, torch.float32)
    torch.testing.assert_close(got.double(), naive_experts(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 2, 40, 24, 4), (33, 4, 64, 48, 10)], ids=str)
def test_half_precision(dtype, shape):
    # bf16 runs through the interpreter with tiles upcast to fp32 before tl.dot (UPCAST), since the
    # interpreter's tl.dot is wrong on bf16 operands; fp16 dots run as they would on the GPU.
    args, kwargs = make_problem(*shape, dtype=dtype, seed=2)
    assert_close_to_reference(args, kwargs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpt_oss_layout(dtype):
    # Transposed weights, interleaved gate/up, biases, clamped swiglu.
    args, kwargs = make_problem(9, 4, 40, 24, 8, dtype=dtype, gpt_oss=True, seed=3)
    got = assert_close_to_reference(args, kwargs, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), naive_experts(*args, **kwargs), atol=1e-5, rtol=1e-5)


def test_strided_inputs_are_read_through_their_strides():
    # A slot buffer that is a view (every other slot), and hidden states that are a column slice.
    args, kwargs = make_problem(6, 2, 32, 24, 6, seed=4)
    x, w_gu, w_dn, slots, weights = args
    wide = torch.randn(6, 64)
    wide[:, 1::2] = x
    x_view = wide[:, 1::2]
    gu_big = torch.zeros(12, *w_gu.shape[1:])
    gu_big[::2] = w_gu
    dn_big = torch.zeros(12, *w_dn.shape[1:])
    dn_big[::2] = w_dn
    got = fm.fused_experts_triton(x_view, gu_big[::2], dn_big[::2], slots, weights)
    torch.testing.assert_close(got, fm.fused_experts_triton(x, w_gu, w_dn, slots, weights), atol=0, rtol=0)


def test_deterministic_and_batch_invariant():
    # Same inputs twice -> identical bits; and each token's row equals the row computed for that token
    # alone, so verifying a batch gives the same numbers as decoding token by token.  The interpreter
    # of Triton >= 3.9 evaluates tl.dot with numpy over the whole block, whose summation order may
    # depend on how many rows the block holds: there a row may differ by one fp32 ulp (seen: 1.2e-7 on
    # one row of three), never more.  Compiled, a row's reduction order does not depend on the others.
    args, kwargs = make_problem(12, 2, 40, 24, 6, seed=5)
    first = fm.fused_experts_triton(*args)
    assert torch.equal(first, fm.fused_experts_triton(*args))
    x, w_gu, w_dn, slots, weights = args
    for t in (0, 5, 11):
        alone = fm.fused_experts_triton(x[t : t + 1], w_gu, w_dn, slots[t : t + 1], weights[t : t + 1])
        ulp = torch.finfo(torch.float32).eps * first[t].abs().clamp(min=1.0)
        assert bool(((alone[0] - first[t]).abs() <= ulp).all())


def test_align_groups_every_pair_once_in_single_slot_blocks():
    gen = torch.Generator().manual_seed(6)
    num_slots, block_m = 9, 16
    slots = torch.randint(0, num_slots - 3, (23, 3), generator=gen)  # slots 6..8 unused
    aligned = align_pairs_by_slot(slots, num_slots, block_m)
    num_pairs = slots.numel()
    assert aligned.sorted_pairs.numel() == padded_capacity(num_pairs, num_slots, block_m)
    real = aligned.sorted_pairs[aligned.sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    flat = slots.reshape(-1)
    used_blocks = 0
    for b in range(aligned.num_blocks):
        block = aligned.sorted_pairs[b * block_m : (b + 1) * block_m]
        slot = int(aligned.block_slot[b])
        members = block[block < num_pairs].long()
        if slot < 0:
            assert members.numel() == 0
            continue
        used_blocks += 1
        assert members.numel() > 0 and bool((flat[members] == slot).all())
        assert members.tolist() == sorted(members.tolist())  # stable within the slot
    counts = torch.bincount(flat, minlength=num_slots)
    assert used_blocks == int(((counts + block_m - 1) // block_m).sum())


def test_bad_inputs_raise():
    args, kwargs = make_problem(4, 2, 32, 16, 4)
    x, w_gu, w_dn, slots, weights = args
    with pytest.raises(IndexError, match="slot_ids"):
        fused_experts_reference(x, w_gu, w_dn, slots - 5, weights)
    with pytest.raises(RuntimeError, match="out of bounds"):
        align_pairs_by_slot(slots + 4, 4, 16)
    with pytest.raises(ValueError, match="w_down"):
        fm.fused_experts_triton(x, w_gu, w_dn[:, :, :8], slots, weights)
    with pytest.raises(TypeError, match="dtype"):
        fm.fused_experts_triton(x, w_gu.half(), w_dn, slots, weights)
    with pytest.raises(TypeError, match="integer"):
        fm.fused_experts_triton(x, w_gu, w_dn, slots.float(), weights)
    with pytest.raises(ValueError, match="weights"):
        fused_experts(x, w_gu, w_dn, slots, weights[:, :1])
    with pytest.raises(ValueError, match="backend"):
        fused_experts(x, w_gu, w_dn, slots, weights, backend="cuda")
    with pytest.raises(ValueError, match="activation"):
        fused_experts(x, w_gu, w_dn, slots, weights, activation="gelu")


def test_out_of_range_slot_poisons_only_its_token():
    # The kernels cannot raise without a device sync; a bad slot id must still never yield a
    # plausible-looking row: that token's output is NaN, the other tokens are unaffected.
    args, _ = make_problem(4, 2, 32, 16, 4, seed=11)
    x, w_gu, w_dn, slots, weights = args
    bad = slots.clone()
    bad[1, 0], bad[3, 1] = 4, -1
    got = fm.fused_experts_triton(x, w_gu, w_dn, bad, weights)
    assert bool(torch.isnan(got[[1, 3]]).all())
    want = fused_experts_reference(x, w_gu, w_dn, slots, weights)
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "num_tokens, top_k, num_slots, routing",
    [(1, 1, 2, "random"), (23, 3, 9, "random"), (64, 8, 200, "random"), (40, 2, 5, "one_slot")],
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_triton_align_kernel_matches_torch_align(num_tokens, top_k, num_slots, routing, index_dtype):
    gen = torch.Generator().manual_seed(12)
    if routing == "random":
        slots = torch.randint(0, max(1, num_slots - 3), (num_tokens, top_k), generator=gen)
    else:
        slots = torch.full((num_tokens, top_k), num_slots - 1)
    want = align_pairs_by_slot(slots, num_slots, 16)
    got = fm.align_pairs_triton(slots.to(index_dtype).reshape(-1), num_slots, 16)
    assert torch.equal(got.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.block_slot, want.block_slot)


def test_zero_tokens():
    args, _ = make_problem(1, 2, 32, 16, 4)
    x, w_gu, w_dn, slots, weights = args
    out = fm.fused_experts_triton(x[:0], w_gu, w_dn, slots[:0], weights[:0])
    assert out.shape == (0, 32)


def test_auto_backend_on_cpu_is_the_torch_reference():
    args, _ = make_problem(5, 2, 32, 16, 4, seed=7)
    assert torch.equal(fused_experts(*args), fused_experts_reference(*args))


# --- transformers integration ---------------------------------------------------------------


def _experts_kernel_kwargs(experts):
    """Layout/activation flags the transformers experts forward passes for this module."""
    from specfit_kernels import ExpertLayout

    layout = ExpertLayout.of(experts)
    assert layout.transposed == experts.is_transposed and layout.interleaved == (not experts.is_concatenated)
    kw = layout.kwargs()
    if experts.has_bias:
        kw.update(gate_up_bias=experts.gate_up_proj_bias.detach(), down_bias=experts.down_proj_bias.detach())
    return kw


def _tiny_moe_model(arch):
    from specfit_hf.testing import tiny_kernel_moe

    return tiny_kernel_moe(arch)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_triton_kernels_match_transformers_experts_module(arch):
    # The layout flags and activation derived from a real experts module, run through the Triton
    # kernels, reproduce that module's own eager forward (GPT-OSS: interleaved, transposed, biases).
    model = _tiny_moe_model(arch)
    experts = model.model.layers[0].mlp.experts
    model.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(11, 40, generator=gen) * 2
    idx = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(11)])
    w = torch.softmax(torch.randn(11, 2, generator=gen), -1)
    with torch.no_grad():
        want = experts(x, idx, w)
        got = fm.fused_experts_triton(
            x, experts.gate_up_proj.detach(), experts.down_proj.detach(), idx, w, **_experts_kernel_kwargs(experts)
        )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_registered_experts_implementation_matches_eager_model(arch, monkeypatch):
    # Whole model with experts_implementation="specfit_triton": on CPU the registered forward takes
    # the torch path; here its fused_experts call is routed to the interpreted Triton kernels instead,
    # so the full model runs through the kernels, and compared with the eager experts.
    import specfit_kernels.hf as hf

    calls = []

    def through_kernels(*args, **kwargs):
        calls.append(kwargs["activation"])
        return fm.fused_experts_triton(*args, **kwargs)

    assert specfit_kernels.EXPERTS_IMPLEMENTATION_NAME == "specfit_triton"
    model = _tiny_moe_model(arch)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = model(ids).logits
        model.set_experts_implementation("specfit_triton")
        assert model.config._experts_implementation == "specfit_triton"
        torch_path = model(ids).logits
        monkeypatch.setattr(hf, "fused_experts", through_kernels)
        got = model(ids).logits
    assert calls == ["silu" if arch == "qwen3_moe" else "swiglu_oai"] * 2  # one call per layer
    torch.testing.assert_close(torch_path, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_experts_the_kernels_cannot_express_fall_back_to_grouped_mm():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from specfit_kernels import ExpertLayout

    torch.manual_seed(13)
    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        hidden_act="gelu",
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg).eval()
    assert ExpertLayout.of(model.model.layers[0].mlp.experts) is None
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = model(ids).logits
        model.set_experts_implementation("specfit_triton")
        got = model(ids).logits  # gelu: the registered forward hands over to transformers' grouped_mm
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
