"""Stage 2 without a draft model: prompt-lookup proposals copied from the context.

Text repeats itself: a summary copies phrases of its article, a worked answer repeats the
numbers and expressions of its question (``3+5=<<3+5=8>>``), and a model's own output
repeats its earlier output.  Where the last ``n`` tokens of the context occurred before,
what followed them then is a free guess at what follows now (prompt lookup decoding,
transformers' ``prompt_lookup_num_tokens``).  :class:`PromptLookup` keeps an index of every
n-gram of the context (``1 <= n <= max_ngram``) to the position after its latest
occurrence, so a proposal costs ``max_ngram`` dictionary probes and the index grows by
``max_ngram`` entries a committed token: no draft forward, no device work.

A proposal is only a candidate chain (:class:`~specfit_hf.tree.LookupProposal`); the
policy decides whether verifying some prefix of it pays, against drafting with the draft
model or a plain step, and the unmodified target verifies it like any chain.
"""

from __future__ import annotations

from typing import Iterable

from ..tree import LookupProposal

__all__ = ["PromptLookup"]


class PromptLookup:
    """The context's n-gram index and the proposal it makes after the last committed token.

    Args:
        max_ngram: longest suffix matched (the longest match wins: it is accepted most often).
        max_tokens: the longest proposal.
    """

    def __init__(self, max_ngram: int = 8, max_tokens: int = 10) -> None:
        if max_ngram < 1 or max_tokens < 1:
            raise ValueError(f"max_ngram and max_tokens must be >= 1, got {max_ngram} and {max_tokens}")
        self.max_ngram = int(max_ngram)
        self.max_tokens = int(max_tokens)
        self._tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence
        self._prompt_len = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def start(self, tokens: Iterable[int], prompt_len: int | None = None) -> None:
        """Index a new context: the prompt (its first ``prompt_len`` tokens; default: all) and any
        generated tokens after it."""
        self._tokens, self._after = [], {}
        self.extend(tokens)
        self._prompt_len = len(self._tokens) if prompt_len is None else int(prompt_len)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append committed tokens to the context."""
        seq, after, max_n = self._tokens, self._after, self.max_ngram
        for token in tokens:
            end = len(seq)
            # the n-grams ending just before ``token`` now have a continuation: ``token`` at ``end``
            for n in range(1, min(max_n, end) + 1):
                after[tuple(seq[end - n:end])] = end
            seq.append(int(token))

    def propose(self) -> LookupProposal | None:
        """What followed the latest earlier occurrence of the longest matching suffix (``None``: no match).

        The suffix ends with the last token of the context (the cycle's root); the index only
        holds n-grams with a continuation, so a suffix never matches itself.
        """
        seq, after = self._tokens, self._after
        for n in range(min(self.max_ngram, len(seq)), 0, -1):
            start = after.get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return LookupProposal(tokens=tuple(seq[start:start + self.max_tokens]), ngram=n,
                                      from_prompt=start < self._prompt_len, source=start)
        return None
