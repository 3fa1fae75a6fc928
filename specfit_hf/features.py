"""Capture a few of the target's pre-norm hidden states during an ordinary forward.

EAGLE-3 drafts from three target hidden states (low / mid / high).  Asking the model
for ``output_hidden_states=True`` would keep every layer's activations; instead
forward hooks on the decoder layers copy out only the requested ones.

Indices follow the Hugging Face ``hidden_states`` convention: index ``i`` is the input
of decoder layer ``i`` (index 0 = the embeddings, index ``L`` = the last layer's
output before the final norm).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

__all__ = ["decoder_layers", "capture_hidden_states"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


@contextmanager
def capture_hidden_states(model: nn.Module, indices: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Context manager; yields a dict filled with ``{hf_index: hidden [B, T, H]}`` by each forward.

    A later forward inside the same context overwrites the entries.
    """
    layers = decoder_layers(model)
    num_layers = len(layers)
    out: dict[int, torch.Tensor] = {}
    handles = []
    for idx in sorted(set(int(i) for i in indices)):
        if not 0 <= idx <= num_layers:
            raise ValueError(f"hidden-state index {idx} outside [0, {num_layers}]")
        if idx < num_layers:
            def pre_hook(module, args, kwargs, idx=idx):
                hidden = args[0] if args else kwargs["hidden_states"]
                out[idx] = hidden.detach()
            handles.append(layers[idx].register_forward_pre_hook(pre_hook, with_kwargs=True))
        else:
            def post_hook(module, args, output, idx=idx):
                hidden = output[0] if isinstance(output, tuple) else output
                out[idx] = hidden.detach()
            handles.append(layers[num_layers - 1].register_forward_hook(post_hook))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
