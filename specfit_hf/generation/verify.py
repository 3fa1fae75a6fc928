"""Stage 4 of the cycle: verify ``[root] + selected nodes`` with one target forward, then accept.

:func:`verify_forward` runs the unmodified target once over the block with the tree
attention mask and positions ``prefix_len + depth``, returning logits at every block
position (row ``i`` = the target's next-token distribution after block token ``i``).

:func:`accept` walks down from the root:

* greedy: follow the child whose token is the target's argmax at the current node;
  when none matches, the argmax is the bonus token.
* sampling: lossless multi-candidate recursive rejection sampling.  The draft's children
  are deterministic (top-k), i.e. each child ``x`` is a point-mass proposal: accept ``x``
  with probability ``p(x)`` (``p`` = the target's processed distribution, renormalised
  after earlier rejections); on rejection set ``p(x) = 0`` and renormalise; after the
  last child, sample the bonus token from what is left.  Every committed token then
  follows the target's distribution exactly.

Logits processors (temperature, top-k, top-p, repetition penalty, ...) are applied at
each visited node with the token path leading to it, exactly as ``_sample`` would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList

from ..tree import VerifyResult
from .candidates import TreeCandidates
from .drafter import without_grad
from .tree_mask import has_sliding_layers, model_tree_masks, tree_attention_mask

__all__ = ["verify_forward", "accept", "AcceptOutput"]


@without_grad
def verify_forward(target, cache, candidates: TreeCandidates) -> torch.Tensor:
    """One target forward over the block; returns ``[1 + n, V]`` float32 logits.

    The block's keys/values are appended to ``cache`` (the caller keeps the accepted
    path afterwards with ``cache.keep_prefix_and``).  Sliding-window layers get the window
    applied to the tree mask (:func:`~specfit_hf.generation.tree_mask.model_tree_masks`).
    """
    if cache.get_seq_length() != candidates.prefix_len:
        raise RuntimeError(
            f"target cache holds {cache.get_seq_length()} tokens, the tree expects {candidates.prefix_len}"
        )
    mask = candidates.attention_mask
    # Only sliding-window layers need more than the tree mask (model_tree_masks returns it
    # unchanged otherwise: skipping the call saves its positions and the cache's offset).
    if has_sliding_layers(target.config):
        if mask is None:
            # a plain step still gets the window explicitly (cut to what the sliding layers hold)
            dtype = target.dtype if target.dtype.is_floating_point else torch.float32
            mask = tree_attention_mask(candidates.block_parents, candidates.prefix_len, dtype=dtype,
                                       device=candidates.input_ids.device)
        mask = model_tree_masks(target.config, mask, candidates.prefix_len + candidates.depths,
                                sliding_offset=getattr(cache, "sliding_offset", 0))
    out = target(
        input_ids=candidates.input_ids,
        attention_mask=mask,
        position_ids=candidates.position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0,
    )
    return out.logits[0].to(torch.float32)


@dataclass
class AcceptOutput:
    """The verification outcome plus the per-token scores ``generate`` may return."""

    result: VerifyResult
    scores: list[torch.Tensor] = field(default_factory=list)  # processed, one [1, V] per committed token
    raw_logits: list[torch.Tensor] = field(default_factory=list)  # unprocessed, same rows


def _row_argmax(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(dim=-1).tolist()``: numpy's SIMD argmax on the host (same first-maximum /
    NaN rule, several times faster than torch's over a vocabulary on the CPU)."""
    if logits.is_cpu and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _children_lists(block_parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in block_parents]
    for i, p in enumerate(block_parents):
        if p >= 0:
            children[p].append(i)
    return children


@without_grad
def accept(
    logits: torch.Tensor,
    candidates: TreeCandidates,
    sequence: torch.LongTensor,
    logits_processor: LogitsProcessorList | None,
    do_sample: bool,
    generator: torch.Generator | None = None,
    keep_scores: bool = False,
) -> AcceptOutput:
    """Decide the accepted path and the bonus token.

    Args:
        logits: ``[1 + n, V]`` from :func:`verify_forward`.
        candidates: the verified block.
        sequence: ``[1, L]`` committed tokens, ending with the root.
        logits_processor: the processors ``generate`` prepared (may be empty).
        do_sample: sampling (lossless rejection sampling) or greedy acceptance.
        generator: RNG for sampling; ``None`` uses the global RNG like ``generate``.
            Must live on ``logits.device``.
        keep_scores: also return the processed / raw score rows of committed tokens.
    """
    if not do_sample and not keep_scores and candidates.num_nodes == 0 and not (logits_processor or []):
        # a plain greedy step: the bonus is the root row's argmax (most cycles where drafting does not pay)
        bonus = _row_argmax(logits[:1])[0]
        return AcceptOutput(result=VerifyResult(accepted=[], accepted_positions=[0], new_tokens=[bonus],
                                                bonus_token=bonus))
    tokens = candidates.input_ids.tolist()[0]
    block_parents = candidates.block_parents.tolist()
    children = _children_lists(block_parents)
    has_processors = logits_processor is not None and len(logits_processor) > 0

    # Greedy without processors: one argmax over all rows, one host transfer.
    row_argmax = None
    if not do_sample and not has_processors:
        row_argmax = _row_argmax(logits)

    # Greedy without processors or kept scores reads nothing but row_argmax.
    need_rows = row_argmax is None or keep_scores

    out = AcceptOutput(result=VerifyResult(accepted=[], accepted_positions=[0], new_tokens=[], bonus_token=-1))
    path_tokens: list[int] = []
    node = 0
    while True:
        if need_rows:
            raw = logits[node : node + 1]
            if has_processors:
                path_ids = sequence
                if path_tokens:
                    path_ids = torch.cat([sequence, torch.tensor([path_tokens], device=sequence.device)], dim=1)
                scores = logits_processor(path_ids, raw.clone())
            else:
                scores = raw
            if keep_scores:
                out.scores.append(scores.clone())
                out.raw_logits.append(raw.clone())
        kids = children[node]
        if not do_sample:
            target_token = row_argmax[node] if row_argmax is not None else int(scores.argmax(dim=-1))
            nxt = next((c for c in kids if tokens[c] == target_token), None)
            if nxt is None:
                bonus = target_token
                break
        else:
            probs = torch.softmax(scores[0], dim=-1)
            nxt, bonus = _rejection_step(probs, kids, tokens, generator)
            if nxt is None:
                break
        node = nxt
        path_tokens.append(tokens[node])
        out.result.accepted_positions.append(node)

    # Block position i >= 1 is the (i-1)-th selected node in sorted tree order.
    nodes = candidates.selection.nodes
    selected = sorted((nodes if nodes.dim() == 1 else nodes.reshape(-1)).tolist())
    out.result.accepted = [selected[p - 1] for p in out.result.accepted_positions[1:]]
    out.result.new_tokens = path_tokens + [int(bonus)]
    out.result.bonus_token = int(bonus)
    return out


def _rejection_step(
    probs: torch.Tensor, kids: list[int], tokens: list[int], generator: torch.Generator | None
) -> tuple[int | None, int]:
    """One node of recursive rejection sampling; returns (accepted child or None, bonus token)."""
    if kids:
        kid_tokens = torch.tensor([tokens[c] for c in kids], device=probs.device)
        p_kids = probs[kid_tokens].double().cpu()
        u = torch.rand(len(kids), generator=generator, device=probs.device, dtype=torch.float64).cpu()
        residual = 1.0  # mass left after rejecting earlier children (relative to p)
        seen: set[int] = set()
        for j, c in enumerate(kids):
            if tokens[c] in seen:  # a repeated token was already zeroed out of p
                continue
            seen.add(tokens[c])
            p = float(p_kids[j])
            if residual > 0.0 and u[j].item() * residual < p:
                return c, -1
            residual -= p
        # All children rejected: sample from p with their tokens removed.
        probs = probs.clone()
        probs[kid_tokens] = 0.0
        if float(probs.sum()) <= 0.0:
            # Only reachable through rounding (children held ~all the mass); fall back to
            # the most likely child token instead of dividing by zero.
            return None, int(kid_tokens[int(p_kids.argmax())])
    bonus = torch.multinomial(probs, 1, generator=generator)
    return None, int(bonus)
