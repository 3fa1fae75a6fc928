"""Recall / precision of the expert predictors on a tiny offloaded MoE target.

Trains a tiny EAGLE-3 draft *with expert heads* on text the tiny random target samples
itself (a few hundred steps on CPU), then generates with the ``specfit`` policy while
scoring every predictor on every verified block: the predicted per-layer union of
experts of ``[root] + verified nodes`` against the union the target actually routed.

    python examples/measure_expert_predictors.py              # ~ a few minutes on 2 cores
    python examples/measure_expert_predictors.py --steps 600 --prompts 6
    python examples/measure_expert_predictors.py --target model_cards/specfit-tiny-qwen3moe   # trained target,
        # GSM8K prompts, a noisy copy of the target as draft: training-free predictors only

Predictors: ``router`` (the target's routers on the draft hidden state), ``history``
(per-token routing learned online), ``history+router`` (history, router for unseen
tokens), ``heads`` (the draft's learned heads).  Mechanics on a random tiny target:
figures on a trained pair will differ.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from specfit_hf import EmulatedLink, offload_experts
from specfit_hf.eagle3 import Eagle3DraftModel
from specfit_hf.eagle3.train import TrainConfig, train_eagle3
from specfit_hf.generation import SpecFitConfig
from specfit_hf.selection import MeasuredSpecFitPolicy, register_policy
from specfit_hf.testing import tiny_target

_CAPTURED: list[MeasuredSpecFitPolicy] = []


@register_policy("specfit-measure")
class _Captured(MeasuredSpecFitPolicy):
    """The specfit policy, kept so its online figures can be printed."""

    def __init__(self, config):
        super().__init__(config)
        _CAPTURED.append(self)


def sample_blocks(target, num: int, length: int, seed: int) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(0, vocab, (num, 4), generator=g)
    torch.manual_seed(seed)
    out = target.generate(prompts, do_sample=True, max_new_tokens=length - 4, min_new_tokens=length - 4,
                          pad_token_id=0, top_k=0)
    return out[:, :length]


def _report(totals: dict, policy_label: str = "policy") -> None:
    print(f"\n{'predictor':<16} {'recall':>7} {'precision':>9}   (per-layer union over verified blocks, micro-avg)")
    for name, (hit, pred, actual) in totals.items():
        if actual:
            label = policy_label if name == "policy" else name
            print(f"{label:<16} {hit / actual:>7.3f} {hit / pred if pred else float('nan'):>9.3f}")


def _measure_prompt(target, draft, prompt, new_tokens: int, index: int, predictor: str, names: list,
                    totals: dict) -> None:
    """Generate with ``predictor`` driving specfit, check it is lossless, add each predictor's union counts."""
    ref = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    gc = SpecFitConfig(max_new_tokens=new_tokens, do_sample=False, max_depth=4, tree_top_k=4,
                       policy="specfit-measure", return_dict_in_generate=True,
                       policy_kwargs={"adaptive_drafting": False, "expert_predictor": predictor,
                                      "measure_predictors": names})
    out = target.generate(prompt, assistant_model=draft, generation_config=gc)
    assert torch.equal(out.sequences, ref), "specfit changed the greedy output"
    tau = (out.sequences.shape[1] - prompt.shape[1]) / len(out.cycles)
    print(f"prompt {index}: tau {tau:.2f}, verified/cycle {sum(c.nodes_verified for c in out.cycles) / len(out.cycles):.2f}")
    quality = _CAPTURED[-1].quality
    for name, counts in totals.items():
        q = quality[name]
        counts[0] += q.hit
        counts[1] += q.predicted
        counts[2] += q.actual


def measure_trained_target(args) -> None:
    """Training-free predictors on a trained target, GSM8K prompts, a noisy-copy draft."""
    import copy

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfit_hf.data import load_prompts

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.target)
    torch.manual_seed(args.seed)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(args.draft_noise * p.std() * torch.randn_like(p))
    num_experts = int(getattr(target.config, "num_experts", None) or target.config.num_local_experts)
    runtime = offload_experts(target, device="cpu", slots_per_layer=max(args.slots, num_experts // 4),
                              link=EmulatedLink(gbps=1.0))
    names = ["router", "history", "history+router"]
    totals = {name: [0, 0, 0] for name in names}
    for i, row in enumerate(load_prompts("gsm8k", n=args.prompts)):
        ids = tok(row["prompt"], return_tensors="pt").input_ids
        _measure_prompt(target, draft, ids, args.new_tokens, i, "history+router", names, totals)
    _report(totals)
    runtime.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=4, help="device slots per layer (of 8 experts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default=None, help="a trained target folder: measure the training-free predictors on it")
    ap.add_argument("--draft-noise", type=float, default=0.1)
    ap.add_argument("--save", default=None, help="also save the trained draft here (for bench_selection.py --e2e --eagle3-draft)")
    args = ap.parse_args()

    if args.target:
        measure_trained_target(args)
        return
    target = tiny_target(seed=args.seed, num_layers=4)
    blocks = sample_blocks(target, args.blocks, args.seq_len, args.seed)
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = TrainConfig(target="tiny", data=[], out=out_dir, steps=args.steps, seq_len=args.seq_len, batch_size=8,
                          ttt_steps=3, draft_vocab=target.config.vocab_size, expert_heads=True, lr=3e-3,
                          warmup_steps=20, save_every=10**9, log_every=10**9)
        summary = train_eagle3(cfg, target=target, blocks=blocks, progress=True)
        draft = Eagle3DraftModel.from_pretrained(out_dir, dtype=torch.float32).eval()
    if args.save:
        draft.save_pretrained(args.save)
    print("training summary:", {k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
    draft.attach_target_embeddings(target)

    runtime = offload_experts(target, device="cpu", slots_per_layer=args.slots, link=EmulatedLink(gbps=1.0))
    names = ["router", "history", "history+router", "heads"]
    totals = {name: [0, 0, 0] for name in ["policy", *names]}
    for i in range(args.prompts):
        prompt = blocks[i % blocks.shape[0], :6][None]
        _measure_prompt(target, draft, prompt, args.new_tokens, i, "heads", names, totals)
    _report(totals, policy_label="heads (policy)")
    runtime.detach()


if __name__ == "__main__":
    main()
