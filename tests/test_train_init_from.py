"""EAGLE-3 training warm start (``TrainConfig.init_from`` / ``--init-from``)."""

from __future__ import annotations

import pytest
import torch

from specfit_hf.eagle3 import Eagle3DraftModel
from specfit_hf.eagle3.train import TargetTeacher, TrainConfig, _batch_indices, eagle3_loss, train_eagle3
from specfit_hf.testing import VOCAB, tiny_target

from test_generation import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(out, **kw) -> TrainConfig:
    base = dict(target="tiny-qwen3moe", data=["random.jsonl"], out=str(out), steps=6, seq_len=24, batch_size=4,
                ttt_steps=5, draft_vocab=64, expert_heads=True, lr=3e-3, warmup_steps=2, save_every=0, seed=0,
                log_every=2)
    return TrainConfig(**{**base, **kw})


def test_init_from_starts_from_the_source_draft(tmp_path):
    target = tiny_target()
    blocks = torch.randint(0, VOCAB, (32, 24), generator=torch.Generator().manual_seed(0))
    src_dir = tmp_path / "src"
    train_eagle3(_cfg(src_dir), target=target, blocks=blocks, progress=False)
    src = Eagle3DraftModel.from_pretrained(src_dir)

    # Other data (a different vocabulary would come out of it) and a different seed: the
    # warm-started draft still keeps the source's vocabulary mapping and weights.
    other = torch.randint(0, VOCAB // 2, (32, 24), generator=torch.Generator().manual_seed(1))

    # lr 0: the optimizer never moves the weights, so the output is the source draft.
    frozen_dir = tmp_path / "frozen"
    frozen = train_eagle3(_cfg(frozen_dir, steps=2, lr=0.0, seed=3, init_from=str(src_dir)),
                          target=target, blocks=other, progress=False)
    assert frozen["steps"] == 2
    copy = Eagle3DraftModel.from_pretrained(frozen_dir)
    src_state, copy_state = src.state_dict(), copy.state_dict()
    assert set(src_state) == set(copy_state)
    for name, value in src_state.items():
        torch.testing.assert_close(copy_state[name], value, rtol=0, atol=0, msg=name)

    # A real warm start: its first loss is the source draft's loss on that first batch,
    # far below a fresh draft's; then it trains.
    warm_dir = tmp_path / "warm"
    warm = train_eagle3(_cfg(warm_dir, steps=3, seed=3, init_from=str(src_dir)),
                        target=target, blocks=other, progress=False)
    ids = other[_batch_indices(other.shape[0], 4, 0, 3)]
    src.embeddings_from_target = True
    src.attach_target_embeddings(target)
    src.train()
    teacher = TargetTeacher(target, src.config.target_feature_indices(8), src.expert_moe_layers)
    with torch.no_grad():
        want = eagle3_loss(src, teacher(ids), ids, 5)
    assert warm["first_token_loss"] == pytest.approx(want.token_loss, rel=1e-5)
    fresh = train_eagle3(_cfg(tmp_path / "fresh", steps=1, seed=3), target=target, blocks=other, progress=False)
    assert fresh["first_token_loss"] != pytest.approx(warm["first_token_loss"], rel=1e-3)
    moved = Eagle3DraftModel.from_pretrained(warm_dir).state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in src_state.items() if v.is_floating_point())
    torch.testing.assert_close(moved["t2d"], src_state["t2d"], rtol=0, atol=0)


def test_init_from_rejects_mismatched_layers(tmp_path):
    target = tiny_target()
    blocks = torch.randint(0, VOCAB, (16, 24), generator=torch.Generator().manual_seed(0))
    src_dir = tmp_path / "src"
    train_eagle3(_cfg(src_dir, steps=1, feature_indices=[2, 4, 6]), target=target, blocks=blocks, progress=False)
    with pytest.raises(ValueError, match="reads target layers"):
        train_eagle3(_cfg(tmp_path / "bad", steps=1, feature_indices=[1, 3, 5], init_from=str(src_dir)),
                     target=target, blocks=blocks, progress=False)


def test_cli_exposes_init_from():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        import train_eagle3 as cli
    finally:
        sys.path.pop(0)
    cfg = cli.parse_args(["--target", "t", "--data", "d.jsonl", "--out", "o", "--init-from", "old_draft"])
    assert cfg.init_from == "old_draft"
    assert cli.parse_args(["--target", "t", "--data", "d.jsonl", "--out", "o"]).init_from is None
