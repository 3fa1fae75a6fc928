"""Stage 3 of the cycle: choose the draft subtree to verify."""

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
    "AutoregressivePolicy",
    "CycleContext",
    "Eagle3Policy",
    "SelectionPolicy",
    "available_policies",
    "get_policy",
    "register_policy",
]
