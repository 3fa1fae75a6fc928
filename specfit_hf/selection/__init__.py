"""Stage 3 of the cycle: choose the draft subtree to verify.

The ``specfit`` policy (:mod:`.specfit`) reads as its recipe and delegates each step to a
small collaborator: path acceptance (:mod:`.acceptance`), expert forecast
(:mod:`.forecast`, predictors in :mod:`.experts`), the exact search (:mod:`.search`, its
min cut in :mod:`.mincut`), cycle costs (:mod:`.costs`, :mod:`.calibration`), the
drafting gate (:mod:`.gate`), the stop rule (:mod:`.lookahead`) and whether a cycle verifies
its prompt-lookup chain instead (:mod:`.lookup`).  Options are typed
(:mod:`.options`).  Baseline policies live in :mod:`.policy`, the benchmark's oracle in
:mod:`.oracle`, predictor-quality reports in :mod:`.quality`.
"""

from .acceptance import AcceptanceCalibrator, AcceptanceModel, path_acceptance
from .calibration import OnlineCostModel, calibrate, fit_cost_model, mape, mape_floors
from .costs import CycleCostTracker, default_cost_model
from .experts import DraftHeadPredictor, HistoryPredictor, RouterPredictor, make_predictor
from .forecast import ExpertForecast
from .gate import DraftingGate
from .lookahead import LookAhead
from .lookup import LookupAcceptance, best_lookup_prefix
from .options import SpecFitOptions
from .oracle import OraclePolicy
from .policy import (
    AutoregressivePolicy,
    Eagle3Policy,
    PromptLookupPolicy,
    SelectionPolicy,
    available_policies,
    get_policy,
    policy_class,
    register_policy,
    validate_policy,
)
from .quality import MeasuredSpecFitPolicy, UnionQuality
from .search import CostModel, SearchProblem, evaluate_subtree, select_subtree, useful_nodes
from .specfit import SpecFitPolicy, export_measurements, forget_measurements, import_measurements

__all__ = [
    "AcceptanceCalibrator",
    "AcceptanceModel",
    "path_acceptance",
    "OnlineCostModel",
    "calibrate",
    "fit_cost_model",
    "mape",
    "mape_floors",
    "CycleCostTracker",
    "default_cost_model",
    "DraftHeadPredictor",
    "HistoryPredictor",
    "RouterPredictor",
    "make_predictor",
    "ExpertForecast",
    "DraftingGate",
    "LookAhead",
    "SpecFitOptions",
    "AutoregressivePolicy",
    "Eagle3Policy",
    "PromptLookupPolicy",
    "LookupAcceptance",
    "best_lookup_prefix",
    "SelectionPolicy",
    "available_policies",
    "get_policy",
    "policy_class",
    "register_policy",
    "validate_policy",
    "CostModel",
    "SearchProblem",
    "evaluate_subtree",
    "select_subtree",
    "useful_nodes",
    "SpecFitPolicy",
    "forget_measurements",
    "export_measurements",
    "import_measurements",
    "OraclePolicy",
    "MeasuredSpecFitPolicy",
    "UnionQuality",
]
