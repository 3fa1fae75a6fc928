"""EAGLE-3 draft model: public checkpoint format, tree drafting, training."""

from .config import Eagle3Config, default_feature_indices
from .drafter import Eagle3TreeDrafter
from .modeling import DraftKVCache, Eagle3DraftModel, Eagle3Output

__all__ = [
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3Output",
    "Eagle3TreeDrafter",
    "DraftKVCache",
    "default_feature_indices",
]
