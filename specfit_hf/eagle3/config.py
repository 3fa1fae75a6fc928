"""Configuration of the EAGLE-3 draft model, in the public checkpoint layout.

Public EAGLE-3 drafts (SafeAILab EAGLE, SpecForge, the SGLang / vLLM examples) ship a
Llama-style ``config.json``: ``model_type`` "llama", ``architectures``
``["LlamaForCausalLMEagle3"]`` (sometimes ``["LlamaForCausalLM"]``), ``num_hidden_layers``
1, plus ``draft_vocab_size`` and optionally ``target_hidden_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``.  :class:`Eagle3Config` reads those
files unchanged and writes the same layout, so folders trained here load in the
serving engines too.

Which target hidden states feed the draft
-----------------------------------------
The draft consumes three target hidden states (low / mid / high), always expressed
inside this package as Hugging Face ``hidden_states`` indices (index ``i`` = input of
decoder layer ``i``; see :mod:`specfit_hf.features`).  With no explicit ids the default
is ``(2, L // 2, L - 3)`` for an ``L``-layer target, which is what EAGLE, SGLang and
vLLM all use by default.

Explicit ``eagle_config.eagle_aux_hidden_state_layer_ids`` are ambiguous between
engines: SGLang / SpecForge read id ``k`` as "the output of decoder layer ``k``" (HF
index ``k + 1``), vLLM as HF index ``k``.  Checkpoints in this key layout
(``midlayer.*``) come from the EAGLE / SpecForge line, so **the default convention is
"layer_output"** (HF index = id + 1).  A checkpoint whose ids are HF indices says so with
``eagle_config.aux_hidden_state_id_convention = "hf_index"``.  Folders saved here write
the convention explicitly.

A top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM ``LlamaForCausalLMEagle3`` configs,
the speculators layout) is read as vLLM reads it: HF ``hidden_states`` indices
(``hf_index``).  It is moved into ``eagle_config`` with that convention; a config with both,
disagreeing, is an error.

Public layouts read (each tested with its real key names, ``tests/test_eagle3.py``)
-------------------------------------------------------------------------------
* SafeAILab EAGLE / SpecForge / AngelSlim: ``midlayer.*``, ``d2t`` + ``t2d``.
* ModelOpt export (``architectures ["LlamaForCausalLM"]``): ``midlayer.*`` and ``d2t``
  without ``t2d``; ``t2d`` is derived from ``d2t``.
* vLLM speculators (``speculators_model_type "eagle3"``, a nested
  ``transformer_layer_config``): ``layers.0.*`` renamed to ``midlayer.*``, optional
  ``fc.bias`` (older exports), top-level layer ids (:meth:`Eagle3Config.from_speculators`).

``norm_output``: which hidden state is fed back
-----------------------------------------------
Trainers disagree on what ``norm_output: true`` means: EAGLE-3.1 / vLLM feed the
*post-norm* state to the next draft step (``lm_head`` reads that same normed state),
others only mean "the final norm sits before ``lm_head``" (which every EAGLE-3 draft
does) and feed back the *pre-norm* state.  The choice is explicit here:
:attr:`Eagle3Config.hidden_feedback` is ``"post_norm"`` or ``"pre_norm"``, from
``eagle_config.hidden_feedback`` when the checkpoint states it (folders saved here always
do), else ``"post_norm"`` when ``norm_output`` is set (the EAGLE-3.1 / vLLM reading) and
``"pre_norm"`` otherwise; the speculators layout has no ``norm_output`` and feeds back the
pre-norm state.  Logits are ``lm_head(norm(out))`` either way.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

__all__ = ["Eagle3Config", "AUX_ID_CONVENTIONS", "HIDDEN_FEEDBACK", "default_feature_indices"]

#: Accepted values of ``eagle_config.aux_hidden_state_id_convention``.
AUX_ID_CONVENTIONS = ("layer_output", "hf_index")
#: Accepted values of ``eagle_config.hidden_feedback`` (see the module docstring).
HIDDEN_FEEDBACK = ("pre_norm", "post_norm")


def default_feature_indices(num_target_layers: int) -> tuple[int, int, int]:
    """Default low / mid / high HF ``hidden_states`` indices for an ``L``-layer target."""
    L = int(num_target_layers)
    if L < 4:
        raise ValueError(f"an EAGLE-3 target needs at least 4 decoder layers, got {L}")
    return (2, L // 2, L - 3)


class Eagle3Config(PretrainedConfig):
    r"""Configuration of :class:`~specfit_hf.eagle3.Eagle3DraftModel`.

    Args:
        vocab_size: the **target's** vocabulary size (transformers' assistant validation
            compares it with the target's); the draft head predicts ``draft_vocab_size``
            tokens mapped to target ids through the ``d2t`` offset table.
        draft_vocab_size: size of the draft head's vocabulary (defaults to ``vocab_size``).
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
        rms_norm_eps, hidden_act, max_position_embeddings, rope_parameters: the single
            Llama decoder layer (``rope_theta`` / ``rope_scaling`` in legacy configs are
            converted by transformers into ``rope_parameters``).
        target_hidden_size: hidden size of the target's features (defaults to ``hidden_size``).
        eagle_config: dict, public layout; may hold ``eagle_aux_hidden_state_layer_ids``
            and ``aux_hidden_state_id_convention`` (see the module docstring).
        fc_norm: RMS-normalise each of the three target features before ``fc``
            (weights ``fc_norm.{0,1,2}.weight``; a vLLM-speculators variant).
        norm_output: public flag; with no explicit ``eagle_config.hidden_feedback`` it means
            "post-norm feedback" (see :attr:`hidden_feedback` and the module docstring).
        fc_bias: ``fc`` has a bias (older vLLM-speculators exports).
        norm_before_residual: the residual stream starts from ``hidden_norm(h)`` instead of ``h``.
        expert_predictor: ``{"moe_layers": [...], "num_experts": E, "top_k": k}`` to add one
            linear expert-routing head per target MoE layer, or ``None``.
    """

    # Public EAGLE-3 folders declare model_type "llama"; engines dispatch on the
    # architecture name "LlamaForCausalLMEagle3".  Keeping both makes our folders
    # loadable by SGLang / vLLM.  This class is never registered with AutoConfig, so
    # it does not shadow transformers' LlamaConfig.
    model_type = "llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    draft_vocab_size: int | None = None
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    target_hidden_size: int | None = None
    eagle_config: dict | None = None
    fc_norm: bool = False
    norm_output: bool = False
    fc_bias: bool = False
    norm_before_residual: bool = False
    expert_predictor: dict | None = None
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        top_ids = kwargs.pop("eagle_aux_hidden_state_layer_ids", None)
        if top_ids is not None:
            self._adopt_top_level_layer_ids([int(i) for i in top_ids])
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.architectures is None:
            self.architectures = ["LlamaForCausalLMEagle3"]
        if self.rope_parameters is None and "rope_theta" not in kwargs and "rope_scaling" not in kwargs:
            kwargs["rope_theta"] = 10000.0
        super().__post_init__(**kwargs)
        self._validate()

    def _adopt_top_level_layer_ids(self, ids: list[int]) -> None:
        """vLLM / speculators keep the ids at the top level, as HF indices."""
        eagle = dict(self.eagle_config or {})
        nested = eagle.get("eagle_aux_hidden_state_layer_ids")
        if nested is not None:
            conv = eagle.get("aux_hidden_state_id_convention", "layer_output")
            shift = 1 if conv == "layer_output" else 0
            if [int(i) + shift for i in nested] != ids:
                raise ValueError(
                    f"config has top-level eagle_aux_hidden_state_layer_ids {ids} (HF indices) and "
                    f"eagle_config ids {nested} ({conv!r}) naming other layers"
                )
            return
        eagle["eagle_aux_hidden_state_layer_ids"] = ids
        eagle["aux_hidden_state_id_convention"] = "hf_index"
        self.eagle_config = eagle

    @classmethod
    def from_speculators(cls, raw: dict[str, Any]) -> "Eagle3Config":
        """Build the config of a vLLM speculators EAGLE-3 folder (``speculators_model_type "eagle3"``).

        The decoder layer's shape comes from the nested ``transformer_layer_config`` (its
        ``vocab_size`` is the target's); ``draft_vocab_size``, ``norm_before_residual``,
        ``target_hidden_size`` and the top-level layer ids (HF indices) from the top level.
        """
        if raw.get("speculators_model_type") != "eagle3":
            raise ValueError(
                f"not a speculators EAGLE-3 config: speculators_model_type={raw.get('speculators_model_type')!r}"
            )
        layer = dict(raw.get("transformer_layer_config") or {})
        if not layer:
            raise ValueError("speculators config lacks transformer_layer_config")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"speculators drafts with {layer['num_hidden_layers']} decoder layers are not supported "
                "(EAGLE-3 has one)"
            )
        if raw.get("norm_before_fc"):
            raise NotImplementedError("the `norm_before_fc` EAGLE-3 variant is not supported")
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
                "rope_parameters", "attention_bias", "mlp_bias", "vocab_size", "pad_token_id", "bos_token_id",
                "eos_token_id")
        kwargs = {k: layer[k] for k in keys if layer.get(k) is not None}
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        eagle = {"use_aux_hidden_state": True, "hidden_feedback": "pre_norm"}
        cfg = cls(
            **kwargs,
            num_hidden_layers=1,
            draft_vocab_size=raw.get("draft_vocab_size"),
            target_hidden_size=raw.get("target_hidden_size"),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            eagle_config=eagle,
            eagle_aux_hidden_state_layer_ids=raw.get("eagle_aux_hidden_state_layer_ids"),
        )
        return cfg

    @property
    def hidden_feedback(self) -> str:
        """``"post_norm"`` or ``"pre_norm"``: the hidden state the next draft step consumes."""
        explicit = (self.eagle_config or {}).get("hidden_feedback")
        if explicit is not None:
            return explicit
        return "post_norm" if self.norm_output else "pre_norm"

    # -- validation -------------------------------------------------------------------
    def _validate(self) -> None:
        if int(self.num_hidden_layers) != 1:
            raise ValueError(
                "EAGLE-3 drafts have exactly one decoder layer (`midlayer`); "
                f"got num_hidden_layers={self.num_hidden_layers}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be in [1, vocab_size={self.vocab_size}]"
            )
        if getattr(self, "norm_before_fc", False):
            raise NotImplementedError("the `norm_before_fc` EAGLE-3 variant is not supported")
        conv = self.aux_hidden_state_id_convention
        if conv not in AUX_ID_CONVENTIONS:
            raise ValueError(
                f"eagle_config.aux_hidden_state_id_convention must be one of {AUX_ID_CONVENTIONS}, got {conv!r}"
            )
        if self.hidden_feedback not in HIDDEN_FEEDBACK:
            raise ValueError(
                f"eagle_config.hidden_feedback must be one of {HIDDEN_FEEDBACK}, got {self.hidden_feedback!r}"
            )
        ids = self.aux_hidden_state_layer_ids
        if ids is not None and len(ids) != 3:
            raise ValueError(f"EAGLE-3 uses three target hidden states, got layer ids {ids}")
        ep = self.expert_predictor
        if ep is not None:
            missing = {"moe_layers", "num_experts", "top_k"} - set(ep)
            if missing:
                raise ValueError(f"expert_predictor lacks {sorted(missing)}")
            if not 0 < int(ep["top_k"]) <= int(ep["num_experts"]):
                raise ValueError("expert_predictor top_k must be in [1, num_experts]")

    # -- target features --------------------------------------------------------------
    @property
    def aux_hidden_state_layer_ids(self) -> list[int] | None:
        """The explicit layer ids of the public config, in their own convention (or None)."""
        ids = (self.eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")
        return None if ids is None else [int(i) for i in ids]

    @property
    def aux_hidden_state_id_convention(self) -> str:
        """How :attr:`aux_hidden_state_layer_ids` are meant ("layer_output" unless stated)."""
        return (self.eagle_config or {}).get("aux_hidden_state_id_convention", "layer_output")

    def target_feature_indices(self, num_target_layers: int) -> tuple[int, ...]:
        """HF ``hidden_states`` indices of the three target features for an ``L``-layer target."""
        ids = self.aux_hidden_state_layer_ids
        if ids is None:
            return default_feature_indices(num_target_layers)
        shift = 1 if self.aux_hidden_state_id_convention == "layer_output" else 0
        indices = tuple(i + shift for i in ids)
        for i in indices:
            if not 0 <= i <= num_target_layers:
                raise ValueError(
                    f"target feature index {i} (from layer ids {ids}, convention "
                    f"{self.aux_hidden_state_id_convention!r}) is outside [0, {num_target_layers}]"
                )
        return indices

    def set_target_feature_indices(self, hf_indices: tuple[int, ...] | list[int], num_target_layers: int) -> None:
        """Record the feature layers; writes nothing when they equal the engines' shared default.

        Explicit ids are written in the "layer_output" convention (the one SGLang /
        SpecForge assume for this key) together with the convention name.
        """
        hf_indices = tuple(int(i) for i in hf_indices)
        if len(hf_indices) != 3:
            raise ValueError("EAGLE-3 uses three target hidden states")
        eagle = dict(self.eagle_config or {})
        if hf_indices == default_feature_indices(num_target_layers):
            eagle.pop("eagle_aux_hidden_state_layer_ids", None)
            eagle.pop("aux_hidden_state_id_convention", None)
        else:
            if min(hf_indices) < 1:
                raise ValueError("HF index 0 (the embeddings) has no 'layer output' id")
            eagle["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in hf_indices]
            eagle["aux_hidden_state_id_convention"] = "layer_output"
        eagle.setdefault("use_aux_hidden_state", True)
        self.eagle_config = eagle

    def to_dict(self) -> dict[str, Any]:
        """Serialise; also writes the legacy ``rope_theta`` / ``rope_scaling`` keys the engines read."""
        out = super().to_dict()
        rope = dict(out.get("rope_parameters") or {})
        if "rope_theta" in rope:
            out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return out
