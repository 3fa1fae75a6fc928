"""Tree speculative decoding inside ``model.generate``.

    model.generate(input_ids, assistant_model=draft, generation_config=SpecFitConfig(...))

Modules, one per stage of the cycle:

* :mod:`.config` - ``SpecFitConfig`` (a ``GenerationConfig`` with the tree settings)
* :mod:`.drafter` / :mod:`.causal_lm_drafter` - the ``Drafter`` interface and the generic top-k tree drafter
* :mod:`.lookup` - ``PromptLookup``: chains copied from the context (prompt lookup), no draft model
* :mod:`.candidates` - draft + select: ``make_drafter``, ``TreeCandidateGenerator`` -> ``TreeCandidates``
* :mod:`.tree_mask` - parents -> additive 4D tree attention mask
* :mod:`.verify` - one target forward over the tree, greedy / rejection-sampling acceptance
* :mod:`.cache` - ``SpecFitCache``: keep the accepted path by gathering along the sequence axis
* :mod:`.loop` - the cycle, top-down (the records it passes around are in :mod:`specfit_hf.tree`)
* :mod:`.hf_integration` - how ``generate`` is routed here (installed on import; stock
  behaviour unchanged unless the config is a ``SpecFitConfig``)
"""

from ..tree import CycleRecord
from . import hf_integration
from .cache import SpecFitCache, UnsupportedCacheLayerError
from .candidates import TreeCandidateGenerator, TreeCandidates, make_drafter
from .causal_lm_drafter import CausalLMTreeDrafter
from .config import EAGLE3_DEFAULTS, SpecFitConfig
from .drafter import Drafter
from .lookup import PromptLookup
from .loop import SpecFitGenerateOutput, tree_speculative_decoding
from .tree_mask import ancestor_matrix, tree_attention_mask
from .verify import accept, verify_forward

hf_integration.install()

__all__ = [
    "CausalLMTreeDrafter",
    "CycleRecord",
    "Drafter",
    "EAGLE3_DEFAULTS",
    "PromptLookup",
    "SpecFitCache",
    "SpecFitConfig",
    "SpecFitGenerateOutput",
    "TreeCandidateGenerator",
    "TreeCandidates",
    "UnsupportedCacheLayerError",
    "accept",
    "ancestor_matrix",
    "make_drafter",
    "tree_attention_mask",
    "tree_speculative_decoding",
    "verify_forward",
]
