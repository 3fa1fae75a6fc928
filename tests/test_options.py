"""Policy options are typed and checked when the config is built."""

from __future__ import annotations

import pytest

from specfit_hf.generation import SpecFitConfig
from specfit_hf.selection import CostModel, SpecFitOptions, SpecFitPolicy


def test_misspelled_option_is_rejected_at_config_time_with_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown option 'adaptive_drafitng'.*did you mean 'adaptive_drafting'.*valid"):
        SpecFitConfig(policy_kwargs={"adaptive_drafitng": False})


@pytest.mark.parametrize("kwargs, message", [
    ({"adaptive_drafting": "no"}, "must be a bool"),
    ({"explore_every": 2.5}, "must be an int"),
    ({"explore_every": True}, "must be an int"),
    ({"expert_predictor": "crystal-ball"}, "must be one of"),
    ({"cost": {"t0": 1e-3}}, r"missing \['t_token', 't_expert'\]"),
    ({"cost": {"t0": 1e-3, "t_token": "1", "t_expert": 0.0}}, "must be a number"),
    ({"acceptance": {"bins": 4}}, r"unknown keys \['bins'\]"),
    ({"acceptance": {"num_bins": 0}}, "acceptance'\\] is invalid"),
    ({"max_nodes": 0}, "max_nodes"),
])
def test_bad_values_are_rejected_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecFitConfig(policy_kwargs=kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "specfitt"}, "unknown selection policy 'specfitt'"),
    ({"policy_kwargs": [1]}, "policy_kwargs must be a dict, got list"),
    ({"max_depth": 2.7}, "max_depth must be an integer, got 2.7"),
    ({"tree_top_k": 5000}, r"tree_top_k must be in \[1, 32\]"),
    ({"max_verify_nodes": "60"}, "max_verify_nodes must be an integer"),
    ({"policy": "eagle3", "policy_kwargs": {"lookahead": False}}, "takes no policy_kwargs"),
])
def test_bad_tree_settings_and_policies_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecFitConfig(**kwargs)


def test_options_parse_and_round_trip(tmp_path):
    cfg = SpecFitConfig(policy_kwargs={"adaptive_drafting": False, "cost": {"t0": 1e-3, "t_token": 1e-4, "t_expert": 2e-3},
                                       "acceptance": {"num_bins": 8}}, max_depth=3.0)
    assert cfg.max_depth == 3 and isinstance(cfg.max_depth, int)
    opts = SpecFitPolicy(cfg).options
    assert isinstance(opts, SpecFitOptions)
    assert opts.adaptive_drafting is False and opts.cost == CostModel(1e-3, 1e-4, 2e-3) and opts.lookahead is True
    cfg.save_pretrained(tmp_path)
    loaded = SpecFitConfig.from_pretrained(tmp_path)
    assert loaded.policy_kwargs == cfg.policy_kwargs and SpecFitPolicy(loaded).options == opts


def test_every_option_is_documented_where_it_is_declared():
    import inspect

    source = inspect.getsource(SpecFitOptions)
    for name in SpecFitOptions.__dataclass_fields__:
        declaration = source.index(f"    {name}:")
        assert '"""' in source[declaration:].splitlines()[1], f"{name} has no docstring under its declaration"
