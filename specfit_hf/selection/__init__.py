"""Stage 3 of the cycle: choose the draft subtree to verify."""

from .search import CostModel, SearchProblem, evaluate_subtree, select_subtree, useful_nodes
from .acceptance import AcceptanceCalibrator, path_acceptance
from .calibration import OnlineCostModel, calibrate, fit_cost_model, mape
from .experts import (
    DraftHeadPredictor,
    HistoryPredictor,
    RouterPredictor,
    UnionQuality,
    make_predictor,
)
from .policy import (
    AutoregressivePolicy,
    CycleContext,
    Eagle3Policy,
    SelectionPolicy,
    available_policies,
    get_policy,
    register_policy,
)
from .specfit import OracleProbe, OraclePolicy, SpecFitPolicy, default_cost_model

__all__ = [
    "AcceptanceCalibrator",
    "path_acceptance",
    "OnlineCostModel",
    "calibrate",
    "fit_cost_model",
    "mape",
    "DraftHeadPredictor",
    "HistoryPredictor",
    "RouterPredictor",
    "UnionQuality",
    "make_predictor",
    "OracleProbe",
    "OraclePolicy",
    "SpecFitPolicy",
    "default_cost_model",
    "CostModel",
    "useful_nodes",
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
