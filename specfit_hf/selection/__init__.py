"""Stage 3 of the cycle: choose the draft subtree to verify."""

from .search import CostModel, SearchProblem, evaluate_subtree, select_subtree
from .policy import (
    AutoregressivePolicy,
    CycleContext,
    Eagle3Policy,
    SelectionPolicy,
    available_policies,
    get_policy,
    register_policy,
)

__all__ = [
    "CostModel",
    "SearchProblem",
    "evaluate_subtree",
    "select_subtree",
    "AutoregressivePolicy",
    "CycleContext",
    "Eagle3Policy",
    "SelectionPolicy",
    "available_policies",
    "get_policy",
    "register_policy",
]
