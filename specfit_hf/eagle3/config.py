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
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

__all__ = ["Eagle3Config", "AUX_ID_CONVENTIONS", "default_feature_indices"]

#: Accepted values of ``eagle_config.aux_hidden_state_id_convention``.
AUX_ID_CONVENTIONS = ("layer_output", "hf_index")


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
        norm_output: the hidden state passed to the next draft step is the final-norm
            output instead of the pre-norm one.
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
    norm_before_residual: bool = False
    expert_predictor: dict | None = None
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
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

    # -- validation -------------------------------------------------------------------
    def _validate(self) -> None:
        if int(self.num_hidden_layers) != 1:
            raise ValueError(
                f"EAGLE-3 drafts have exactly one decoder layer (`midlayer`); got num_hidden_layers={self.num_hidden_layers}"
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
