"""Tiny random EAGLE-3 drafts and MoE targets: re-exported from :mod:`specfit_hf.testing`
(the one home of the tiny-model builders); kept so existing imports keep working."""

from __future__ import annotations

from ..testing import HIDDEN, VOCAB, aligned_eagle3_draft, tiny_draft, tiny_draft_config, tiny_target

__all__ = ["HIDDEN", "VOCAB", "tiny_target", "tiny_draft_config", "tiny_draft", "aligned_eagle3_draft"]
