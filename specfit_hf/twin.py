"""Device twins: a modeled GPU timeline so CPU benchmarks predict what GPU users get.

A **twin** is a real model's sizes (:class:`ModelSpec`, with its public EAGLE-3 draft) plus a
real device's figures (:class:`DeviceSpec`) and host link (:class:`LinkSpec`), every
constant with its public source.  While a :class:`TwinTimeline` is attached, the package's
clock (:mod:`specfit_hf.clock`) charges the twin's time, in place of this CPU's time, for

* every **target forward**: ``max(bytes / bandwidth, FLOPs / throughput) + host overhead``,
  where bytes = non-expert weights + each *distinct* expert the forward computes + the KV
  it reads, FLOPs = 2 x active parameters x tokens + attention, host overhead = kernel
  launches x seconds per launch (zero for the ``+graphs`` variants);
* every **draft forward** (an EAGLE-3 level: ``midlayer``, or the tree drafter's whole
  ``draft_forward`` with its embedding, rotary rows and next hidden state; its ``lm_head``, with
  the children's log-softmax and top-k after it in ``top_children`` (2 more launches); the feature
  projection ``fc``; its expert heads, when it has them), by the same roofline on the public
  draft's sizes (the heads: one linear per real MoE layer, draft hidden -> experts);
* every **expert transfer**: bytes over the link plus its latency.

Host-side Python (policy, search, bookkeeping, ``generate``'s own loop) stays real measured
time: a GPU host pays it too.  Tokens are still computed for real on the CPU (greedy
identical, sampling exact); only the clock is modeled.

**Scaling from tiny-model events to real ones** (:data:`SCALING`):

* a tiny target forward over ``n`` query tokens with ``past`` cached tokens stands for a real
  forward over the same ``n`` and ``past`` (non-expert weights and KV of all ``L_real``
  layers);
* the tiny layer's *distinct* expert count ``d_tiny`` (of ``E_tiny``, top ``k_tiny``) is
  turned into an effective number of independently routed tokens ``n_eff`` (inverting
  ``d = E (1 - (1 - k/E)^n_eff)``, capped at ``n``), and the real layer computes
  ``d_real = E_real (1 - (1 - k_real/E_real)^n_eff)`` distinct experts: correlated routing
  (shared experts across a tree) carries over, and a 1-token step reads ``k_real`` experts;
  the mean over tiny MoE layers stands for every one of the ``L_real`` layers;
* one tiny expert miss stands for ``(L_real / L_tiny_moe) x (k_real / k_tiny)`` real expert
  transfers, so a fully uncached tiny token moves a real token's experts; the twin's link
  is an :class:`~specfit_hf.offload.EmulatedLink` (virtual) whose bandwidth/latency make one
  tiny transfer cost that many real transfers;
* a tiny draft level over ``T`` nodes stands for a real draft level over ``T`` nodes.

**Host overhead is measured** (``examples/twin_check.py`` on a lent NVIDIA H200, 2026-12-04): a
batch-1 forward of transformers' eager code is host-bound on a GPU. The kernels of a 1-token forward
were counted with torch.profiler (Qwen3-30B-A3B shapes with the offload runtime: 86 per decoder layer;
Mixtral-8x7B: 79) and the time above the roofline split over them: 22.3 us per kernel (Qwen3 23.5,
Mixtral 19.6). A draft level was fitted at 55 kernels (+2 for ``lm_head``), the expert heads at 6.
That host (a 16-vCPU Intel Xeon VM) may be slower per kernel than a desktop's CPU.
Every twin also exists as ``<name>+graphs`` with zero host overhead (a CUDA-graph bound).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from .clock import advance, clock, offset
from .features import decoder_layers
from .offload import EmulatedLink, get_runtime

__all__ = [
    "ModelSpec",
    "DraftSpec",
    "DeviceSpec",
    "LinkSpec",
    "Twin",
    "MODELS",
    "DEVICES",
    "LINKS",
    "TWINS",
    "SCALING",
    "PUBLISHED_DECODE",
    "get_twin",
    "twin_names",
    "distinct_experts",
    "effective_tokens",
    "TwinTimeline",
    "sanity_table",
]

SECONDS_PER_LAUNCH = 22.3e-6
"""Host time per kernel of a batch-1 transformers eager forward on a GPU, measured by
``examples/twin_check.py`` on a lent NVIDIA H200 (torch 2.11.0+cu130, transformers 5.23.0; 16-vCPU Xeon
VM): (forward time - roofline) / kernels counted, over Qwen3-30B-A3B (16.18 ms / 688 kernels, 8 layers)
and Mixtral-8x7B (6.16 ms / 315 kernels, 4 layers) shapes.  Until 2026-12-04 the twins assumed 3.4 us
(exllamav3 PR #380: 3.07 ms over 914 launches of a C++/CUDA engine) and 30 kernels per layer."""

HOST_OVERHEAD_SOURCE = (
    "MEASURED by examples/twin_check.py on a lent NVIDIA H200 (2026-12-04; torch 2.11.0+cu130, transformers "
    "5.23.0, 16-vCPU Intel Xeon VM): a 1-token forward is host-bound; torch.profiler counted 86 kernels per "
    "Qwen3-30B-A3B decoder layer and 79 per Mixtral-8x7B layer (with the offload runtime), and the time above the "
    "roofline is 22.3 us per kernel (Qwen3 23.5, Mixtral 19.6); a draft level fitted at 55 kernels + 2 (lm_head), "
    "the expert heads at 6. A desktop CPU may launch faster; the +graphs twins are the zero-overhead bound"
)

SCALING = {
    "target_forward": "a tiny target forward over n tokens with past cached tokens = a real forward over the "
    "same n and past (all L_real layers' non-expert weights and KV)",
    "distinct_experts": "per tiny MoE layer: n_eff = log(1 - d_tiny/E_tiny) / log(1 - k_tiny/E_tiny) (capped at n); "
    "d_real = E_real (1 - (1 - k_real/E_real)^n_eff); the mean over tiny MoE layers stands for each of L_real layers",
    "expert_miss": "one tiny expert transfer = (L_real / L_tiny_moe) x (k_real / k_tiny) real expert transfers "
    "(bytes over the link + latency each)",
    "draft_level": "a tiny EAGLE-3 level (midlayer over T nodes; in the tree drafter the whole draft_forward: "
    "embedding, rotary rows, layer, next hidden state) = the public draft's decoder layer over T nodes; its lm_head "
    "and fc calls likewise, the lm_head with the children's log-softmax and top-k (top_children: 2 more launches)",
    "expert_heads": "a call of the tiny draft's expert heads over T rows (predict_experts: the stacked heads' "
    "matmul and top-k) = the real heads over T rows: one linear per real MoE layer, draft hidden -> E_real "
    "(L_real x H_draft x E_real parameters) and its kernels; its host side (copying the ids back, bookkeeping) stays "
    "measured",
    "host_time": "everything outside target/draft forwards and transfers is this host's measured time",
}


@dataclass(frozen=True)
class DraftSpec:
    """Sizes of a model's public EAGLE-3 draft (one decoder layer over 2H inputs, fc, lm_head)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    source: str

    @property
    def layer_params(self) -> int:
        """Decoder layer: q/k/v over the 2H input (embedding ++ hidden), o, gated MLP."""
        qkv = 2 * self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def fc_params(self) -> int:
        """The projection of three target features (3H -> H)."""
        return 3 * self.hidden * self.hidden

    @property
    def lm_head_params(self) -> int:
        return self.draft_vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class ModelSpec:
    """A real MoE model's sizes (bf16 weights)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    draft: DraftSpec
    source: str
    bytes_per_param: int = 2

    @property
    def expert_bytes(self) -> int:
        """One expert's three matrices."""
        return 3 * self.hidden * self.moe_intermediate * self.bytes_per_param

    @property
    def attn_params_per_layer(self) -> int:
        return self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden

    @property
    def nonexpert_bytes(self) -> int:
        """Weights every forward reads besides experts: attention + router of each layer and the lm_head."""
        per_layer = self.attn_params_per_layer + self.hidden * self.experts
        return (self.layers * per_layer + self.vocab * self.hidden) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def expert_heads_params(self) -> int:
        """SpecFit's expert predictor on the draft: one linear head per MoE layer, draft hidden -> experts."""
        return self.layers * self.draft.hidden * self.experts

    @property
    def total_params(self) -> float:
        per_layer = self.attn_params_per_layer + self.hidden * self.experts + self.experts * self.expert_bytes // 2
        return self.layers * per_layer + 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's figures from its spec sheet (dense bf16 with FP32 accumulate, no sparsity)."""

    name: str
    memory_gbps: float
    bf16_tflops: float
    source: str


@dataclass(frozen=True)
class LinkSpec:
    """A host->device link as measured with pinned memory and the copy engine."""

    name: str
    gbps: float
    latency_us: float
    source: str


@dataclass(frozen=True)
class Twin:
    """A model on a device behind a link, with a host overhead per kernel launch.

    Attributes:
        launches_per_target_layer / launches_per_draft_layer / launches_per_forward /
            launches_per_expert_heads: kernels of transformers' eager code (target layers counted with
            torch.profiler on a GPU, the per-forward ones inside that count; draft level and expert heads
            fitted to measured times); ``seconds_per_launch`` is 0 for the ``+graphs`` variants.
    """

    name: str
    model: ModelSpec
    device: DeviceSpec
    link: LinkSpec
    seconds_per_launch: float = SECONDS_PER_LAUNCH
    launches_per_target_layer: int = 86
    launches_per_draft_layer: int = 55
    launches_per_forward: int = 0
    launches_per_expert_heads: int = 6
    host_overhead_source: str = HOST_OVERHEAD_SOURCE

    @property
    def description(self) -> str:
        return f"{self.model.name} bf16 on {self.device.name}, {self.link.name}" + (
            ", zero host overhead (CUDA-graph bound)" if self.seconds_per_launch == 0 else ""
        )

    # ------------------------------------------------------------------ roofline
    def _roofline(self, nbytes: float, flops: float, launches: float) -> float:
        return max(nbytes / (self.device.memory_gbps * 1e9), flops / (self.device.bf16_tflops * 1e12)) + (
            launches * self.seconds_per_launch
        )

    def target_forward_seconds(self, tokens: int, past: int, distinct_per_layer: float) -> float:
        """Modeled seconds of one target forward over ``tokens`` query tokens after ``past`` cached tokens.

        ``distinct_per_layer``: distinct experts each real layer computes (each read once).
        """
        m = self.model
        ctx = past + tokens
        nbytes = m.nonexpert_bytes + m.layers * distinct_per_layer * m.expert_bytes + ctx * m.kv_bytes_per_token
        dense = m.nonexpert_bytes / m.bytes_per_param
        experts = m.layers * m.top_k * m.expert_bytes / m.bytes_per_param
        attention = 4 * m.layers * m.heads * m.head_dim * ctx  # QK^T and PV per query token
        flops = tokens * (2 * (dense + experts) + attention)
        return self._roofline(nbytes, flops, self.launches_per_forward + m.layers * self.launches_per_target_layer)

    def draft_level_seconds(self, tokens: int, past: int) -> float:
        """Modeled seconds of one EAGLE-3 decoder-layer step over ``tokens`` nodes."""
        d = self.model.draft
        nbytes = d.layer_params * 2 + (past + tokens) * d.kv_bytes_per_token
        flops = tokens * (2 * d.layer_params + 4 * d.heads * d.head_dim * (past + tokens))
        return self._roofline(nbytes, flops, self.launches_per_draft_layer)

    def draft_matmul_seconds(self, params: int, tokens: int) -> float:
        """Modeled seconds of a draft head (``lm_head`` or ``fc``) over ``tokens`` rows (2 launches)."""
        return self._roofline(params * 2, 2 * params * tokens, 2)

    def draft_top_k_seconds(self, tokens: int) -> float:
        """Modeled seconds of a drafted node's children after the ``lm_head``: a float32 log-softmax over the
        draft vocabulary and a top-k (2 launches; each reads the ``tokens`` rows of logits)."""
        nbytes = 2 * tokens * self.model.draft.draft_vocab * 4
        return self._roofline(nbytes, 0.0, 2)

    def expert_heads_seconds(self, tokens: int) -> float:
        """Modeled seconds of the draft's expert heads over ``tokens`` rows (matmul, top-k, copy out)."""
        params = self.model.expert_heads_params
        return self._roofline(params * 2, 2 * params * tokens, self.launches_per_expert_heads)

    def expert_transfer_seconds(self) -> float:
        """One real expert over the link."""
        return self.model.expert_bytes / (self.link.gbps * 1e9) + self.link.latency_us * 1e-6

    def decode_step_seconds(self, context: int = 512) -> float:
        """Plain decoding, every expert resident: one token after ``context`` tokens."""
        return self.target_forward_seconds(1, context, self.model.top_k)

    def emulated_link(self, runtime: Any) -> EmulatedLink:
        """The virtual link on which one tiny expert transfer costs its scaled real transfers."""
        scale = self.miss_scale(runtime)
        seconds = scale * self.model.expert_bytes / (self.link.gbps * 1e9)
        return EmulatedLink(
            gbps=runtime.expert_bytes / seconds / 1e9, latency_us=scale * self.link.latency_us, virtual=True
        )

    def miss_scale(self, runtime: Any) -> float:
        """Real expert transfers one tiny transfer stands for: (L_real/L_tiny) x (k_real/k_tiny)."""
        return (self.model.layers / len(runtime.moe_layers)) * (self.model.top_k / runtime.top_k)

    def meta(self) -> dict[str, Any]:
        """Every constant, its source and the scaling, for results ``meta``."""
        m = self.model
        return {
            "name": self.name,
            "description": self.description,
            "model": asdict(m) | {
                "expert_bytes": m.expert_bytes,
                "nonexpert_bytes": m.nonexpert_bytes,
                "kv_bytes_per_token": m.kv_bytes_per_token,
                "total_params": m.total_params,
                "draft_layer_params": m.draft.layer_params,
                "draft_fc_params": m.draft.fc_params,
                "draft_lm_head_params": m.draft.lm_head_params,
                "draft_expert_heads_params": m.expert_heads_params,
            },
            "device": asdict(self.device),
            "link": asdict(self.link),
            "seconds_per_launch": self.seconds_per_launch,
            "launches": {
                "per_target_layer": self.launches_per_target_layer,
                "per_draft_layer": self.launches_per_draft_layer,
                "per_forward": self.launches_per_forward,
                "per_expert_heads": self.launches_per_expert_heads,
            },
            "host_overhead_source": self.host_overhead_source if self.seconds_per_launch else "zero (+graphs)",
            "scaling": dict(SCALING),
            "modeled_decode_step_s_all_resident": self.decode_step_seconds(),
            "modeled_expert_transfer_s": self.expert_transfer_seconds(),
        }


_SPECFORGE_QWEN3 = "SpecForge configs/qwen3-30B-A3B-eagle3.1.json (sgl-project/SpecForge)"
MODELS: dict[str, ModelSpec] = {
    "qwen3-30b-a3b": ModelSpec(
        name="Qwen3-30B-A3B", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8,
        moe_intermediate=768, vocab=151936,
        draft=DraftSpec(hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=12288, draft_vocab=32000,
                        source=_SPECFORGE_QWEN3),
        source="Qwen/Qwen3-30B-A3B config.json (H 2048, 48 layers, 32/4 heads x 128, 128 experts top-8, "
        "moe_intermediate 768, vocab 151936); reference-facts.md (9.44 MB per expert)",
    ),
    "mixtral-8x7b": ModelSpec(
        name="Mixtral-8x7B", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, experts=8, top_k=2,
        moe_intermediate=14336, vocab=32000,
        draft=DraftSpec(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, draft_vocab=32000,
                        source="ASSUMED: no public EAGLE-3 draft for Mixtral-8x7B found offline; SpecForge's "
                        "Llama-style EAGLE-3 layer at Mixtral's dims (H 4096, 32/8 heads, I 14336, full vocab)"),
        source="mistralai/Mixtral-8x7B-v0.1 config.json (H 4096, 32 layers, 32/8 heads x 128, 8 experts top-2, "
        "I 14336, vocab 32000); reference-facts.md (352 MB per expert)",
    ),
}

def _by_name(*items: Any) -> dict[str, Any]:
    return {x.name: x for x in items}


DEVICES: dict[str, DeviceSpec] = _by_name(
    DeviceSpec("rtx4090", 1008.0, 165.2, "NVIDIA Ada Lovelace whitepaper: 1,008 GB/s GDDR6X; 165.2 TFLOPS dense "
               "bf16 with FP32 accumulate (reference-facts.md)"),
    DeviceSpec("rtx5090", 1792.0, 209.5, "NVIDIA RTX Blackwell whitepaper: 1,792 GB/s GDDR7; ~209.5 TFLOPS dense "
               "bf16 with FP32 accumulate (reference-facts.md says ~210, check the whitepaper)"),
    DeviceSpec("h100-pcie", 2000.0, 756.0, "NVIDIA H100 PCIe datasheet: 2.0 TB/s HBM2e; 756 TFLOPS dense bf16"),
    DeviceSpec("gh200", 4000.0, 989.0, "NVIDIA GH200 datasheet: 4.0 TB/s HBM3 (96 GB); 989 TFLOPS dense bf16"),
    DeviceSpec("h200", 4800.0, 989.0, "NVIDIA H200 datasheet (SXM): 4.8 TB/s HBM3e (141 GB); 989 TFLOPS dense bf16 "
               "(1,979 with sparsity). No twin uses it: examples/twin_check.py --device-spec h200 on a lent H200"),
)

LINKS: dict[str, LinkSpec] = _by_name(
    LinkSpec("pcie4", 25.0, 10.0, "PCIe 4.0 x16 measured pinned H2D ~25 GB/s (reference-facts.md); latency "
             "10 us per copy assumed (as specfit_hf.regimes)"),
    LinkSpec("pcie5", 55.0, 10.0, "PCIe 5.0 x16 measured pinned H2D ~55 GB/s (reference-facts.md); latency "
             "10 us per copy assumed"),
    LinkSpec("nvlink-c2c", 300.0, 5.0, "GH200 NVLink-C2C measured H2D ~300-340 GB/s (reference-facts.md; lower "
             "end used); latency 5 us per copy assumed"),
)


def _twins() -> dict[str, Twin]:
    base = [
        Twin("qwen3-30b-a3b@rtx4090-pcie4", MODELS["qwen3-30b-a3b"], DEVICES["rtx4090"], LINKS["pcie4"]),
        Twin("qwen3-30b-a3b@rtx5090-pcie5", MODELS["qwen3-30b-a3b"], DEVICES["rtx5090"], LINKS["pcie5"]),
        Twin("qwen3-30b-a3b@h100-pcie5", MODELS["qwen3-30b-a3b"], DEVICES["h100-pcie"], LINKS["pcie5"]),
        Twin("qwen3-30b-a3b@gh200-c2c", MODELS["qwen3-30b-a3b"], DEVICES["gh200"], LINKS["nvlink-c2c"]),
        Twin("mixtral-8x7b@rtx4090-pcie4", MODELS["mixtral-8x7b"], DEVICES["rtx4090"], LINKS["pcie4"],
             launches_per_target_layer=79),
    ]
    out = {}
    for t in base:
        out[t.name] = t
        out[t.name + "+graphs"] = replace(t, name=t.name + "+graphs", seconds_per_launch=0.0)
    return out


TWINS: dict[str, Twin] = _twins()

PUBLISHED_DECODE: dict[str, list[tuple[float, str]]] = {
    "qwen3-30b-a3b@rtx4090-pcie4": [
        (196.0, "runaihome.com 'Qwen3-30B-A3B Local AI Guide' (2026): up to 196 tok/s on one RTX 4090, 4-bit "
                "(llama.cpp/Ollama): reads ~1/3.5 of bf16's bytes"),
        (25.0, "reference-facts.md: ~25 tok/s over PCIe 4.0 with 15% of VRAM as expert cache (4-bit community engine)"),
    ],
    "qwen3-30b-a3b@rtx5090-pcie5": [],
    "qwen3-30b-a3b@h100-pcie5": [],
    "qwen3-30b-a3b@gh200-c2c": [],
    "mixtral-8x7b@rtx4090-pcie4": [
        (81.0, "Baseten blog 'Faster Mixtral inference with TensorRT-LLM and quantization': 81 tok/s perceived, "
               "int8 on one A100 80GB (2.0 TB/s), batch 1, TRT-LLM (not transformers, not a 4090)"),
    ],
}


def twin_names() -> list[str]:
    """Every twin's name (``<model>@<device>-<link>`` and its ``+graphs`` variant)."""
    return sorted(TWINS)


def get_twin(name: str | Twin) -> Twin:
    """The twin called ``name`` (a :class:`Twin` passes through); ``KeyError`` lists the choices."""
    if isinstance(name, Twin):
        return name
    try:
        return TWINS[name]
    except KeyError:
        raise KeyError(f"unknown twin {name!r}; choose from {', '.join(twin_names())}") from None


def effective_tokens(distinct: float, experts: int, top_k: int, tokens: int) -> float:
    """Independently routed tokens that would touch ``distinct`` of ``experts`` (top ``top_k``), at most ``tokens``."""
    if distinct <= 0:
        return 0.0
    if distinct >= experts:
        return float(tokens)
    n_eff = math.log(1.0 - distinct / experts) / math.log(1.0 - top_k / experts)
    return min(float(tokens), n_eff)


def distinct_experts(n_eff: float, experts: int, top_k: int) -> float:
    """Expected distinct experts of ``n_eff`` independently routed tokens (uniform routing)."""
    return experts * (1.0 - (1.0 - top_k / experts) ** n_eff)


def _source_time() -> float:
    """The clock's real-time source (``perf_counter``; frozen inside :func:`specfit_hf.clock.simulated`)."""
    return clock() - offset()


def _tokens_and_past(args: tuple, kwargs: dict) -> tuple[int, int]:
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    tokens = int(ids.shape[1]) if ids is not None and ids.dim() >= 2 else 1
    cache = kwargs.get("past_key_values")
    past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
    return tokens, past


class TwinTimeline:
    """Charges a twin's modeled time for target/draft forwards and expert transfers on :func:`clock`.

    Attach with :meth:`attach` (or use as a context manager) after ``offload_experts`` so the
    runtime's link can be replaced by the twin's.  Each hooked forward's real CPU time (the
    span of the clock's real-time source, minus the real copy time of transfers inside it;
    zero inside :func:`specfit_hf.clock.simulated`) is replaced
    by its modeled time with :func:`specfit_hf.clock.advance`; transfers inside the forward
    keep their own (virtual link) advance.  Inside a target forward the clock also moves layer by
    layer (each decoder layer starts at its share of the forward's modeled time, estimated with one
    token's experts and settled at the end), so copies prefetched ahead of the forward
    (:meth:`~specfit_hf.offload.OffloadRuntime.prefetch`) overlap the layers before the one that
    needs them as they would on the device.

    Attributes:
        events: counts and modeled seconds per kind (``target``, ``draft_level``, ``draft_head``,
            ``expert_heads``).
    """

    def __init__(self, twin: str | Twin, target: torch.nn.Module, draft: torch.nn.Module | None = None) -> None:
        self.twin = get_twin(twin)
        self.target = target
        self.draft = draft
        self._handles: list[Any] = []
        self._stack: list[list[float]] = []  # per open hooked call: [real start, copy seconds then, advanced inside]
        self._saved_link: Any = None
        self._runtime: Any = None
        self.events: dict[str, list[float]] = {"target": [0, 0.0], "draft_level": [0, 0.0], "draft_head": [0, 0.0],
                                               "expert_heads": [0, 0.0]}
        self._restore: list[tuple[Any, str]] = []  # (object, attribute) of wrapped methods
        self._estimate = 0.0  # the current target forward's modeled seconds, as estimated at its start
        self.real_compute_seconds = 0.0
        self.copy_seconds = 0.0

    # ------------------------------------------------------------------ attach
    def attach(self) -> "TwinTimeline":
        """Install the hooks and the twin's link; returns ``self``."""
        if self._handles:
            raise RuntimeError("this TwinTimeline is already attached")
        runtime = get_runtime(self.target)
        if runtime is None:
            raise ValueError("attach offload_experts() to the target before the twin (the twin charges its misses)")
        self._runtime, self._saved_link = runtime, runtime.link
        runtime.link = _MeteredLink(self.twin.emulated_link(runtime), self)
        self._hook(self.target, self._target_cost)
        layers = decoder_layers(self.target)
        for i, layer in enumerate(layers):
            if i:
                self._handles.append(layer.register_forward_pre_hook(
                    self._layer_start(i / len(layers)), with_kwargs=True))
        self._handles.append(self.target.register_forward_pre_hook(self._target_start, with_kwargs=True))
        if self.draft is not None:
            mid = getattr(self.draft, "midlayer", None)
            if mid is None:
                raise TypeError(
                    f"the twin models EAGLE-3 drafts (a `midlayer`); got {type(self.draft).__name__} without one"
                )
            d = self.twin.model.draft
            self._hook(mid, self._draft_level_cost)
            self._hook(self.draft.lm_head, lambda a, k, o: self._head_cost(d.lm_head_params, a))
            self._hook(self.draft.fc, lambda a, k, o: self._head_cost(d.fc_params, a))
            # the tree drafter's forwards, whole: the embedding, rotary rows and next hidden state around the
            # layer, and the log-softmax and top-k after the lm_head, are device work too (the layer's and the
            # lm_head's hooks nest inside and leave the charge to these)
            if hasattr(self.draft, "draft_forward"):
                self._replace(self.draft, "draft_forward", self._charged(self.draft.draft_forward,
                                                                         self._draft_level_cost))
            if hasattr(self.draft, "top_children"):
                self._replace(self.draft, "top_children", self._charged(self.draft.top_children,
                                                                        self._top_children_cost))
            if getattr(self.draft, "expert_heads", None) is not None and hasattr(self.draft, "predict_experts"):
                # the heads run as one stacked matmul (no module call to hook): the method is wrapped, and so
                # are the functions a generate call's expert predictor makes of them (expert_predictor_fn)
                self._replace(self.draft, "predict_experts",
                              self._charged(self.draft.predict_experts, self._expert_heads_cost))
                if hasattr(self.draft, "expert_predictor_fn"):
                    maker = self.draft.expert_predictor_fn
                    self._replace(self.draft, "expert_predictor_fn",
                                  lambda *a, **k: self._charged(maker(*a, **k), self._expert_heads_cost))
        return self

    def detach(self) -> None:
        """Remove the hooks and give the runtime its previous link back."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for obj, name in self._restore:
            delattr(obj, name)  # the class's method shows through again
        self._restore = []
        if self._runtime is not None:
            self._runtime.link = self._saved_link
            self._runtime = None

    def __enter__(self) -> "TwinTimeline":
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def _hook(self, module: torch.nn.Module, cost: Any) -> None:
        def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._begin()

        def post(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self._end(cost, args, kwargs, output)

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post, with_kwargs=True))

    def _replace(self, obj: Any, name: str, replacement: Any) -> None:
        """``obj.name`` becomes ``replacement`` (an instance attribute until :meth:`detach`)."""
        setattr(obj, name, replacement)
        self._restore.append((obj, name))

    def _charged(self, function: Any, cost: Any) -> Any:
        """``function``, its calls charged ``cost`` in place of their CPU time."""
        def charged(*args: Any, **kwargs: Any) -> Any:
            self._begin()
            output = function(*args, **kwargs)
            self._end(cost, args, kwargs, output)
            return output

        return charged

    def _begin(self) -> None:
        self._stack.append([_source_time(), self.copy_seconds, 0.0])

    def _end(self, cost: Any, args: tuple, kwargs: dict, output: Any) -> None:
        start, copies_before, advanced = self._stack.pop()
        if self._stack:  # nested inside another modeled forward: the outer one charges it
            return
        kind, modeled = cost(args, kwargs, output)
        # the forward's CPU compute (and this hook's own arithmetic) is replaced; transfers keep their advance
        real = _source_time() - start - (self.copy_seconds - copies_before)
        self.events[kind][0] += 1
        self.events[kind][1] += modeled
        self.real_compute_seconds += real
        advance(modeled - real - advanced)

    def _target_start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """(Runs just after :meth:`_begin` of a target forward.)  Its modeled time as estimated now."""
        if len(self._stack) == 1:  # the target's own frame, just opened
            tokens, past = _tokens_and_past(args, kwargs)
            self._estimate = self.twin.target_forward_seconds(tokens, past, float(self.twin.model.top_k))

    def _layer_start(self, share: float) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if len(self._stack) != 1:  # (a target layer runs only inside the target's own forward)
                return
            frame = self._stack[0]
            real = _source_time() - frame[0] - (self.copy_seconds - frame[1])
            step = share * self._estimate - real - frame[2]
            frame[2] += step
            advance(step)

        return hook

    # ------------------------------------------------------------------ costs
    def _target_cost(self, args: tuple, kwargs: dict, output: Any) -> tuple[str, float]:
        tokens, past = _tokens_and_past(args, kwargs)
        past = max(0, past - tokens)  # the cache already holds this forward's keys when the post-hook runs
        m, rt = self.twin.model, self._runtime
        real_distinct = []
        for layer in rt.moe_layers:
            routing = rt.last_routing(layer)
            d_tiny = len(torch.unique(routing)) if routing is not None else rt.top_k * tokens
            n_eff = effective_tokens(d_tiny, rt.num_experts, rt.top_k, tokens)
            real_distinct.append(distinct_experts(n_eff, m.experts, m.top_k))
        distinct = sum(real_distinct) / len(real_distinct) if real_distinct else float(m.top_k)
        return "target", self.twin.target_forward_seconds(tokens, past, distinct)

    def _draft_level_cost(self, args: tuple, kwargs: dict, output: Any) -> tuple[str, float]:
        hidden = args[1] if len(args) > 1 else kwargs.get("hidden_states", args[0])
        tokens = int(hidden.shape[-2]) if hidden.dim() >= 2 else 1
        return "draft_level", self.twin.draft_level_seconds(tokens, 0)

    def _expert_heads_cost(self, args: tuple, kwargs: dict, output: Any) -> tuple[str, float]:
        hidden = args[0] if args else kwargs["hidden"]
        rows = int(hidden.numel() // hidden.shape[-1]) if hidden.dim() else 1
        return "expert_heads", self.twin.expert_heads_seconds(rows)

    def _top_children_cost(self, args: tuple, kwargs: dict, output: Any) -> tuple[str, float]:
        kind, seconds = self._head_cost(self.twin.model.draft.lm_head_params, args)
        values = output[0]  # [..., k]: one row per node
        return kind, seconds + self.twin.draft_top_k_seconds(int(values.numel() // max(values.shape[-1], 1)))

    def _head_cost(self, params: int, args: tuple) -> tuple[str, float]:
        x = args[0]
        rows = int(x.numel() // x.shape[-1]) if x.dim() else 1
        return "draft_head", self.twin.draft_matmul_seconds(params, rows)


class _MeteredLink(EmulatedLink):
    """The twin's virtual link; also tells the timeline how much real copy time each transfer took."""

    def __init__(self, link: EmulatedLink, timeline: TwinTimeline) -> None:
        object.__setattr__(self, "gbps", link.gbps)
        object.__setattr__(self, "latency_us", link.latency_us)
        object.__setattr__(self, "virtual", True)
        object.__setattr__(self, "timeline", timeline)
        self.__post_init__()

    def copy(self, pairs: Any, nbytes: int) -> float:
        start = _source_time()
        seconds = super().copy(pairs, nbytes)
        self.timeline.copy_seconds += _source_time() - start
        return seconds

    def __repr__(self) -> str:
        t = self.timeline.twin
        return f"{t.link.name} twin link ({t.link.gbps:g} GB/s, {t.link.latency_us:g} us per copy)"

    __str__ = __repr__


def sanity_table(names: list[str] | None = None, context: int = 512) -> str:
    """Markdown: each twin's modeled plain decode tok/s (every expert resident) beside published figures."""
    names = names or [n for n in twin_names() if not n.endswith("+graphs")]
    lines = [
        "| twin | modeled tok/s, eager host overhead | modeled tok/s, +graphs | +graphs step (roofline only) "
        "| published batch-1 (what it is) |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        t, g = get_twin(name), get_twin(name + "+graphs")
        step, bound = t.decode_step_seconds(context), g.decode_step_seconds(context)
        pubs = "; ".join(f"{v:g} tok/s ({src})" for v, src in PUBLISHED_DECODE.get(name, [])) or "none sourced"
        lines.append(f"| `{name}` | {1 / step:.0f} | {1 / bound:.0f} | {bound * 1e3:.2f} ms/step | {pubs} |")
    return "\n".join(lines) + "\n"
