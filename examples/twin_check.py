"""Check a device twin against measurements: measured vs modeled forward, draft and copy times, with the MAPE.

    python examples/twin_check.py --twin qwen3-30b-a3b@rtx4090-pcie4          # on a CUDA host
    python examples/twin_check.py --device cpu                                # reduced form (CI)

On a CUDA host it builds a random bf16 model with the twin's real shapes (hidden size, heads,
experts, top-k, expert size, vocabulary) and as many decoder layers as fit (``--layers``),
puts it behind this project's offload runtime with every expert resident, and measures

* target forwards over 1..64 query tokens after ``--past`` cached tokens, with random and
  repeated tokens (different numbers of *distinct* experts per layer, read from the runtime);
* EAGLE-3 draft levels (the public draft's layer and lm_head) over 1..64 nodes;
* SpecFit's expert heads on the draft (one linear per MoE layer and a top-k, ids copied to the host) over
  1..64 nodes;
* host->device copies of 1..16 experts from pinned memory (copy engine, side stream);

and prints each beside the twin's modeled time (:mod:`specfit_hf.twin`, the same model of a
``layers``-layer model), the MAPE per kind, the **fitted host overhead per kernel launch**
(``SECONDS_PER_LAUNCH`` came from this script's first GPU run, an H200 on 2026-12-04), the MAPE
again with that fit (spec-sheet device, then measured device), and the kernels a 1-token
forward launches (torch.profiler), with and without the offload runtime.  ``--device-spec`` /
``--link-spec`` model the GPU and link this runs on where no twin has them (``h200``, ``pcie5``);
``--json`` writes every row.  ``scripts/gpu_check.sh`` runs it with the other GPU checks.

On a CPU (``--device cpu``) it runs a reduced form: dimensions divided by ``--reduce``,
fp32, and the "device" is this CPU as measured here (memory bandwidth from a large reduction,
throughput from a matmul, per-op overhead from a loop of tiny ops, memcpy as the link).  The
MAPE then says how well a roofline + per-launch model fits this host, not a GPU; it is
reported, never asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specfit_hf.twin import (  # noqa: E402
    DEVICES,
    LINKS,
    DeviceSpec,
    LinkSpec,
    Twin,
    distinct_experts,
    effective_tokens,
    get_twin,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_host_device(device: torch.device, dtype: torch.dtype) -> tuple[DeviceSpec, LinkSpec, float]:
    """This device's bandwidth, matmul throughput, per-op overhead and host->device copy rate (measured)."""
    big = device.type == "cuda"  # large enough that a GPU's launch latency does not dominate
    n = (512 if big else 64) * 2**20 * 8 // torch.finfo(dtype).bits
    x = torch.randn(n, device=device, dtype=dtype)
    bw = x.numel() * x.element_size() / _time(lambda: x.sum(), device, 5) / 1e9
    side = 8192 if big else 1024
    a = torch.randn(side, side, device=device, dtype=dtype)
    tflops = 2 * side**3 / _time(lambda: a @ a, device, 5) / 1e12
    s = torch.ones(1, device=device, dtype=dtype)

    def many() -> None:
        for _ in range(200):
            torch.add(s, s)

    per_op = _time(many, device, 5) / 200
    host = torch.randn((256 if big else 8) * 2**20 // 4, dtype=torch.float32, pin_memory=big)
    dst = torch.empty_like(host, device=device)
    link = host.numel() * 4 / _time(lambda: dst.copy_(host, non_blocking=True), device, 5) / 1e9
    return (
        DeviceSpec(f"{device.type} (measured)", bw, tflops, "measured by examples/twin_check.py"),
        LinkSpec("measured copy", link, 0.0, "measured by examples/twin_check.py"),
        per_op,
    )


def build(twin: Twin, layers: int, reduce: int, device: torch.device, dtype: torch.dtype):
    """A random target (Qwen3-MoE or Mixtral layout) and EAGLE-3 draft with the twin's shapes / ``reduce``."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from specfit_hf.eagle3 import Eagle3DraftModel
    from specfit_hf.eagle3.config import Eagle3Config

    m = twin.model
    r = max(1, reduce)
    hidden, inter, vocab = m.hidden // r, max(8, m.moe_intermediate // r), max(256, m.vocab // r)
    heads, kv, head_dim = max(2, m.heads // r), max(1, m.kv_heads // r), m.head_dim if r == 1 else max(16, m.head_dim // 4)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=head_dim, num_experts_per_tok=m.top_k,
                  max_position_embeddings=4096, attn_implementation="eager")
    if "mixtral" in m.name.lower():
        cls, cfg = MixtralForCausalLM, MixtralConfig(intermediate_size=inter, num_local_experts=m.experts, **common)
    else:
        cls, cfg = Qwen3MoeForCausalLM, Qwen3MoeConfig(intermediate_size=inter, moe_intermediate_size=inter,
                                                       num_experts=m.experts, tie_word_embeddings=False, **common)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in place: a full-size fp32 copy on the host would not fit
    try:
        with torch.device(device):
            target = cls(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    d = m.draft
    dcfg = Eagle3Config(vocab_size=vocab, draft_vocab_size=min(vocab, max(64, d.draft_vocab // r)), hidden_size=hidden,
                        intermediate_size=max(8, d.intermediate // r), num_attention_heads=heads,
                        num_key_value_heads=kv, head_dim=head_dim, target_hidden_size=hidden,
                        max_position_embeddings=4096,
                        expert_predictor={"moe_layers": list(range(layers)), "num_experts": m.experts,
                                          "top_k": m.top_k})
    draft = Eagle3DraftModel(dcfg).to(device=device, dtype=dtype).eval()
    spec_model = replace(m, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim,
                         moe_intermediate=inter, vocab=vocab, bytes_per_param=torch.finfo(dtype).bits // 8,
                         draft=replace(d, hidden=hidden, heads=heads, kv_heads=kv, head_dim=head_dim,
                                       intermediate=dcfg.intermediate_size, draft_vocab=dcfg.draft_vocab_size))
    return target, draft, spec_model


def count_kernel_launches(fn: Callable[[], object], device: torch.device) -> int | None:
    """Kernels one call of ``fn`` launches on a CUDA device (torch.profiler), or None where it cannot count."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:  # noqa: BLE001 - a profiler that does not work here only loses this figure
        print(f"(kernel count unavailable: {exc})")
        return None


def _mape(rows: list[tuple[str, str, float, Callable[[Twin], float]]], twin: Twin) -> dict[str, float]:
    errors: dict[str, list[float]] = {}
    for kind, _, measured, model in rows:
        errors.setdefault(kind, []).append(abs(model(twin) - measured) / measured)
    mape = {k: 100 * statistics.fmean(v) for k, v in errors.items()}
    mape["all"] = 100 * statistics.fmean(e for v in errors.values() for e in v)
    return mape


def _fit_launch(twin: Twin, measured_n1: list[tuple[float, Callable[[Twin], float]]], launches: int) -> float:
    """Host seconds per launch that make the 1-token forwards' roofline + launches match the measurement."""
    no_host = replace(twin, seconds_per_launch=0.0)
    return statistics.fmean((m - model(no_host)) / launches for m, model in measured_n1)


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict[str, float]:
    """Measure and model; print the table; returns MAPE per kind (and ``all``)."""
    from transformers import DynamicCache

    from specfit_hf.offload import offload_experts

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    twin = get_twin(args.twin)
    if args.device_spec:  # the GPU this runs on, when no twin has it (e.g. a lent H200)
        twin = replace(twin, device=DEVICES[args.device_spec])
    if args.link_spec:
        twin = replace(twin, link=LINKS[args.link_spec])
    reduce = args.reduce if args.reduce is not None else (1 if device.type == "cuda" else 16)
    dev_spec, link_spec, per_op = measure_host_device(device, dtype)
    if device.type == "cuda":
        # the model's weights plus the runtime's expert slots (cache 100 %) must fit, with headroom
        per_layer = twin.model.experts * twin.model.expert_bytes + twin.model.nonexpert_bytes / twin.model.layers
        free = torch.cuda.mem_get_info(device)[0]
        layers = args.layers or max(1, min(twin.model.layers, int(0.8 * free / (2.2 * per_layer))))
        model_twin = twin  # the spec-sheet device and link are what is checked
    else:
        layers = args.layers or 2
        model_twin = replace(twin, device=dev_spec, link=link_spec, seconds_per_launch=per_op)
    target, draft, spec_model = build(twin, layers, reduce, device, dtype)
    model_twin = replace(model_twin, model=spec_model)
    print(f"twin {twin.name}: model {spec_model.name} with {layers} layer(s), hidden {spec_model.hidden}, "
          f"{spec_model.experts} experts top-{spec_model.top_k}, expert {spec_model.expert_bytes / 1e6:.2f} MB, "
          f"{dtype}, on {device} (reduce {reduce})")
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}")
    print(f"device modeled: {model_twin.device.name} {model_twin.device.memory_gbps:.0f} GB/s, "
          f"{model_twin.device.bf16_tflops:.3g} TFLOPS, {model_twin.seconds_per_launch * 1e6:.2f} us/launch, link "
          f"{model_twin.link.name} {model_twin.link.gbps:.1f} GB/s; measured here: {dev_spec.memory_gbps:.0f} GB/s, "
          f"{dev_spec.bf16_tflops:.3g} TFLOPS, {per_op * 1e6:.2f} us/op, copy {link_spec.gbps:.1f} GB/s")
    rows: list[tuple[str, str, float, Callable[[Twin], float]]] = []
    gen = torch.Generator().manual_seed(0)
    vocab = spec_model.vocab
    past_ids = torch.randint(0, vocab, (1, args.past), generator=gen).to(device)
    fixed_launches = model_twin.launches_per_forward + layers * model_twin.launches_per_target_layer
    launches: dict[str, int | None] = {}

    def forward_step(ids: torch.Tensor) -> Callable[[], None]:
        cache = DynamicCache(config=target.config)
        target(input_ids=past_ids, past_key_values=cache, use_cache=True)
        n = ids.shape[1]

        def step() -> None:
            target(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.crop(-n)  # drop this forward's keys: the next call sees the same past

        return step

    # transformers' own forward (experts resident in the model, no offload runtime): its host overhead alone
    for n in args.bare_tokens if device.type == "cuda" else []:
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        step = forward_step(ids)
        if n == 1:
            launches["target, transformers alone"] = count_kernel_launches(step, device)
        measured = _time(step, device, args.repeats)
        rows.append(("bare target", f"n={n:<3d} random, no offload runtime", measured,
                     lambda t, n=n: t.target_forward_seconds(n, args.past, distinct_experts(n, spec_model.experts,
                                                                                            spec_model.top_k))))
    runtime = offload_experts(target, device=device, cache_fraction=1.0)
    measured_n1: list[tuple[float, Callable[[Twin], float]]] = []
    for n in args.tokens:
        for kind in ("random", "repeated"):
            ids = (torch.randint(0, vocab, (1, n), generator=gen) if kind == "random"
                   else torch.full((1, n), int(torch.randint(0, vocab, (1,), generator=gen)))).to(device)
            step = forward_step(ids)
            if n == 1 and kind == "random":
                launches["target, offload runtime"] = count_kernel_launches(step, device)
            measured = _time(step, device, args.repeats)
            d_real = []
            for layer in runtime.moe_layers:
                d = len(torch.unique(runtime.last_routing(layer)))
                d_real.append(distinct_experts(effective_tokens(d, runtime.num_experts, runtime.top_k, n),
                                               spec_model.experts, spec_model.top_k))
            distinct = statistics.fmean(d_real)

            def model(t: Twin, n: int = n, distinct: float = distinct) -> float:
                return t.target_forward_seconds(n, args.past, distinct)

            rows.append(("target", f"n={n:<3d} {kind:<8s} distinct/layer {distinct:5.1f}", measured, model))
            if n == 1 and kind == "random":
                measured_n1.append((measured, model))
    hidden = torch.randn(1, max(args.draft_nodes), spec_model.hidden, generator=gen).to(device, dtype)
    for t in args.draft_nodes:
        ids = torch.randint(0, vocab, (1, t), generator=gen).to(device)
        measured = _time(lambda: draft(ids, hidden_states=hidden[:, :t]), device, args.repeats)
        rows.append(("draft level", f"nodes={t}", measured,
                     lambda tw, t=t: tw.draft_level_seconds(t, 0)
                     + tw.draft_matmul_seconds(spec_model.draft.lm_head_params, t)))
    for t in args.draft_nodes:  # SpecFit's expert heads on the draft state (one linear per MoE layer, top-k)
        rows_t = hidden[0, :t]
        measured = _time(lambda: draft.predict_experts(rows_t).cpu(), device, args.repeats)
        rows.append(("expert heads", f"nodes={t}", measured, lambda tw, t=t: tw.expert_heads_seconds(t)))
    layer = runtime.moe_layers[0]
    host = {name: w for name, w in runtime._layer(layer).host.items()}  # noqa: SLF001 - the real host copies
    slots = {name: w for name, w in runtime._layer(layer).slots.items()}  # noqa: SLF001
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    expert_bytes = runtime.expert_bytes
    for m in args.copies:
        def copy() -> None:
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            with ctx:
                for e in range(m):
                    for name in host:
                        slots[name][e % slots[name].shape[0]].copy_(host[name][e % host[name].shape[0]], non_blocking=True)
            if stream is not None:
                stream.synchronize()

        measured = _time(copy, device, args.repeats)
        rows.append(("H2D copy", f"experts={m}", measured,
                     lambda t, m=m: m * (expert_bytes / (t.link.gbps * 1e9) + t.link.latency_us * 1e-6)))
    runtime.detach()

    print(f"\n{'kind':<12} {'shape':<40} {'measured ms':>12} {'modeled ms':>11} {'error':>8}")
    for kind, shape, measured, model in rows:
        modeled = model(model_twin)
        print(f"{kind:<12} {shape:<40} {measured * 1e3:>12.3f} {modeled * 1e3:>11.3f} "
              f"{(modeled - measured) / measured:>+8.0%}")
    mape = _mape(rows, model_twin)
    print("\nMAPE: " + ", ".join(f"{k} {v:.0f}%" for k, v in mape.items()))
    report: dict[str, object] = {
        "twin": model_twin.meta(), "layers": layers, "reduce": reduce, "dtype": str(dtype), "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__,
        "measured_device": {"memory_gbps": dev_spec.memory_gbps, "bf16_tflops": dev_spec.bf16_tflops,
                            "seconds_per_op": per_op, "copy_gbps": link_spec.gbps},
        "rows": [{"kind": k, "shape": sh, "measured_s": me, "modeled_s": mo(model_twin)} for k, sh, me, mo in rows],
        "mape": mape, "kernel_launches": launches, "assumed_launches_per_forward": fixed_launches,
    }
    if measured_n1:
        fitted = _fit_launch(model_twin, measured_n1, fixed_launches)
        print(f"fitted host overhead per launch (1-token forward minus modeled roofline, over {fixed_launches} launches): "
              f"{fitted * 1e6:.2f} us (the twin assumes {twin.seconds_per_launch * 1e6:.2f} us); per layer "
              f"{fitted * fixed_launches / layers * 1e6:.0f} us")
        report["fitted_seconds_per_launch"] = fitted
        if device.type == "cuda":
            refit = replace(model_twin, seconds_per_launch=fitted)
            measured_dev = replace(model_twin, device=dev_spec, link=link_spec)
            measured_dev = replace(measured_dev, seconds_per_launch=_fit_launch(measured_dev, measured_n1,
                                                                                 fixed_launches))
            variants = {"spec sheet + fitted launch": refit, "measured device + fitted launch": measured_dev}
            report["mape_variants"] = {}
            for label, variant in variants.items():
                m = _mape(rows, variant)
                report["mape_variants"][label] = m
                print(f"MAPE with {label}: " + ", ".join(f"{k} {v:.0f}%" for k, v in m.items()))
    for label, count in launches.items():
        if count is not None:
            print(f"kernels launched by a 1-token forward ({label}): {count} "
                  f"({count / layers:.1f} per layer; the twin assumes {fixed_launches} = "
                  f"{model_twin.launches_per_forward} + {model_twin.launches_per_target_layer} per layer)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    return mape


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--twin", default="qwen3-30b-a3b@rtx4090-pcie4")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu (reduced form)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: as many as fit; CPU 2)")
    parser.add_argument("--reduce", type=int, default=None, help="divide dimensions by this (default CUDA 1, CPU 16)")
    parser.add_argument("--past", type=int, default=128, help="cached tokens before each measured forward")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--draft-nodes", type=int, nargs="+", default=[1, 4, 10, 32, 64])
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bare-tokens", type=int, nargs="+", default=[1, 8, 64],
                        help="CUDA: also time transformers' own forward (no offload runtime) over these token counts")
    parser.add_argument("--device-spec", default=None, choices=sorted(DEVICES),
                        help="model this GPU's spec sheet instead of the twin's (e.g. h200 on a lent H200)")
    parser.add_argument("--link-spec", default=None, choices=sorted(LINKS), help="likewise for the host link")
    parser.add_argument("--json", default=None, help="also write the rows, MAPEs and fits to this JSON file")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
