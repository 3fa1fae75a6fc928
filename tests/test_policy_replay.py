"""SpecFit's decisions, replayed on a deterministic timeline, match the recorded trace.

The trace (``tests/data/specfit_replay.json``) holds every selection of every draft level
of 12 generations (3 policy settings x 4 prompts) of the embedded pair, on a fixed
timing model (see ``tests/policy_replay.py``).  A refactor must leave all of it as it
was; an intended change of behaviour re-records it (``python tests/policy_replay.py
--write``) and says so in its commit.
"""

from __future__ import annotations

import json
import math

import pytest

from policy_replay import TRACE, run_trace
from test_generation import one_thread  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def replayed():
    return run_trace()


@pytest.mark.parametrize("setting", ["default", "always-draft", "history+router"])
def test_selections_replay_exactly(replayed, setting):
    recorded = json.loads(TRACE.read_text())[setting]
    got = replayed[setting]
    assert len(got) == len(recorded)
    drafted = lookups = prefetched = 0
    for run, ref in zip(got, recorded):
        assert run["tokens"] == ref["tokens"]
        assert len(run["selections"]) == len(ref["selections"])
        for (*decision, e, t), (*recorded_decision, re_, rt) in zip(run["selections"], ref["selections"]):
            assert decision == recorded_decision  # tree size, nodes, stop, to expand, children, lookup, prefetch
            nodes = decision[1]
            for a, b in ((e, re_), (t, rt)):
                assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
            drafted += bool(nodes)
            lookups += bool(decision[5])
            prefetched += any(decision[6])
    assert drafted > 0  # the trace exercises the search, not only plain steps
    if setting == "default":
        assert lookups > 0  # and prompt-lookup chains
        assert prefetched > 0  # and the chains' prefetches
