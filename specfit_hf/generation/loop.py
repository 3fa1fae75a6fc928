"""The generation loop: tree speculative decoding, one cycle read top-down.

    prefill   target forward on the prompt -> first token (the first root); drafter.start
    cycle     propose   draft levels / select until the policy stops      (candidates.py)
              verify    one target forward over [root] + selection        (verify.py)
              accept    greedy match or lossless rejection sampling       (verify.py)
              stop      max_new_tokens / eos / stopping criteria inside the tree
              commit    target cache keeps the accepted path              (cache.py)
                        drafter keeps the accepted path                   (drafter)
              record    CycleRecord; policy.observe

:func:`tree_speculative_decoding` has the signature of transformers'
``GenerationMixin._assisted_decoding``; :mod:`specfit_hf.generation.hf_integration`
routes ``generate`` here when the generation config is a ``SpecFitConfig``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..clock import clock
from ..features import capture_hidden_states
from ..offload import get_runtime
from ..selection import get_policy
from ..tree import CycleContext, CycleRecord
from .cache import SpecFitCache
from .candidates import TreeCandidateGenerator, make_drafter
from .lookup import PromptLookup
from .oracle_probe import TreeOracleProbe
from .verify import accept, verify_forward

__all__ = ["CycleRecord", "SpecFitGenerateOutput", "tree_speculative_decoding"]


@dataclass
class SpecFitGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the per-cycle records."""

    cycles: list[CycleRecord] | None = None


def _target_cache(model, model_kwargs: dict) -> SpecFitCache:
    cache = model_kwargs.get("past_key_values")
    if isinstance(cache, SpecFitCache) and cache.get_seq_length() == 0:
        return cache
    if cache is None or (isinstance(cache, DynamicCache) and cache.get_seq_length() == 0):
        # generate() prepared an empty DynamicCache; use a gatherable one of the same layout.
        return SpecFitCache(config=model.config)
    raise ValueError(
        "tree speculative decoding starts from an empty cache; got a "
        f"{type(cache).__name__} holding {cache.get_seq_length() if hasattr(cache, 'get_seq_length') else '?'} tokens"
    )


# Model kwargs generate() prepares that the loop handles itself.
_HANDLED_MODEL_KWARGS = {
    "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep", "inputs_embeds",
    "output_attentions", "output_hidden_states",
}


def _check_supported(model, input_ids, generation_config, model_kwargs, assistant_model) -> None:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"tree speculative decoding supports batch size 1 only, got batch size {input_ids.shape[0]}"
        )
    if assistant_model is None:
        raise ValueError("tree speculative decoding needs `assistant_model` (the draft model)")
    if model.config.is_encoder_decoder:
        raise ValueError("tree speculative decoding supports decoder-only (causal LM) targets only")
    if not model_kwargs.get("use_cache", True):
        raise ValueError("tree speculative decoding requires use_cache=True")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("tree speculative decoding takes input_ids, not inputs_embeds")
    # Extra forward inputs (token_type_ids, pixel values, ...) would be dropped by the
    # tree forwards: refuse them rather than decode something else.
    unsupported = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _HANDLED_MODEL_KWARGS)
    if unsupported:
        raise ValueError(f"tree speculative decoding does not support these model inputs: {unsupported}")
    attn = str(getattr(model.config, "_attn_implementation", "") or "")
    if attn.startswith("flash") or "flex" in attn:
        raise ValueError(
            f"tree verification needs an additive 4D attention mask; attention implementation {attn!r} "
            "cannot take one (use 'sdpa' or 'eager')"
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("tree speculative decoding does not return attentions / hidden states")
    if getattr(generation_config, "cache_implementation", None) in ("static", "hybrid", "sliding_window"):
        raise ValueError("tree speculative decoding needs a dynamic cache, not a static one")


def _concat_features(captured: dict[int, torch.Tensor], indices, rows: torch.Tensor | None) -> torch.Tensor:
    """Requested target hidden states, concatenated on the last axis, optionally only ``rows``."""
    feats = torch.cat([captured[int(i)] for i in indices], dim=-1)
    if rows is not None:
        feats = feats[:, rows.to(feats.device)]
    return feats


class _StopRule:
    """max_new_tokens, eos and custom stopping criteria applied *inside* a cycle's new tokens."""

    def __init__(self, generation_config, stopping_criteria: StoppingCriteriaList) -> None:
        self.max_length = int(generation_config.max_length)
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = set() if eos is None else set(eos.reshape(-1).tolist())
        # MaxLength / eos are handled by truncation; others (stop strings, user criteria)
        # must see every prefix, so they are checked token by token.
        handled = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)
        self.per_token = [c for c in stopping_criteria if not isinstance(c, handled)]
        # truncation already ends at max_length and eos: only other criteria need a call per cycle
        covered = (MaxLengthCriteria, EosTokenCriteria)
        self.after_cycle = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, covered)])

    def truncate(self, sequence: torch.LongTensor, new_tokens: list[int]) -> tuple[list[int], bool]:
        """Tokens to append and whether generation ends after them."""
        budget = self.max_length - sequence.shape[1]
        stop = False
        if len(new_tokens) >= budget:
            new_tokens, stop = new_tokens[: max(budget, 0)], True
        for i, tok in enumerate(new_tokens):
            if tok in self.eos:
                new_tokens, stop = new_tokens[: i + 1], True
                break
        if self.per_token and new_tokens:
            ext = torch.cat([sequence, torch.tensor([new_tokens], device=sequence.device)], dim=1)
            base = sequence.shape[1]
            for i in range(len(new_tokens)):
                if bool(StoppingCriteriaList(self.per_token)(ext[:, : base + i + 1], None).any()):
                    new_tokens, stop = new_tokens[: i + 1], True
                    break
        return new_tokens, stop

    def done(self, sequence: torch.LongTensor, scores) -> bool:
        """Whether a criterion truncation does not cover (max time, stop strings, user criteria) ends here."""
        return len(self.after_cycle) > 0 and bool(self.after_cycle(sequence, scores).any())


@torch.no_grad()
def tree_speculative_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor: torch.Tensor | None = None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
) -> SpecFitGenerateOutput | torch.LongTensor:
    """Tree speculative decoding (``generate`` with a ``SpecFitConfig`` and an ``assistant_model``)."""
    if synced_gpus:
        raise ValueError("tree speculative decoding does not support synced_gpus")
    if assistant_tokenizer is not None:
        raise ValueError("tree speculative decoding needs a draft sharing the target's tokenizer")
    _check_supported(model, input_ids, generation_config, model_kwargs, assistant_model)
    config = generation_config
    do_sample = bool(config.do_sample)
    return_dict = bool(config.return_dict_in_generate)
    keep_scores = return_dict and bool(config.output_scores or config.output_logits)
    scores: list[torch.Tensor] = []
    raw_logits: list[torch.Tensor] = []
    stop_rule = _StopRule(config, stopping_criteria)

    # Set up the stages of the cycle.
    cache = _target_cache(model, model_kwargs)
    runtime = get_runtime(model)
    experts = None if runtime is None else runtime.view()
    drafter = make_drafter(assistant_model, model, config)
    feature_indices = drafter.target_feature_indices
    policy = get_policy(config.policy, config)
    mask_dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    oracle_probe = TreeOracleProbe(model, cache, runtime, mask_dtype)  # only the "oracle" policy calls it
    ctx = CycleContext(target=model, config=config, experts=experts, draft=assistant_model, oracle_probe=oracle_probe)
    lookup = PromptLookup(max_tokens=policy.lookup_tokens) if policy.lookup_tokens else None
    candidate_generator = TreeCandidateGenerator(drafter, policy, ctx, policy.max_levels, model.device, mask_dtype,
                                                 lookup, runtime)
    records: list[CycleRecord] = []

    # Prefill: the target reads the prompt and produces the first token (the first root).
    # A 2D attention mask with zeros (padding inside a batch-1 prompt) is honoured like
    # generate does: those keys stay hidden and positions skip them.
    sequence = input_ids
    prompt_len = input_ids.shape[1]
    prompt_mask = model_kwargs.get("attention_mask")
    positions = model_kwargs.get("position_ids")
    if positions is None or positions.shape[-1] != prompt_len:
        positions = torch.arange(prompt_len, device=input_ids.device)[None]
    prefix_hidden = None if prompt_mask is None else torch.nonzero(prompt_mask[0] == 0).reshape(-1)
    # The drafter reads target hidden states of every target forward: the capture hooks stay
    # on for the whole call (registering them per forward costs host time every cycle).
    capture = contextlib.ExitStack()
    captured = capture.enter_context(_maybe_capture(model, feature_indices))
    try:
        out = model(
            input_ids=input_ids.to(model.device),
            attention_mask=None if prompt_mask is None else prompt_mask.to(model.device),
            position_ids=positions.to(model.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        prompt_features = _concat_features(captured, feature_indices, None) if feature_indices else None
        first_logits = out.logits[:, -1].to(dtype=torch.float32, device=input_ids.device)
        first_scores = logits_processor(sequence, first_logits.clone()) if len(logits_processor) else first_logits
        if do_sample:
            first = torch.multinomial(torch.softmax(first_scores, dim=-1), 1)[0]
        else:
            first = first_scores.argmax(dim=-1)
        if keep_scores:
            scores.append(first_scores)
            raw_logits.append(first_logits)
        sequence = torch.cat([sequence, first[None].to(sequence.device)], dim=1)
        finished = bool(stopping_criteria(sequence, None).any())  # every criterion: nothing was truncated
        root_position = int(positions[0, -1]) + 1

        if not finished:
            # The draft reads the prompt as part of the prefill, before the first token is
            # emitted (as serving engines run the drafter in the prefill step): it is prompt
            # work, paid once per call, and it belongs in TTFT, not in the decode rate.
            candidate_generator.start(input_ids, prompt_features, int(first))
            ctx.prefix_len = cache.get_seq_length()
            policy.reset(ctx)
        if streamer is not None:
            streamer.put(first.cpu())

        # Every host second of the loop lands in a cycle: the policy learns from a cycle after it is
        # recorded, so that learning is timed into the next cycle (``CycleRecord.observe_seconds``).
        cycle_start, observe_s = clock(), 0.0
        while not finished:
            loads_before = None if experts is None else experts.loads()
            root_loads_before = None if experts is None else experts.root_loads()
            uses_before = None if experts is None else experts.first_uses()
            prefix_len = cache.get_seq_length()
            root = int(sequence[0, -1])

            # Draft and select.
            oracle_probe.prefix_len, oracle_probe.root_position = prefix_len, root_position
            oracle_probe.prefix_hidden = prefix_hidden
            candidates = candidate_generator.propose(root, prefix_len, root_position, prefix_hidden)

            # Verify and accept.
            verify_start = clock()
            logits = verify_forward(model, cache, candidates)
            block_features = _concat_features(captured, feature_indices, None) if feature_indices else None
            accepted = accept(
                logits.to(input_ids.device), candidates, sequence, logits_processor, do_sample, keep_scores=keep_scores
            )
            result = accepted.result
            verify_s = clock() - verify_start

            # Stop inside the tree: max_new_tokens, eos, stopping criteria.
            new_tokens, finished = stop_rule.truncate(sequence, result.new_tokens)
            appended = torch.tensor([new_tokens], dtype=sequence.dtype, device=sequence.device)
            sequence = torch.cat([sequence, appended], 1)
            if streamer is not None:
                streamer.put(torch.tensor([new_tokens]))
            if keep_scores:
                scores.extend(accepted.scores[: len(new_tokens)])
                raw_logits.extend(accepted.raw_logits[: len(new_tokens)])
            finished = finished or stop_rule.done(sequence, None)
            root_position += len(new_tokens)

            # Commit: both caches keep the root and the accepted path.  The target cache
            # always does (a returned cache then holds exactly sequence[:-1]); the drafter
            # only while generation goes on.
            cache.keep_prefix_and(prefix_len, result.accepted_positions[: len(new_tokens)])
            if not finished:
                commit_features = block_features
                if block_features is not None and len(result.accepted_positions) < block_features.shape[1]:
                    rows = torch.tensor(result.accepted_positions, dtype=torch.long)
                    commit_features = block_features[:, rows.to(block_features.device)]
                candidate_generator.commit(candidates, result, commit_features)

            row_experts = row_loads = None
            if experts is not None:
                rows = candidates.num_nodes + 1
                uses, uses_loads = experts.first_uses()
                row_experts = tuple((uses - uses_before[0])[:rows].tolist())
                row_loads = tuple((uses_loads - uses_before[1])[:rows].tolist())
            record = CycleRecord(
                nodes_drafted=len(candidates.tree),
                nodes_verified=candidates.num_nodes,
                tokens_accepted=len(result.accepted),
                tokens_committed=len(new_tokens),
                cycle_seconds=clock() - cycle_start,
                draft_seconds=candidates.draft_seconds,
                select_seconds=candidates.select_seconds,
                observe_seconds=observe_s,
                verify_seconds=verify_s,
                levels_drafted=candidates.tree.num_levels if candidates.tree.source == "draft" else 0,
                source=candidates.tree.source,
                experts_loaded=None if experts is None else experts.loads() - loads_before,
                root_experts_loaded=None if experts is None else experts.root_loads() - root_loads_before,
                expected_tokens=float(candidates.selection.expected_tokens),
                predicted_time=float(candidates.selection.predicted_time),
                row_experts=row_experts,
                row_loads=row_loads,
                kind=policy.cycle_kind(candidates.tree),
            )
            records.append(record)
            cycle_start = clock()
            candidate_generator.observe(candidates, result, record)
            observe_s = clock() - cycle_start
    finally:
        capture.close()

    if streamer is not None:
        streamer.end()
    if not return_dict:
        return sequence
    return SpecFitGenerateOutput(
        sequences=sequence,
        scores=tuple(scores) if config.output_scores else None,
        logits=tuple(raw_logits) if config.output_logits else None,
        past_key_values=cache,
        cycles=records,
    )


def _maybe_capture(model, indices):
    """``capture_hidden_states`` when the drafter wants target features, else a no-op context."""
    return capture_hidden_states(model, indices) if indices else contextlib.nullcontext({})
