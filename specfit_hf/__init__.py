"""specfit_hf: throughput-optimal tree speculative decoding for offloaded MoE models.

Importing this package changes nothing in transformers until a ``SpecFitConfig`` is
passed to ``generate``.
"""

__version__ = "0.1.0"
