#!/usr/bin/env python
"""Autoregressive decode speed of a tiny Qwen3-MoE with offloaded experts over an emulated link.

Prints tokens/s of sampled ``model.generate`` (seeded, same tokens in every row) with no offloading, with offloading and a
100 % expert cache on an instant link (the runtime's own overhead), and with 25 / 50 /
100 % of each layer's experts cached behind an emulated PCIe link, with hit rates.

This is **emulation** on a CPU: "device" and "host" are both host memory, and
``specfit_hf.offload.EmulatedLink`` makes each expert copy last ``bytes / bandwidth +
latency`` (real copy, then an accurate wait).  The figures say how the transfer/compute
*ratio* plays out, not what a GPU would measure.

Link regime (default ``--regime qwen3-pcie4``, see ``specfit_hf/regimes.py``; numbers from
``shared/docs/reference-facts.md``).  A tiny model copying at a real 25 GB/s would make
misses nearly free, so we keep the ratio that decides throughput instead:

    rho = (transfer of one token's experts for all MoE layers, nothing cached)
          / (one decode step with every expert resident)

For Qwen3-30B-A3B on an RTX 4090-class GPU over PCIe 4.0 x16: one token's experts are
3.62 GB (48 layers x top-8 x 9.44 MB), 145 ms at the measured 25 GB/s; a cached step reads
the 3.3 B active parameters (6.6 GB bf16) at ~1.0 TB/s plus 30 % for attention, norms and
launches = 8.6 ms; rho = 145 / 8.6 = ~17.  Here we measure the tiny model's cached decode
step ``t_step`` (no offloading) and set the emulated bandwidth so that one token's experts
(``top_k x MoE layers x expert_bytes``) take ``rho x t_step``; the per-transfer latency keeps
the share it has for a real expert (10 us of 0.38 ms).  Matching this whole-token ratio
rather than the per-expert ratio (0.38 ms vs 8.6 ms) keeps "cost of a miss relative to a
step" right although the tiny model has 6 x 4 routed experts per token instead of 48 x 8.
``--gbps`` / ``--latency-us`` override the derived link.

    .venv/bin/python examples/bench_offload.py                  # ~1-2 min on 2 busy cores
    .venv/bin/python examples/bench_offload.py --gbps 0.05 --latency-us 20

Each offloaded row first warms its cache with a generate on another prompt, then measures
(steady-state hit rates).  The model is random-initialised and sampled tokens are close to
random, so routing has little locality: hit rates are a pessimistic bound for real text; ``--model DIR`` loads a local
Qwen3-MoE checkpoint instead.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, Qwen3MoeConfig

from specfit_hf.offload import EmulatedLink, offload_experts
from specfit_hf.regimes import REGIMES, emulated_link_params


class StepClock(LogitsProcessor):
    """Records the time each token is chosen and the runtime's counters after the prefill."""

    def __init__(self, runtime=None) -> None:
        self.runtime = runtime
        self.times: list[float] = []
        self.after_prefill = None

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self.runtime is not None:
            self.after_prefill = self.runtime.stats.total.copy()
        return scores


def build_model(args) -> torch.nn.Module:
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
        if model.config.model_type != "qwen3_moe":
            raise SystemExit(f"--model must be a Qwen3-MoE checkpoint, got {model.config.model_type}")
    else:
        torch.manual_seed(args.seed)
        config = Qwen3MoeConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            head_dim=args.hidden // 4, moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
            num_experts_per_tok=args.top_k, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
            max_position_embeddings=1024, eos_token_id=None, pad_token_id=None, bos_token_id=None,
        )
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def decode_run(model, prompt, new_tokens: int, runtime=None, seed: int = 0) -> dict:
    """One sampled generate; decode tokens/s from the gaps between emitted tokens.

    Sampling (seeded: every setting decodes the same tokens, offloading being exact) rather
    than greedy: a random model's greedy output falls into a loop of one token, which would
    make every expert cache look perfect.
    """
    clock = StepClock(runtime)
    torch.manual_seed(seed)
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, top_k=0,
                   top_p=1.0, temperature=1.0, logits_processor=LogitsProcessorList([clock]))
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    result = {"tok_s": len(gaps) / sum(gaps), "step_s": statistics.median(gaps)}
    if runtime is not None:
        decode = runtime.stats.total - clock.after_prefill
        result.update(hit_rate=decode.hit_rate, misses_per_tok=decode.misses / len(gaps),
                      link_share=decode.transfer_seconds / sum(gaps))
    return result


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local Qwen3-MoE checkpoint dir (default: random tiny model)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=80)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3, help="runs per row; the median is printed")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--policy", choices=["lru", "lfu"], default="lru")
    p.add_argument("--regime", choices=sorted(REGIMES), default="qwen3-pcie4")
    p.add_argument("--gbps", type=float, default=None, help="emulated link bandwidth, GB/s (overrides the regime)")
    p.add_argument("--latency-us", type=float, default=None, help="emulated per-transfer latency (overrides)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    warnings.filterwarnings("ignore", message=".*eos_token_id.*")
    torch.set_num_threads(args.threads)

    model = build_model(args)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=gen)
    warm_prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=gen)
    top_k, num_layers = model.config.num_experts_per_tok, model.config.num_hidden_layers

    with torch.no_grad():
        decode_run(model, prompt, 4)  # warm-up
    base = median_of([decode_run(model, prompt, args.new_tokens) for _ in range(args.repeats)])

    probe = offload_experts(model, device="cpu", cache_fraction=1.0)
    expert_bytes, num_moe = probe.expert_bytes, len(probe.moe_layers)
    decode_run(model, warm_prompt, args.new_tokens // 2, probe, seed=args.seed + 1)
    instant = median_of([decode_run(model, prompt, args.new_tokens, probe) for _ in range(args.repeats)])
    probe.detach()

    regime = REGIMES[args.regime]
    gbps, latency_us = emulated_link_params(regime, expert_bytes=expert_bytes, experts_per_token=top_k * num_moe,
                                            cached_step_seconds=base["step_s"])
    gbps = args.gbps if args.gbps is not None else gbps
    latency_us = args.latency_us if args.latency_us is not None else latency_us
    link = EmulatedLink(gbps=gbps, latency_us=latency_us)

    rows = []
    for fraction in tqdm(args.fractions, desc="cache fractions"):
        runs = []
        for _ in range(args.repeats):
            runtime = offload_experts(model, device="cpu", cache_fraction=fraction, policy=args.policy, link=link)
            try:
                # warm the cache on another prompt first: rows then compare steady-state hit rates
                decode_run(model, warm_prompt, args.new_tokens // 2, runtime, seed=args.seed + 1)
                runs.append(decode_run(model, prompt, args.new_tokens, runtime))
            finally:
                runtime.detach()
        rows.append((fraction, runtime.slots_per_layer, median_of(runs)))

    print()
    print(f"model: Qwen3-MoE, {num_layers} layers ({num_moe} MoE), hidden {model.config.hidden_size}, "
          f"E={model.config.num_experts}, top-{top_k}, expert {expert_bytes / 1e3:.1f} kB fp32; "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats}, "
          f"{args.threads} torch thread(s)")
    print(f"cached decode step (no offload): {base['step_s'] * 1e3:.2f} ms; regime {regime.name}: "
          f"rho = {regime.rho:.1f} -> emulated link {link.gbps * 1e3:.2f} MB/s, "
          f"latency {link.latency_us:.1f} us; one expert = {link.transfer_seconds(expert_bytes) * 1e3:.2f} ms "
          f"({'overridden' if args.gbps or args.latency_us else 'derived'})")
    print()
    header = f"{'setting':<44} {'tok/s':>7} {'vs no-offload':>13} {'hit rate':>8} {'misses/tok':>10} {'link time':>9}"
    print(header)
    print("-" * len(header))
    print(f"{'no offload':<44} {base['tok_s']:>7.1f} {1.0:>12.2f}x {'-':>8} {'-':>10} {'-':>9}")
    print(f"{'offload, 100% cache, instant link':<44} {instant['tok_s']:>7.1f} "
          f"{instant['tok_s'] / base['tok_s']:>12.2f}x {instant['hit_rate']:>8.3f} "
          f"{instant['misses_per_tok']:>10.2f} {instant['link_share']:>8.1%}")
    for fraction, slots, r in rows:
        name = f"offload, {fraction:.0%} cache ({slots} slots), emulated link"
        print(f"{name:<44} {r['tok_s']:>7.1f} {r['tok_s'] / base['tok_s']:>12.2f}x {r['hit_rate']:>8.3f} "
              f"{r['misses_per_tok']:>10.2f} {r['link_share']:>8.1%}")


if __name__ == "__main__":
    main()
