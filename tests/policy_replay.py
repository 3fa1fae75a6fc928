"""Deterministic replay of SpecFit's decisions (used by ``test_policy_replay.py``).

The policy's live decisions follow measured times, which vary from run to run.  Here
every duration comes from a fixed timing model on :func:`specfit_hf.clock.simulated`
(real time stands still): a target forward over ``n`` tokens costs ``T0 + T_TOKEN * n``,
a draft step ``T_DRAFT``, an expert load ``T_EXPERT`` on a virtual emulated link, and
the policy's own work costs nothing.  The same code then takes the same decisions on
any machine, so a trace recorded once pins the policy's behaviour: every selection
(nodes, stop flag, whether it is the prompt-lookup chain, the experts to prefetch and the
residents to keep, predicted figures) of every draft level of every cycle, and the generated
tokens, and the drafting plan (nodes to expand, children each).

    python tests/policy_replay.py --write     # re-record after an intended behaviour change
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from specfit_hf import EmulatedLink, offload_experts
from specfit_hf.cli import load_pair
from specfit_hf.clock import advance, simulated
from specfit_hf.data import load_prompts
from specfit_hf.generation import SpecFitConfig
from specfit_hf.selection import SpecFitPolicy, register_policy

TRACE = Path(__file__).parent / "data" / "specfit_replay.json"
T0, T_TOKEN, T_DRAFT, T_EXPERT = 2e-3, 2e-4, 4e-4, 1.5e-4
NEW_TOKENS = 40
# (label, policy_kwargs): the default policy, and variants that reach the other branches
SETTINGS = [
    ("default", {}),
    ("always-draft", {"adaptive_drafting": False}),
    ("history+router", {"adaptive_drafting": False, "expert_predictor": "history+router", "lookahead": False}),
]

_SELECTIONS: list[list[Any]] = []


@register_policy("specfit-replay")
class _RecordingSpecFit(SpecFitPolicy):
    """SpecFit, recording every selection it returns."""

    def select(self, tree, ctx):
        sel = super().select(tree, ctx)
        expand = None if sel.expand is None else sel.expand.tolist()
        prefetch = [None if p is None else p.tolist() for p in (sel.prefetch, sel.prefetch_ahead, sel.keep_resident)]
        _SELECTIONS.append([len(tree), sel.nodes.tolist(), bool(sel.stop), expand, sel.children, bool(sel.lookup),
                            prefetch, float(sel.expected_tokens), float(sel.predicted_time)])
        return sel


def _timed(fn, seconds_of):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        advance(seconds_of(*args, **kwargs))
        return out

    return wrapper


def run_trace(num_prompts: int = 2) -> dict[str, Any]:
    """Generate on GSM8K and CNN/DailyMail prompts under each setting; every decision recorded."""
    torch.manual_seed(0)
    target, draft, tok = load_pair(None, None, "cpu")
    # modeled durations: hooks charge the clock, which only they (and the link) move
    target.register_forward_hook(lambda m, args, kwargs, out: advance(
        T0 + T_TOKEN * int(kwargs["input_ids"].shape[1])), with_kwargs=True)
    draft.step = _timed(draft.step, lambda *a, **k: T_DRAFT)
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    runtime.link = EmulatedLink(gbps=runtime.expert_bytes / T_EXPERT / 1e9, virtual=True)
    prompts = [r["prompt"] for name in ("gsm8k", "cnn_dailymail")
               for r in load_prompts(name, "test", n=num_prompts, max_source_chars=400)]
    trace: dict[str, Any] = {}
    try:
        with simulated():
            for label, kwargs in SETTINGS:
                runs = []
                for prompt in prompts:
                    runtime.flush()
                    _SELECTIONS.clear()
                    ids = tok(prompt, return_tensors="pt").input_ids
                    cfg = SpecFitConfig(policy="specfit-replay", do_sample=False, max_new_tokens=NEW_TOKENS,
                                        policy_kwargs=dict(kwargs))
                    out = target.generate(ids, assistant_model=draft, generation_config=cfg)
                    runs.append({"tokens": out[0, ids.shape[1]:].tolist(), "selections": list(_SELECTIONS)})
                trace[label] = runs
    finally:
        runtime.detach()
    return trace


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true", help=f"record the trace to {TRACE}")
    args = ap.parse_args()
    torch.set_num_threads(1)
    trace = run_trace()
    if args.write:
        TRACE.write_text(json.dumps(trace))
    for label, runs in trace.items():
        drafted = sum(1 for r in runs for s in r["selections"] if s[1])
        print(label, "selections", sum(len(r["selections"]) for r in runs), "non-empty", drafted, file=sys.stderr)
