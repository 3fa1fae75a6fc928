"""EAGLE-3 training: draft vocabulary, training-time test consistency, loss goes down, resume, CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specfit_hf.eagle3 import DraftKVCache, Eagle3DraftModel
from specfit_hf.eagle3.train import (
    TargetTeacher,
    TrainConfig,
    build_draft_vocab,
    eagle3_loss,
    find_moe_routers,
    train_eagle3,
    ttt_forward,
)
from specfit_hf.testing import VOCAB, tiny_draft, tiny_target

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_build_draft_vocab_most_frequent_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0])
    assert build_draft_vocab(counts, 3).tolist() == [2, 3, 5]
    # ties and unseen tokens go to lower ids
    assert build_draft_vocab(counts, 6).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 8)


def test_teacher_captures_features_logits_and_routing():
    target = tiny_target()
    routers = find_moe_routers(target)
    assert [i for i, _ in routers] == list(range(8))
    ids = torch.randint(0, VOCAB, (2, 10))
    batch = TargetTeacher(target, (2, 4, 5), [1, 6])(ids)
    assert batch.features.shape == (2, 10, 96) and batch.logits.shape == (2, 10, VOCAB)
    assert batch.routing.shape == (2, 10, 2, 2)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        want = torch.cat([out.hidden_states[i] for i in (2, 4, 5)], -1)
        torch.testing.assert_close(batch.features, want)
        gate = dict(routers)[6]
        x = {}

        def keep(module, args, output):
            x["r"] = output[0]

        h = gate.register_forward_hook(keep)
        target(ids)
        h.remove()
        assert torch.equal(batch.routing[:, :, 1], x["r"].reshape(2, 10, -1).topk(2, -1).indices)


def test_training_time_test_matches_tree_drafting():
    """Step j, slot i of the unrolled training pass == drafting along the true tokens."""
    target = tiny_target()
    draft = tiny_draft(norm_output=True)
    draft.embeddings_from_target = True
    draft.attach_target_embeddings(target)
    ids = torch.randint(0, VOCAB, (2, 14))
    batch = TargetTeacher(target, draft.config.target_feature_indices(8))(ids)
    steps = 5
    with torch.no_grad():
        outs = ttt_forward(draft, batch.features, ids, steps)
        for b, i in [(0, 0), (1, 3), (1, 7)]:
            cache = DraftKVCache()
            o = draft(ids[b : b + 1, 1 : i + 2], target_features=batch.features[b : b + 1, : i + 1], past_key_values=cache)
            torch.testing.assert_close(o.logits[0, -1], outs[0][1][b, i], rtol=1e-4, atol=1e-4)
            hidden = o.hidden_states[:, -1:]
            for j in range(1, steps):
                o = draft(ids[b : b + 1, i + 1 + j : i + 2 + j], hidden_states=hidden,
                          position_ids=torch.tensor([i + j]), past_key_values=cache)
                hidden = o.hidden_states
                torch.testing.assert_close(o.logits[0, -1], outs[j][1][b, i], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(hidden[0, -1], outs[j][0][b, i], rtol=1e-4, atol=1e-4)
    loss = eagle3_loss(draft, batch, ids, steps)
    assert len(loss.step_losses) == steps and loss.loss.requires_grad


def test_training_lowers_loss_resumes_and_saves_a_hub_folder(tmp_path):
    target = tiny_target()
    blocks = torch.randint(0, VOCAB, (48, 24), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(
        target="tiny-qwen3moe", data=["random.jsonl"], out=str(tmp_path), steps=28, seq_len=24, batch_size=4,
        ttt_steps=5, draft_vocab=64, expert_heads=True, lr=3e-3, warmup_steps=4, save_every=12, seed=0, log_every=4,
        max_steps_per_run=24,
    )
    summary = train_eagle3(cfg, target=target, blocks=blocks, progress=False)
    assert summary["steps"] == 24 and summary["stopped_early"]
    assert summary["final_token_loss"] < summary["first_token_loss"] - 0.5
    assert summary["expert_predictor"] == {"moe_layers": list(range(8)), "num_experts": 8, "top_k": 2}

    draft = Eagle3DraftModel.from_pretrained(tmp_path)
    assert draft.embeddings_from_target and draft.expert_heads is not None and len(draft.expert_heads) == 8
    assert int(draft.t2d.sum()) == 64
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: tiny-qwen3moe" in card and "eagle3" in card
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]

    # resume: continues from the checkpoint's step and ends where an unbroken run ends
    cfg.resume = True
    resumed = train_eagle3(cfg, target=target, blocks=blocks, progress=False)
    assert resumed["steps"] == 28 and not resumed["stopped_early"]
    fresh_cfg = TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "fresh"), "resume": False, "max_steps_per_run": 0})
    fresh = train_eagle3(fresh_cfg, target=target, blocks=blocks, progress=False)
    a = Eagle3DraftModel.from_pretrained(tmp_path)
    b = Eagle3DraftModel.from_pretrained(tmp_path / "fresh")
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert fresh["steps"] == 28


def _tiny_target_folder(path: Path) -> None:
    """A tiny Qwen3-MoE target with a small BPE tokenizer trained on a few sentences."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["Question: Tom has 3 apples and buys 4 more. How many apples? Answer: 3 + 4 = 7 #### 7"] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)
    model = tiny_target()
    assert len(fast) <= VOCAB
    model.save_pretrained(path)


def test_cli_trains_from_jsonl(tmp_path, monkeypatch):
    target_dir = tmp_path / "target"
    _tiny_target_folder(target_dir)
    data = tmp_path / "train.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples?",
             "answer": f"{i} + {i + 2} = {2 * i + 2}\n#### {2 * i + 2}"} for i in range(40)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import train_eagle3 as cli
    finally:
        sys.path.pop(0)
    out = tmp_path / "draft"
    cli.main(["--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "3",
              "--seq-len", "16", "--batch-size", "2", "--ttt-steps", "5", "--draft-vocab", "32", "--expert-heads",
              "--threads", "1", "--save-every", "2"])
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 3 and summary["draft_vocab_size"] == 32 and summary["tokens_per_s"] > 0
    assert (out / "checkpoint" / "trainer_state.pt").is_file()
    draft = Eagle3DraftModel.from_pretrained(out)
    assert draft.config.draft_vocab_size == 32 and draft.expert_heads is not None


def test_text_and_jsonl_documents(tmp_path):
    from specfit_hf.eagle3.train import load_text_dataset

    txt = tmp_path / "a.txt"
    txt.write_text("first line\nsame paragraph\n\nsecond paragraph\n")
    assert load_text_dataset([txt]) == ["first line\nsame paragraph", "second paragraph"]
    js = tmp_path / "b.jsonl"
    js.write_text(json.dumps({"article": "Some news.", "highlights": "News."}) + "\n" + json.dumps({"text": "plain"}))
    docs = load_text_dataset([js])
    assert docs[0].startswith("Article: Some news.") and docs[0].endswith("News.") and docs[1] == "plain"
    with pytest.raises(ValueError, match="mix"):
        load_text_dataset([txt, js])
    # files of different datasets (different columns) load together
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "2+2?", "answer": "4\n#### 4"}) + "\n")
    docs = load_text_dataset([gsm, js])
    assert len(docs) == 3 and docs[0].startswith("Question: 2+2?") and docs[2] == "plain"


@pytest.mark.slow
def test_trained_draft_is_accepted_in_generate(tmp_path):
    """End to end: train on the target's own samples, then the loop accepts more draft tokens."""
    from specfit_hf.generation import SpecFitConfig

    target = tiny_target()
    torch.manual_seed(0)
    with torch.no_grad():
        starts = torch.randint(0, VOCAB, (64, 4))
        blocks = target.generate(starts, do_sample=True, max_new_tokens=60, min_new_tokens=60, pad_token_id=0)[:, :64]
    cfg = TrainConfig(target="tiny", data=["self-samples"], out=str(tmp_path), steps=150, seq_len=64, batch_size=8,
                      ttt_steps=5, draft_vocab=64, lr=3e-3, warmup_steps=20, save_every=0)
    train_eagle3(cfg, target=target, blocks=blocks, progress=False)
    trained = Eagle3DraftModel.from_pretrained(tmp_path)
    untrained = Eagle3DraftModel(trained.config)
    untrained.set_vocab_mapping(trained.draft_to_target(torch.arange(64)))

    gcfg = SpecFitConfig(policy="eagle3", max_new_tokens=40, do_sample=False, max_depth=5, tree_top_k=4, max_verify_nodes=16,
                         return_dict_in_generate=True)
    tau = {}
    for name, draft in (("untrained", untrained), ("trained", trained)):
        committed = []
        for i in range(4):
            prompt = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(100 + i))
            out = target.generate(prompt, assistant_model=draft, generation_config=gcfg)
            assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=40, do_sample=False))
            committed += [c.tokens_committed for c in out.cycles]
        tau[name] = sum(committed) / len(committed)
    assert tau["trained"] > tau["untrained"] + 0.5, tau
