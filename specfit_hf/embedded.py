"""Where the embedded tiny model pair lives, in a source checkout and after ``pip install .``.

The pair (``specfit-tiny-qwen3moe`` target and ``specfit-tiny-qwen3moe-eagle3`` draft) is
kept in ``<repo>/model_cards/`` and shipped inside the package as
``specfit_hf/model_cards/`` (``setup.cfg`` maps that package onto the same folder), so
``specfit generate`` and ``specfit demo`` work after a plain, non-editable install.

Lookup order, per folder:

1. ``$SPECFIT_TARGET_MODEL`` / ``$SPECFIT_DRAFT_MODEL`` when set (used as given);
2. ``<repo>/model_cards/<name>`` next to the imported package (a checkout or editable install);
3. ``<site-packages>/specfit_hf/model_cards/<name>`` (a wheel / ``pip install .``).

:func:`embedded_pair` returns the first candidate that exists; when none does it still
returns a path (the first candidate) so callers can report it, and
:func:`embedded_pair_candidates` lists every place that was tried.
"""

from __future__ import annotations

import os
from pathlib import Path

from .data import (
    DRAFT_MODEL_DIRNAME,
    DRAFT_MODEL_ENV,
    TARGET_MODEL_DIRNAME,
    TARGET_MODEL_ENV,
    DefaultModelPaths,
)

__all__ = ["embedded_pair", "embedded_pair_candidates", "model_cards_dirs"]

_PACKAGE_DIR = Path(__file__).resolve().parent


def model_cards_dirs() -> list[Path]:
    """Folders that may hold the embedded pair, in lookup order (checkout first, then the package)."""
    return [_PACKAGE_DIR.parent / "model_cards", _PACKAGE_DIR / "model_cards"]


def embedded_pair_candidates() -> dict[str, list[Path]]:
    """``{"target": [...], "draft": [...]}``: every path :func:`embedded_pair` considers, in order."""
    out: dict[str, list[Path]] = {}
    for what, env, name in (("target", TARGET_MODEL_ENV, TARGET_MODEL_DIRNAME),
                            ("draft", DRAFT_MODEL_ENV, DRAFT_MODEL_DIRNAME)):
        override = os.environ.get(env)
        out[what] = [Path(override)] if override else [cards / name for cards in model_cards_dirs()]
    return out


def embedded_pair() -> DefaultModelPaths:
    """Target and draft folders of the embedded pair (see the module docstring for the order).

    Paths are returned whether or not they exist; callers check ``is_dir()`` and report.
    """
    found = {}
    for what, candidates in embedded_pair_candidates().items():
        found[what] = next((p for p in candidates if (p / "config.json").is_file()), candidates[0])
    return DefaultModelPaths(target=found["target"], draft=found["draft"])
