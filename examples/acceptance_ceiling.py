"""How much draft acceptance speculation needs on a machine: chains with a scripted acceptance rate.

    python examples/acceptance_ceiling.py --twin qwen3-30b-a3b@rtx4090-pcie4 --dataset cnn_dailymail \
        --cache-fraction 0.5 --num-prompts 12 --alphas draft 0.8 0.9 1.0

For every prompt it first decodes greedily with the target alone (the reference), then runs the
fixed chains ``static:d<h>k1n<h>`` with the real EAGLE-3 draft, except that each drafted token is
replaced: with probability ``alpha`` by the reference's token at that position (the target will
accept it), otherwise by a token the target will reject.  So every depth is accepted with
probability ``alpha`` given its parent was, independently of the text.  Everything else is
real: the draft still runs (and is charged) level by level, the target verifies the scripted
chain, and each verified token routes to its own experts through the offloaded cache.  Output
stays token-identical to the reference (checked on every run).

``alpha = draft`` runs the real draft unchanged, for comparison.  The table gives decode tok/s
relative to plain decoding, over all decode tokens and (in brackets) after the first 24
(``specfit_hf.bench.WARMUP_TOKENS``), on the clock in force: a twin's modeled GPU timeline
with ``--twin``, else this CPU with an emulated ``--link``.
"""

from __future__ import annotations

import argparse
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit_hf.bench import (  # noqa: E402
    EAGLE3_DEFAULTS,
    PromptRun,
    Variant,
    _decode_tokens_per_second,
    link_for_regime,
    measure_cached_step,
    run_variant,
    static_variant,
)
from specfit_hf.cli import load_pair  # noqa: E402
from specfit_hf.data import load_prompts  # noqa: E402
from specfit_hf.generation.drafter import Drafter  # noqa: E402
from specfit_hf.offload import offload_experts  # noqa: E402
from specfit_hf.tree import DraftTree, VerifyResult  # noqa: E402


class ScriptedAcceptanceDrafter(Drafter):
    """A drafter whose chain tokens are accepted with probability ``alpha`` per depth.

    It drives ``inner`` (the real drafter, so the draft's cost is paid as usual) and then
    overwrites the newest node of a chain: with probability ``alpha`` by ``sequence``'s token at
    that position (the target's own greedy continuation: accepted), else by another token
    (rejected).  Trees wider than a chain are left as drafted.
    """

    def __init__(self, inner: Drafter, sequence: Sequence[int], alpha: float, rng: random.Random,
                 vocab_size: int) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.inner = inner
        self.sequence = list(sequence)
        self.alpha = alpha
        self.rng = rng
        self.vocab_size = vocab_size
        self.target_feature_indices = inner.target_feature_indices
        self.root_index = 0  # sequence index of the current cycle's root

    def start(self, prompt_ids: torch.LongTensor, target_features: torch.Tensor | None) -> None:
        self.root_index = int(prompt_ids.shape[1])  # the first root is the prefill's token
        self.inner.start(prompt_ids, target_features)

    def draft_level(self, tree: DraftTree, expand: torch.Tensor | None = None, children: int | None = None) -> None:
        self.inner.draft_level(tree, expand, children)
        if len(tree) != tree.num_levels:
            return  # not a chain
        index = self.root_index + tree.num_levels
        if index >= len(self.sequence):
            return  # past the reference's end: the loop stops there anyway
        correct = int(self.sequence[index])
        if self.rng.random() < self.alpha:
            tree.tokens[-1] = correct
        elif int(tree.tokens[-1]) == correct:
            tree.tokens[-1] = (correct + 1) % self.vocab_size

    def commit(self, tree: DraftTree, result: VerifyResult, target_features: torch.Tensor | None) -> None:
        self.inner.commit(tree, result, target_features)
        self.root_index += len(result.new_tokens)


@contextmanager
def scripted_acceptance(draft: torch.nn.Module, sequence: Sequence[int], alpha: float | None,
                        seed: int = 0) -> Iterator[None]:
    """Inside, ``generate(..., assistant_model=draft)`` drafts through :class:`ScriptedAcceptanceDrafter`.

    ``alpha=None`` leaves the draft as it is.
    """
    if alpha is None:
        yield
        return
    make = draft.make_tree_drafter
    rng = random.Random(seed)
    vocab = int(draft.config.vocab_size)
    draft.make_tree_drafter = lambda target, config: ScriptedAcceptanceDrafter(
        make(target, config), sequence, alpha, rng, vocab)
    try:
        yield
    finally:
        del draft.make_tree_drafter  # the class's method again


def measure(target: torch.nn.Module, draft: torch.nn.Module, prompts: Sequence[torch.Tensor],
            alphas: Sequence[float | None], depths: Sequence[int], max_new_tokens: int
            ) -> tuple[float, dict[tuple[float | None, int], tuple[float, float, float]]]:
    """Plain decoding's decode tok/s, and per (alpha, depth): (x plain, x plain after the warm-up, tokens/cycle).

    Raises ``AssertionError`` if any scripted run's output differs from plain decoding's.
    """
    plain = Variant("autoregressive", "autoregressive", config=dict(EAGLE3_DEFAULTS))
    run_variant(target, draft, prompts[0], plain, max_new_tokens)  # warm-up, not counted
    references: list[list[int]] = []
    plain_runs: list[PromptRun] = []
    for ids in prompts:
        run = run_variant(target, draft, ids, plain, max_new_tokens)
        plain_runs.append(run)
        references.append(ids[0].tolist() + run.new_tokens)
    base = _decode_tokens_per_second(plain_runs)
    base_steady = _decode_tokens_per_second(plain_runs, "steady")
    out = {}
    total = len(alphas) * len(depths) * len(prompts)
    with tqdm(total=total, desc="scripted chains", unit="run") as bar:
        for alpha in alphas:
            for depth in depths:
                chain = static_variant(f"static:d{depth}k1n{depth}")
                runs = []
                for i, (ids, sequence) in enumerate(zip(prompts, references)):
                    with scripted_acceptance(draft, sequence, alpha, seed=i):
                        run = run_variant(target, draft, ids, chain, max_new_tokens, prompt_index=i)
                    if run.new_tokens != sequence[ids.shape[1]:]:
                        raise AssertionError(f"prompt {i}, alpha {alpha}, depth {depth}: output differs from plain")
                    runs.append(run)
                    bar.update()
                out[(alpha, depth)] = (
                    _decode_tokens_per_second(runs) / base,
                    _decode_tokens_per_second(runs, "steady") / base_steady,
                    sum(r.decode_tokens for r in runs) / sum(r.cycles for r in runs),
                )
    return base, out


def _alpha(text: str) -> float | None:
    return None if text == "draft" else float(text)


def main(argv: list[str] | None = None) -> dict[tuple[float | None, int], tuple[float, float, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "cnn_dailymail"])
    p.add_argument("--num-prompts", type=int, default=12, help="test prompts (after one warm-up prompt)")
    p.add_argument("--cache-fraction", type=float, default=0.5)
    p.add_argument("--twin", default=None, help="a device twin (specfit_hf.twin.twin_names()); default: CPU clock")
    p.add_argument("--link", default="qwen3-pcie4", help="emulated link regime on the CPU clock (without --twin)")
    p.add_argument("--alphas", nargs="+", default=["draft", "0.8", "0.9", "1.0"],
                   help="per-depth acceptance rates to script, or 'draft' for the real draft")
    p.add_argument("--depths", nargs="+", type=int, default=[1, 2, 3, 4], help="chain depths")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-source-chars", type=int, default=2500, help="article / question cut (default 2,500 as examples/measure_acceptance.py; the specfit bench CLI cuts at 1,500)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="target folder (default: the embedded pair)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder (default: the embedded pair)")
    args = p.parse_args(argv)
    alphas = [_alpha(a) for a in args.alphas]
    if any(a is not None and not 0.0 <= a <= 1.0 for a in alphas):
        p.error("--alphas must be 'draft' or numbers in [0, 1]")
    if any(d < 1 for d in args.depths):
        p.error("--depths must be >= 1")
    torch.set_num_threads(args.threads)

    target, draft, tokenizer = load_pair(args.model, args.draft, "cpu")
    if not callable(getattr(draft, "make_tree_drafter", None)):
        p.error("the draft must be an EAGLE-3 draft (make_tree_drafter)")
    rows = load_prompts(args.dataset, "test", n=args.num_prompts + 1, max_source_chars=args.max_source_chars)
    prompts = [tokenizer(r["prompt"], return_tensors="pt").input_ids for r in rows]
    if args.twin is None:
        cached_step = measure_cached_step(target, prompts[0])
    runtime = offload_experts(target, device="cpu", cache_fraction=args.cache_fraction)
    if args.twin is not None:
        from specfit_hf.twin import TwinTimeline, get_twin

        TwinTimeline(get_twin(args.twin), target, draft).attach()
        clock_name = f"modeled GPU timeline of {args.twin}"
    else:
        runtime.link = link_for_regime(args.link, runtime, cached_step, virtual=True)
        clock_name = f"this CPU + emulated {args.link} link"
    base, table = measure(target, draft, prompts[1:], alphas, args.depths, args.max_new_tokens)

    print(f"\n{args.dataset}, cache {args.cache_fraction:.0%}, {args.num_prompts} prompts, {args.max_new_tokens} new "
          f"tokens, clock: {clock_name}; plain decoding {base:.2f} tok/s")
    print("decode tok/s x plain decoding (after the first 24 tokens), tokens per cycle\n")
    print("| alpha | " + " | ".join(f"chain d{d}" for d in args.depths) + " |")
    print("|---|" + "---|" * len(args.depths))
    for alpha, text in zip(alphas, args.alphas):
        cells = [f"{table[(alpha, d)][0]:.2f}x ({table[(alpha, d)][1]:.2f}x), {table[(alpha, d)][2]:.2f}"
                 for d in args.depths]
        print(f"| {text} | " + " | ".join(cells) + " |")
    return table


if __name__ == "__main__":
    main()
