"""SpecFit vs EAGLE-3 vs autoregressive with real host→device expert transfers (CUDA hosts).

    python examples/bench_gpu.py                      # Qwen3-30B-A3B-shaped target, 12 layers, bf16
    python examples/bench_gpu.py --layers 48 --prompts 4
    python examples/bench_gpu.py --model PATH --draft PATH   # real weights when you have them

Without ``--model`` it builds a target with Qwen3-30B-A3B's MoE shapes (hidden 2048,
expert intermediate 768, 128 experts, top-8; ``--layers`` of them, 48 in the real model)
with random bf16 weights, and an EAGLE-3 draft with random weights.  Random weights make
acceptance meaningless (the draft is almost never right), so such a run measures the
cost side only: expert traffic over the real PCIe / NVLink-C2C link, verification cost of
the trees each policy picks, and the selection overhead.  Experts stay in pinned host
memory; the device cache holds ``--cache-fractions`` of them.  Sized to finish in under
8 minutes on one H100/H200 with the defaults.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def build_random_pair(layers: int, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from specfit_hf.eagle3 import Eagle3Config, Eagle3DraftModel

    cfg = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
    )
    with torch.device("cpu"):
        target = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    dcfg = Eagle3Config(
        hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=32000, draft_vocab_size=8000, target_hidden_size=2048,
    )
    draft = Eagle3DraftModel(dcfg).to(dtype).eval()
    return target, draft


def measure_pinning(target) -> dict:
    """Offload ``target`` to CUDA once and compare the page-locked host bytes with the expert
    bytes and with what ``specfit_hf.offload.pinning.pinning_plan`` computed on the CPU."""
    from specfit_hf.offload import offload_experts
    from specfit_hf.offload.pinning import pinning_plan

    plan = pinning_plan(target)
    if not torch.cuda.is_available():  # the computed side only
        return {"expert_bytes": plan.expert_bytes, "planned_pinned_bytes": plan.pinned_bytes}
    runtime = offload_experts(target, device="cuda", slots_per_layer=max(8, target.config.num_experts_per_tok))
    try:
        measured = {
            "expert_bytes": runtime.expert_host_bytes,
            "pinned_bytes": runtime.pinned_bytes,
            "pinned_per_expert_byte": runtime.pinned_bytes / runtime.expert_host_bytes,
            "planned_pinned_bytes": plan.pinned_bytes,
            "pin_memory_would_pin_bytes": plan.pin_memory_bytes,
            "copied_tensors": runtime._pinner.copies,
        }
    finally:
        runtime.detach()
    print("host pinning: " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in measured.items()))
    return measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--cache-fractions", nargs="+", type=float, default=[0.25, 0.5])
    ap.add_argument("--out", default="runs/bench_gpu")
    ap.add_argument("--policies", nargs="+", default=None,
                    help="columns to run (as `specfit bench --policies`; default: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights' dtype (float32: greedy identity without bf16 batch-shape rounding)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device; on a CPU host use `specfit bench` (emulated link).", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    from specfit_hf.bench import expand_policies, run_benchmark, write_report
    from specfit_hf.cli import load_pair
    from specfit_hf.data import default_model_paths, load_prompts

    started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    policies = expand_policies(args.policies) if args.policies else None
    if args.model:
        target, draft, tok = load_pair(args.model, args.draft, "cpu")
        target = target.to(dtype)
        draft = draft.to(dtype)
    else:
        target, draft = build_random_pair(args.layers, dtype)
        tok = AutoTokenizer.from_pretrained(default_model_paths().target)  # any tokenizer: ids < 32000
    pinning = measure_pinning(target)  # pinned bytes per expert byte (expect ~1.0, was ~1.33)
    # Non-expert weights go to the GPU through offload_experts; experts stay in pinned host memory.
    draft = draft.to("cuda")
    prompts, tune = {}, {}
    for name in ("cnn_dailymail", "gsm8k"):
        rows = load_prompts(name, "test", n=args.prompts + 1, max_source_chars=1200)
        prompts[rows[0]["category"]] = [r["prompt"] for r in rows[: args.prompts]]
        tune[rows[0]["category"]] = [r["prompt"] for r in rows[args.prompts:]]
    results = run_benchmark(
        target, draft, tok, prompts, cache_fractions=args.cache_fractions, device="cuda",
        max_new_tokens=args.max_new_tokens, tune_prompts=tune, tune_candidates=(8, 16, 32, 60), policies=policies,
    )
    results["meta"]["gpu"] = torch.cuda.get_device_name()
    results["meta"]["random_weights"] = args.model is None
    results["meta"]["dtype"] = args.dtype
    results["meta"]["host_pinning"] = pinning
    paths = write_report(results, args.out)
    print(paths["markdown"].read_text())
    print(f"done in {time.perf_counter() - started:.0f} s; wrote {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
