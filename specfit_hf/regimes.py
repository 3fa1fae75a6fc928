"""Link regimes: how a CPU-only benchmark stands in for a real GPU + PCIe setting.

On a CPU there is no host→device link, so the offload runtime emulates one
(:class:`specfit_hf.offload.EmulatedLink`: the copy really happens, then the call waits
until ``bytes / bandwidth + latency`` has passed).  The tiny models this project ships
are far smaller than the models users run, so copying the *real* PCIe bandwidth would
make misses nearly free.  Instead each regime keeps the ratio that decides whether
speculation pays off:

    rho = (time to load one token's experts for every MoE layer, nothing cached)
          / (time of one decode step with every expert already resident)

For the named real setting we take rho from public figures (``shared/docs/
reference-facts.md``): the per-token expert bytes over the measured PCIe bandwidth,
divided by a decode step bound by reading the active weights from GPU memory.  On the
benchmark host we measure the tiny target's cached decode step ``t_step`` and set the
emulated link so that ``tokens_experts_bytes / gbps = rho * t_step``.

This is emulation: CPU timings reported with these regimes say how the *ratio* plays
out, not what a GPU would measure.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LinkRegime", "REGIMES", "emulated_gbps", "emulated_link_params"]


@dataclass(frozen=True)
class LinkRegime:
    """A named real setting and the transfer/compute ratio it implies.

    Attributes:
        name: short id used on the command line and in results.
        description: the real setting it stands for.
        token_expert_bytes: bytes of one token's routed experts over all MoE layers.
        link_gbps: measured host→device bandwidth of the link (GB/s).
        cached_step_seconds: one decode step with every expert resident.
        expert_bytes: bytes of one expert (three matrices).
        latency_us: per-transfer latency of the link.
    """

    name: str
    description: str
    token_expert_bytes: float
    link_gbps: float
    cached_step_seconds: float
    expert_bytes: float
    latency_us: float = 10.0

    @property
    def rho(self) -> float:
        """Uncached expert transfer time of one token / cached decode step time."""
        return self.token_expert_bytes / (self.link_gbps * 1e9) / self.cached_step_seconds


# Decode steps are bound by reading the active weights once: Qwen3-30B-A3B activates
# 3.3 B parameters (6.6 GB in bf16); Mixtral-8x7B 12.9 B (25.8 GB).  We divide by the
# memory bandwidth of the GPU that typically sits behind each link (RTX 4090, 1.0 TB/s,
# PCIe 4.0; RTX 5090, 1.8 TB/s, PCIe 5.0) and add 30 % for attention, norms and kernel
# launches.  Expert bytes per token: reference-facts.md (3.62 GB and 22.5 GB).
REGIMES: dict[str, LinkRegime] = {
    r.name: r
    for r in (
        LinkRegime(
            name="qwen3-pcie4",
            description="Qwen3-30B-A3B bf16, RTX 4090-class GPU, PCIe 4.0 x16 (~25 GB/s)",
            token_expert_bytes=3.62e9,
            link_gbps=25.0,
            cached_step_seconds=6.6e9 / 1.0e12 * 1.3,
            expert_bytes=9.44e6,
        ),
        LinkRegime(
            name="qwen3-pcie5",
            description="Qwen3-30B-A3B bf16, RTX 5090-class GPU, PCIe 5.0 x16 (~55 GB/s)",
            token_expert_bytes=3.62e9,
            link_gbps=55.0,
            cached_step_seconds=6.6e9 / 1.8e12 * 1.3,
            expert_bytes=9.44e6,
        ),
        LinkRegime(
            name="mixtral-pcie4",
            description="Mixtral-8x7B bf16, RTX 4090-class GPU, PCIe 4.0 x16 (~25 GB/s)",
            token_expert_bytes=22.5e9,
            link_gbps=25.0,
            cached_step_seconds=25.8e9 / 1.0e12 * 1.3,
            expert_bytes=352e6,
        ),
    )
}


def emulated_gbps(regime: LinkRegime, *, token_expert_bytes: float, cached_step_seconds: float) -> float:
    """Bandwidth (GB/s) of the emulated link that gives the tiny model ``regime.rho``.

    Args:
        token_expert_bytes: bytes of one token's routed experts over all MoE layers of
            the model being benchmarked (``runtime.expert_bytes * top_k * len(moe_layers)``).
        cached_step_seconds: measured decode step of that model with all experts resident.
    """
    if token_expert_bytes <= 0 or cached_step_seconds <= 0:
        raise ValueError("token_expert_bytes and cached_step_seconds must be positive")
    transfer_seconds = regime.rho * cached_step_seconds
    return token_expert_bytes / transfer_seconds / 1e9


def emulated_link_params(
    regime: LinkRegime, *, expert_bytes: float, experts_per_token: int, cached_step_seconds: float
) -> tuple[float, float]:
    """``(gbps, latency_us)`` for an :class:`~specfit_hf.offload.EmulatedLink` on this host.

    Args:
        expert_bytes: bytes of one expert of the benchmarked model.
        experts_per_token: routed experts of one token over all its MoE layers (top_k x layers).
        cached_step_seconds: measured decode step with every expert resident.

    The latency is scaled like the transfer time: it keeps the share of one expert's
    load that it has on the real link.
    """
    gbps = emulated_gbps(
        regime, token_expert_bytes=float(expert_bytes) * int(experts_per_token), cached_step_seconds=cached_step_seconds
    )
    real_copy_seconds = regime.expert_bytes / (regime.link_gbps * 1e9)
    emulated_copy_seconds = float(expert_bytes) / (gbps * 1e9)
    latency_us = regime.latency_us * emulated_copy_seconds / real_copy_seconds
    return gbps, latency_us
