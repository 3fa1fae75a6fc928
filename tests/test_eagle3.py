"""EAGLE-3 draft model: checkpoint format, layer conventions, vocab mapping, tree drafting, generate."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specfit_hf.eagle3 import DraftKVCache, Eagle3Config, Eagle3DraftModel, Eagle3TreeDrafter
from specfit_hf.features import capture_hidden_states
from specfit_hf.testing import HIDDEN, VOCAB, aligned_eagle3_draft, tiny_draft, tiny_draft_config, tiny_target
from specfit_hf.tree import DraftTree, VerifyResult


@pytest.fixture(autouse=True)
def _one_thread():
    # The CI machine is shared; tiny models run fastest without intra-op threads.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _features(target, ids, indices):
    with capture_hidden_states(target, indices) as cap, torch.no_grad():
        out = target(ids)
    return torch.cat([cap[i] for i in indices], dim=-1), out.logits


# --------------------------------------------------------------------------- checkpoint format


def test_save_load_round_trip(tmp_path):
    draft = tiny_draft(expert_predictor={"moe_layers": [0, 2, 5], "num_experts": 8, "top_k": 2})
    draft.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert loaded.config.architectures == ["LlamaForCausalLMEagle3"]
    assert loaded.config.vocab_size == VOCAB and loaded.config.draft_vocab_size == 64
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    ids = torch.randint(0, VOCAB, (2, 7))
    feats = torch.randn(2, 7, 3 * HIDDEN)
    with torch.no_grad():
        a, b = draft(ids, target_features=feats), loaded(ids, target_features=feats)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden_states, b.hidden_states)
        h = torch.randn(5, HIDDEN)
        pred = loaded.predict_experts(h)
        assert pred.shape == (5, 3, 2) and pred.dtype == torch.long
        assert torch.equal(pred, draft.predict_experts(h))
        assert torch.equal(pred[:, 1], loaded.expert_logits(h)[:, 1].topk(2, -1).indices)
        # the snapshot a generate call predicts with: the same experts, and new weights need a new snapshot
        predict = loaded.expert_predictor_fn()
        assert torch.equal(predict(h), pred) and torch.equal(loaded.expert_predictor_fn(top_k=1)(h), pred[..., :1])
        loaded.expert_heads[1].weight.mul_(-1.0)
        assert torch.equal(loaded.expert_predictor_fn()(h), loaded.predict_experts(h))
        assert not torch.equal(loaded.predict_experts(h)[:, 1], pred[:, 1])
        loaded.expert_heads[1].weight.mul_(-1.0)

    # a draft built under inference_mode (inference tensors keep no version counter) predicts the same
    with torch.inference_mode():
        built = tiny_draft(expert_predictor={"moe_layers": [0, 2, 5], "num_experts": 8, "top_k": 2})
        assert torch.equal(built.predict_experts(h), draft.predict_experts(h))

    # the drafter serves predictions for the root and every node of a tree
    target = tiny_target()
    drafter = loaded.make_tree_drafter(target, None)
    prompt = torch.randint(0, VOCAB, (1, 6))
    drafter.start(prompt, _features(target, prompt, drafter.target_feature_indices)[0])
    tree = DraftTree(3)
    drafter.draft_level(tree)
    drafter.draft_level(tree)
    experts = drafter.predicted_experts(tree)
    assert experts.shape == (1 + len(tree), 3, 2)
    assert torch.equal(experts[1:], loaded.predict_experts(tree.hidden))
    # the saved folder is the public layout, not transformers' internal names
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["draft_vocab_size"] == 64 and "rope_theta" in cfg
    assert {n for n, _ in loaded.named_parameters()} >= {"fc.weight", "midlayer.self_attn.q_proj.weight", "expert_heads.2.weight"}


def _public_state_dict(cfg: dict, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, ht = cfg["hidden_size"], cfg["intermediate_size"], cfg["target_hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    vd, v = cfg["draft_vocab_size"], cfg["vocab_size"]

    def w(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "fc.weight": w(h, 3 * ht),
        "midlayer.self_attn.q_proj.weight": w(nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nh * hd),
        "midlayer.mlp.gate_proj.weight": w(i, h),
        "midlayer.mlp.up_proj.weight": w(i, h),
        "midlayer.mlp.down_proj.weight": w(h, i),
        "midlayer.hidden_norm.weight": 1 + w(h, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + w(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + w(h, scale=0.1),
        "norm.weight": 1 + w(h, scale=0.1),
        "lm_head.weight": w(vd, h, scale=1.0),
    }
    target_ids = torch.randperm(v, generator=g)[:vd].sort().values
    sd["d2t"] = target_ids - torch.arange(vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[target_ids] = True
    sd["t2d"] = t2d
    return sd


def _reference_step(sd, cfg, embed, ids, feats):
    """Independent EAGLE-3 step written straight from the public weight names (causal, from position 0)."""

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * wt

    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = ids.shape[1]
    hid = feats @ sd["fc.weight"].T
    x = torch.cat([rms(embed[ids], sd["midlayer.input_layernorm.weight"]), rms(hid, sd["midlayer.hidden_norm.weight"])], -1)
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(1, t, nh, hd).transpose(1, 2)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(1, t, nkv, hd).transpose(1, 2)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(1, t, nkv, hd).transpose(1, 2)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(t).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(z):
        z1, z2 = z[..., : hd // 2], z[..., hd // 2 :]
        return z * cos + torch.cat([-z2, z1], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    att = (q @ k.transpose(-1, -2)) / hd**0.5
    att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(1, t, nh * hd) @ sd["midlayer.self_attn.o_proj.weight"].T
    h = hid + o
    m = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    h = h + (F.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T) * (m @ sd["midlayer.mlp.up_proj.weight"].T)) @ sd["midlayer.mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


def test_public_layout_folder_loads_with_identical_logits(tmp_path, target):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # not hidden/heads: must be honoured
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "draft_vocab_size": 40,
        "target_hidden_size": HIDDEN,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 5], "use_aux_hidden_state": True},
    }
    sd = _public_state_dict(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))

    draft = Eagle3DraftModel.from_pretrained(tmp_path).eval()
    assert draft.embeddings_from_target  # no embed_tokens in the folder
    assert draft.config.head_dim == 16 and draft.midlayer.self_attn.q_proj.weight.shape == (64, 2 * HIDDEN)
    assert isinstance(draft.make_tree_drafter(target, None), Eagle3TreeDrafter)
    # SGLang "output of layer id" convention by default: ids 1, 4, 5 -> HF indices 2, 5, 6;
    # logits equal the reference written from the public names; d2t offsets (d -> d + d2t[d]).
    _check_loads_like_reference(tmp_path, sd, cfg, target, (2, 5, 6))


def _public_cfg(**over) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HIDDEN // 4,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 5000.0, "max_position_embeddings": 256,
        "vocab_size": VOCAB, "draft_vocab_size": 40, "target_hidden_size": HIDDEN, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    cfg.update(over)
    return cfg


def _check_loads_like_reference(folder, sd, cfg, target, indices):
    draft = Eagle3DraftModel.from_pretrained(folder).eval()
    drafter = draft.make_tree_drafter(target, type("C", (), {"tree_top_k": 3})())
    assert drafter.target_feature_indices == indices
    ids = torch.randint(0, VOCAB, (1, 9))
    feats = torch.randn(1, 9, 3 * HIDDEN)
    with torch.no_grad():
        got = draft(ids, target_features=feats).logits
        want = _reference_step(sd, cfg, target.get_input_embeddings().weight, ids, feats)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(draft.draft_to_target(torch.arange(40)), torch.nonzero(sd["t2d"]).reshape(-1))
    assert torch.equal(draft.t2d, sd["t2d"])
    # and it drafts for generate: greedy-identical to the target alone
    from specfit_hf.generation import SpecFitConfig

    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    cfg = SpecFitConfig(max_new_tokens=10, do_sample=False, policy="eagle3", max_depth=3, tree_top_k=3,
                        max_verify_nodes=6, return_dict_in_generate=True)
    out = target.generate(prompt, assistant_model=draft, generation_config=cfg)
    assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=10, do_sample=False))
    assert sum(c.nodes_verified for c in out.cycles) > 0
    return draft


def test_modelopt_export_with_d2t_only_loads(tmp_path, target):
    """ModelOpt's export (hf_spec_export): official midlayer.* names, d2t but no t2d, LlamaForCausalLM."""
    cfg = _public_cfg(architectures=["LlamaForCausalLM"], eagle_config={
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True,
        "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False})
    sd = _public_state_dict(cfg)
    save_file({k: v for k, v in sd.items() if k != "t2d"}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # ModelOpt collects the outputs of layers 1, 3, 5: HF indices 2, 4, 6
    _check_loads_like_reference(tmp_path, sd, cfg, target, (2, 4, 6))


def test_top_level_layer_ids_are_honoured_as_hf_indices(tmp_path, target):
    """vLLM-style configs keep eagle_aux_hidden_state_layer_ids at the top level (HF indices)."""
    cfg = _public_cfg(eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    sd = _public_state_dict(cfg)
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    draft = _check_loads_like_reference(tmp_path, sd, cfg, target, (1, 3, 6))
    assert draft.config.eagle_config["aux_hidden_state_id_convention"] == "hf_index"
    # saved and reloaded: the same layers
    draft.save_pretrained(tmp_path / "again")
    again = Eagle3DraftModel.from_pretrained(tmp_path / "again")
    assert again.make_tree_drafter(target, None).target_feature_indices == (1, 3, 6)
    with pytest.raises(ValueError, match="naming other layers"):
        Eagle3Config(**_public_cfg(eagle_aux_hidden_state_layer_ids=[1, 3, 6],
                                   eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}))


@pytest.mark.parametrize("fc_bias", [False, True])
def test_speculators_layout_loads(tmp_path, target, fc_bias):
    """vLLM speculators: layers.0.* keys, nested transformer_layer_config, top-level ids, verifier_* extras."""
    layer_cfg = {k: v for k, v in _public_cfg().items()
                 if k not in ("architectures", "draft_vocab_size", "target_hidden_size", "torch_dtype")}
    raw = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
        "transformer_layer_config": layer_cfg, "draft_vocab_size": 40, "norm_before_residual": False,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "verifier": {"name_or_path": None, "architectures": ["Qwen3MoeForCausalLM"]}},
    }
    cfg = _public_cfg()
    sd = _public_state_dict(cfg)
    files = {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}
    files["verifier_norm.weight"] = torch.ones(HIDDEN)  # present in training checkpoints: ignored
    if fc_bias:
        bias = torch.randn(HIDDEN) * 0.1
        files["fc.bias"] = bias
    save_file(files, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if not fc_bias:
        draft = _check_loads_like_reference(tmp_path, sd, cfg, target, (2, 4, 5))
    else:
        draft = Eagle3DraftModel.from_pretrained(tmp_path).eval()
        assert torch.equal(draft.fc.bias, bias)
    assert draft.config.hidden_feedback == "pre_norm"
    assert torch.equal(draft.midlayer.self_attn.q_proj.weight, sd["midlayer.self_attn.q_proj.weight"])


def test_norm_output_choice_is_explicit(tmp_path):
    """norm_output alone means post-norm feedback; eagle_config.hidden_feedback overrides; saved explicitly."""
    post = tiny_draft_config(norm_output=True)
    assert post.hidden_feedback == "post_norm"
    pre = tiny_draft_config(norm_output=True, eagle_config={"hidden_feedback": "pre_norm"})
    assert pre.hidden_feedback == "pre_norm"
    assert tiny_draft_config().hidden_feedback == "pre_norm"
    with pytest.raises(ValueError, match="hidden_feedback"):
        tiny_draft_config(eagle_config={"hidden_feedback": "both"})
    for cfg in (post, pre):
        model = Eagle3DraftModel(cfg).eval()
        out = torch.randn(1, 3, cfg.hidden_size)
        fed = model.next_hidden(out)
        assert torch.equal(fed, model.norm(out) if cfg.hidden_feedback == "post_norm" else out)
        model.save_pretrained(tmp_path / cfg.hidden_feedback)
        written = json.loads((tmp_path / cfg.hidden_feedback / "config.json").read_text())
        assert written["eagle_config"]["hidden_feedback"] == cfg.hidden_feedback


def test_bin_checkpoints_only_with_weights_only(tmp_path):
    draft = tiny_draft()
    # a .bin folder written by hand (transformers 5 saves safetensors only)
    draft.config.save_pretrained(tmp_path)
    torch.save(draft.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)
    with pytest.raises(ValueError, match="weights_only"):
        Eagle3DraftModel.from_pretrained(tmp_path, weights_only=False)


def test_missing_required_weight_is_an_error(tmp_path):
    cfg = tiny_draft().config
    cfg.save_pretrained(tmp_path)
    sd = {k: v for k, v in tiny_draft().state_dict().items() if k != "fc.weight"}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight"):
        Eagle3DraftModel.from_pretrained(tmp_path)


# --------------------------------------------------------------------------- conventions and vocab


def test_layer_id_conventions_pick_the_same_layers(tmp_path, target):
    num_layers = 8
    assert tiny_draft_config().target_feature_indices(num_layers) == (2, 4, 5)
    sglang = tiny_draft_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]})
    hf = tiny_draft_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 7], "aux_hidden_state_id_convention": "hf_index"}
    )
    assert sglang.target_feature_indices(num_layers) == hf.target_feature_indices(num_layers) == (1, 4, 7)
    # through folders and the drafter the loop sees
    picked = []
    for i, cfg in enumerate((sglang, hf)):
        folder = tmp_path / f"d{i}"
        Eagle3DraftModel(cfg).save_pretrained(folder)
        drafter = Eagle3DraftModel.from_pretrained(folder).make_tree_drafter(target, None)
        picked.append(drafter.target_feature_indices)
    assert picked[0] == picked[1] == (1, 4, 7)
    # writing explicit layers uses the layer-output convention and reads back the same
    cfg = tiny_draft_config()
    cfg.set_target_feature_indices((1, 4, 7), num_layers)
    assert cfg.eagle_config["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]
    assert cfg.target_feature_indices(num_layers) == (1, 4, 7)
    with pytest.raises(ValueError):
        tiny_draft_config(eagle_config={"aux_hidden_state_id_convention": "vllm"})
    with pytest.raises(ValueError, match="outside"):
        hf.target_feature_indices(4)


def test_vocab_mapping():
    draft = tiny_draft()
    ids = torch.tensor([i for i in range(VOCAB) if i % 3 != 1])[:64]
    d = torch.arange(64)
    assert torch.equal(draft.draft_to_target(d), ids)
    assert torch.equal(d + draft.d2t, ids)  # the public offset semantics
    assert torch.equal(torch.nonzero(draft.t2d).reshape(-1), ids)
    assert torch.equal(draft.target_to_draft(ids), d)
    outside = torch.tensor([1, 4, 7])
    assert bool((draft.target_to_draft(outside) == -1).all())
    with pytest.raises(ValueError):
        draft.set_vocab_mapping(torch.arange(63))
    with pytest.raises(ValueError):
        draft.set_vocab_mapping(torch.arange(64).flip(0))
    full = Eagle3DraftModel(tiny_draft_config(draft_vocab_size=VOCAB))
    assert bool(full.t2d.all()) and not bool(full.d2t.any())


# --------------------------------------------------------------------------- tree drafting


def _linear_run(draft, seq_tokens, feats, path_tokens):
    """Reference: the committed pairs in one causal pass, then each path token one at a time."""
    cache = DraftKVCache()
    with torch.no_grad():
        out = draft(seq_tokens[:, 1:], target_features=feats, past_key_values=cache)
        hidden, logits = out.hidden_states[:, -1:], out.logits[0, -1]
        hiddens, all_logits = [hidden[0, 0]], [logits]
        root_pos = seq_tokens.shape[1] - 2
        for d, tok in enumerate(path_tokens, 1):
            out = draft(torch.tensor([[tok]]), hidden_states=hidden, position_ids=torch.tensor([root_pos + d]),
                        past_key_values=cache)
            hidden = out.hidden_states
            hiddens.append(hidden[0, 0])
            all_logits.append(out.logits[0, 0])
    return hiddens, all_logits


def _check_tree_against_linear(draft, tree, seq_tokens, feats):
    """``seq_tokens`` = committed tokens then the root; ``feats`` one row per committed token."""
    for n in range(len(tree)):
        path = tree.ancestors(n)
        hiddens, logits = _linear_run(draft, seq_tokens, feats, [int(tree.tokens[i]) for i in path])
        if n == 0:
            torch.testing.assert_close(tree.root_hidden, hiddens[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(tree.hidden[n], hiddens[-1], rtol=1e-4, atol=1e-4)
        prob = torch.softmax(logits[-2], -1)[draft.target_to_draft(tree.tokens[n])]
        assert abs(float(prob) - float(tree.draft_probs[n])) < 1e-5


@pytest.mark.parametrize(
    "variant", [{}, {"norm_before_residual": True, "norm_output": True, "fc_norm": True}], ids=["plain", "variants"]
)
def test_tree_levels_match_linear_drafting_across_commits(target, variant):
    draft = tiny_draft(**variant)
    drafter = draft.make_tree_drafter(target, type("C", (), {"tree_top_k": 3})())
    idx = drafter.target_feature_indices
    prompt = torch.randint(0, VOCAB, (1, 10))
    feats, logits = _features(target, prompt, idx)
    root = int(logits[0, -1].argmax())
    drafter.start(prompt, feats)
    tree = DraftTree(root)
    for _ in range(3):
        drafter.draft_level(tree)
    assert tree.depths.tolist() == [1] * 3 + [2] * 9 + [3] * 9
    # level 3 expands the 3 best level-2 nodes by path probability
    level2 = tree.level(2)
    best = set(level2[tree.path_probs[level2].topk(3).indices].tolist())
    assert set(tree.parents[tree.level(3)].tolist()) == best
    _check_tree_against_linear(draft, tree, torch.cat([prompt, torch.tensor([[root]])], 1), feats)

    # commit an accepted path of two nodes, then draft the next cycle
    leaf = int(tree.level(2)[0])
    accepted = tree.ancestors(leaf)
    acc_tokens = [int(tree.tokens[i]) for i in accepted]
    bonus = 5
    full = torch.cat([prompt, torch.tensor([[root] + acc_tokens + [bonus]])], 1)
    full_feats, _ = _features(target, full[:, :-1], idx)
    result = VerifyResult(accepted=accepted, accepted_positions=[0, 1, 2], new_tokens=acc_tokens + [bonus], bonus_token=bonus)
    drafter.commit(tree, result, full_feats[:, prompt.shape[1]:])
    tree2 = DraftTree(bonus)
    for _ in range(2):
        drafter.draft_level(tree2)
    _check_tree_against_linear(draft, tree2, full, full_feats)

    # a plain decode cycle (nothing verified), then one with nothing drafted at all
    drafter.commit(tree2, VerifyResult([], [0], [7], 7), _features(target, full, idx)[0][:, -1:])
    full2 = torch.cat([full, torch.tensor([[7]])], 1)
    feats2, _ = _features(target, full2, idx)
    drafter.commit(DraftTree(7), VerifyResult([], [0], [9], 9), feats2[:, -1:])
    with pytest.raises(ValueError, match="root"):
        drafter.draft_level(DraftTree(8))  # 9 is the committed root
    assert drafter.predicted_experts(tree2) is None  # no expert heads on this draft
    tree4 = DraftTree(9)
    drafter.draft_level(tree4)
    _check_tree_against_linear(draft, tree4, torch.cat([full2, torch.tensor([[9]])], 1), feats2)


# --------------------------------------------------------------------------- generate


def _generate_case(target, draft, reference=None):
    """(plain greedy reference, tree-speculative output, draft tokens accepted).

    The speculative run is on ``clock.simulated()``: SpecFit's choices follow measured
    times, and on a stopped clock they are the same on every machine (the cost model keeps
    its defaults), so the acceptance floor below is not at the mercy of the host's load.
    """
    from specfit_hf.clock import simulated
    from specfit_hf.generation import SpecFitConfig

    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(7))
    ref = (reference or target).generate(prompt, max_new_tokens=24, do_sample=False)
    cfg = SpecFitConfig(max_new_tokens=24, do_sample=False, max_depth=3, tree_top_k=3, max_verify_nodes=8,
                        return_dict_in_generate=True)
    with simulated():
        out = target.generate(prompt, assistant_model=draft, generation_config=cfg)
    return ref, out.sequences, sum(c.tokens_accepted for c in out.cycles)


def test_generate_with_eagle3_draft_is_greedy_lossless(target):
    # A draft that agrees with the target at depth 1: acceptance is exercised, not just rejection.
    ref, out, accepted = _generate_case(target, aligned_eagle3_draft(target))
    assert torch.equal(ref, out)
    assert accepted >= 6
    # and a random draft (nearly everything rejected) is lossless too
    ref, out, _ = _generate_case(target, tiny_draft())
    assert torch.equal(ref, out)


def test_generate_lossless_with_offloaded_experts(target):
    from specfit_hf.offload import offload_experts

    plain = tiny_target()  # the reference is generated by the un-offloaded model
    offloaded = tiny_target()
    runtime = offload_experts(offloaded, device="cpu", slots_per_layer=3)
    try:
        ref, out, accepted = _generate_case(offloaded, aligned_eagle3_draft(plain), reference=plain)
        assert runtime.stats.total.misses > 0
    finally:
        runtime.detach()
    assert torch.equal(ref, out)
    assert accepted >= 6


def test_generate_sampling_runs_with_eagle3_draft(target):
    from specfit_hf.generation import SpecFitConfig

    prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(1))
    cfg = SpecFitConfig(max_new_tokens=12, do_sample=True, temperature=0.7, max_depth=3, tree_top_k=3, max_verify_nodes=8)
    torch.manual_seed(0)
    out = target.generate(prompt, assistant_model=tiny_draft(), generation_config=cfg)
    assert out.shape == (1, 20) and torch.equal(out[:, :8], prompt)
    assert int(out.max()) < VOCAB


def test_rms_norm_fast_path_is_bitwise_the_module():
    """The draft's norms run as one fused op at float32 CPU inference: the same bits as LlamaRMSNorm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specfit_hf.eagle3.modeling import RMSNorm

    torch.manual_seed(0)
    for hidden in (8, 128, 200):
        fast, ref = RMSNorm(hidden, eps=1e-6), LlamaRMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            fast.weight.copy_(torch.randn(hidden))
            ref.weight.copy_(fast.weight)
        for shape in ((1, 1, hidden), (1, 7, hidden), (3, hidden), (2, 60, hidden)):
            x = torch.randn(shape) * 4
            with torch.no_grad():
                assert torch.equal(fast(x), ref(x))
            # training (gradients on) and other dtypes run the module's own code
            assert torch.equal(fast(x), ref(x))
            xb = x.to(torch.bfloat16)
            with torch.no_grad():
                assert torch.equal(fast.to(torch.bfloat16)(xb), ref.to(torch.bfloat16)(xb))
            fast.float(), ref.float()
    x = torch.randn(2, 5, 8, requires_grad=True)
    RMSNorm(8)(x).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
