"""How ``model.generate`` reaches the tree loop (transformers 5.23).

How transformers dispatches (``GenerationMixin.generate``):

1. ``generation_config.get_generation_mode(assistant_model)`` returns
   ``ASSISTED_GENERATION`` whenever an ``assistant_model`` is given with greedy or
   sampling settings.
2. The decoding method is looked up **on the model class**:
   ``getattr(type(self), "_assisted_decoding")``, after the config, logits processors,
   stopping criteria and an empty ``DynamicCache`` have been prepared.
3. ``_validate_generation_mode`` compares the draft's ``vocab_size`` with the target's
   and demands ``tokenizer`` / ``assistant_tokenizer`` when they differ.

Alternatives considered: ``custom_generate=callable`` never receives
``assistant_model`` (it is consumed by generate's own signature), and a
``GenerationMixin`` subclass would require users to build special model classes.

Chosen mechanism (least invasive): at import, :func:`install` replaces
``GenerationMixin._assisted_decoding`` with a thin wrapper that calls
:func:`~specfit_hf.generation.loop.tree_speculative_decoding` **only when the generation
config is a** :class:`~specfit_hf.generation.config.SpecFitConfig`, and otherwise calls
the original function unchanged.  ``_validate_generation_mode`` gets the same kind of
wrapper: for a ``SpecFitConfig`` the vocabulary-size comparison is skipped (a drafter
maps its own vocabulary onto the target's, e.g. EAGLE-3's reduced draft vocabulary;
the output is lossless whatever the draft proposes).  Stock generation (any other
config, or no assistant) takes exactly the original code paths; tests check both.
:func:`uninstall` restores the originals.
"""

from __future__ import annotations

from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from .config import SpecFitConfig
from .loop import tree_speculative_decoding

__all__ = ["install", "uninstall", "is_installed"]

logger = logging.get_logger(__name__)

_ORIGINALS: dict[str, object] = {}


def _specfit_assisted_decoding(
    self,
    input_ids,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus=False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    # Same signature as GenerationMixin._assisted_decoding: generate() inspects it
    # (it passes `inputs_tensor` only to methods that declare it).
    if isinstance(generation_config, SpecFitConfig):
        return tree_speculative_decoding(
            self,
            input_ids,
            logits_processor=logits_processor,
            stopping_criteria=stopping_criteria,
            generation_config=generation_config,
            synced_gpus=synced_gpus,
            streamer=streamer,
            inputs_tensor=inputs_tensor,
            assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer,
            tokenizer=tokenizer,
            **model_kwargs,
        )
    return _ORIGINALS["_assisted_decoding"](
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=synced_gpus,
        streamer=streamer,
        inputs_tensor=inputs_tensor,
        assistant_model=assistant_model,
        assistant_tokenizer=assistant_tokenizer,
        tokenizer=tokenizer,
        **model_kwargs,
    )


def _specfit_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    if isinstance(generation_config, SpecFitConfig):
        if "assistant_model" in generation_mode_kwargs:
            # Skip only the draft/target vocabulary comparison; every other check runs.
            generation_mode_kwargs = {k: v for k, v in generation_mode_kwargs.items() if k != "assistant_model"}
        else:
            logger.warning_once(
                "SpecFitConfig given without assistant_model: generate runs plain (non-speculative) decoding; "
                "pass assistant_model=<draft> for tree speculative decoding"
            )
    return _ORIGINALS["_validate_generation_mode"](self, generation_mode, generation_config, generation_mode_kwargs)


_WRAPPERS = {
    "_assisted_decoding": _specfit_assisted_decoding,
    "_validate_generation_mode": _specfit_validate_generation_mode,
}


def install() -> None:
    """Install the wrappers on ``GenerationMixin`` (idempotent)."""
    for name, wrapper in _WRAPPERS.items():
        current = GenerationMixin.__dict__[name]
        if current is wrapper:
            continue
        _ORIGINALS[name] = current
        wrapper.__doc__ = (getattr(current, "__doc__", None) or "") + (
            "\n\n(specfit_hf: routes SpecFitConfig calls to tree speculative decoding.)"
        )
        setattr(GenerationMixin, name, wrapper)


def uninstall() -> None:
    """Restore the original ``GenerationMixin`` methods."""
    for name, original in list(_ORIGINALS.items()):
        setattr(GenerationMixin, name, original)
        del _ORIGINALS[name]


def is_installed() -> bool:
    return all(GenerationMixin.__dict__.get(name) is wrapper for name, wrapper in _WRAPPERS.items())
