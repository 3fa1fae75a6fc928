"""The EAGLE-3 draft model: one Llama decoder layer fed by fused target features.

Weight names follow the public checkpoints exactly (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``), so a folder written by
SpecForge / EAGLE loads here unchanged and vice versa.

One draft *step* at sequence slot ``i`` consumes a pair ``(h_i, x_{i+1})``:

* ``h_i`` is ``fc(concat(low, mid, high))`` of the target at position ``i`` for committed
  positions, or the draft's own output hidden state of the previous step inside a tree;
* ``x_{i+1}`` is the token that follows position ``i``.

The decoder layer input is ``concat(input_layernorm(embed(x)), hidden_norm(h))`` (2·H)
into attention, the residual starts from ``h``, and the step predicts ``x_{i+2}``
through ``lm_head(norm(out))`` over the draft vocabulary.  Draft token ``d`` is target
token ``d + d2t[d]``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.utils import ModelOutput

from .config import Eagle3Config
from .drafter import Eagle3TreeDrafter
from .kv import DraftKVCache, causal_mask

__all__ = [
    "Eagle3DraftModel",
    "Eagle3Output",
    "DraftKVCache",
    "causal_mask",
]

#: ``attend(q, k, v) -> out``: q ``[B, nh, T, D]``, k / v ``[B, nkv, T, D]`` of the current
#: rows; returns ``[B, nh, T, D]``.  Lets inference (KV store + tree mask) and training
#: (training-time-test unrolling) share the layer code.
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _stacked_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    heads: int) -> torch.Tensor:
    """``[N, H] -> [N, heads, E]``: every expert head at once, from their stacked weights (and biases)."""
    return F.linear(hidden.to(weight.dtype), weight, bias).unflatten(-1, (heads, -1))


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (what cached tables derived from ``t`` are checked against); -1 for an
    inference tensor (made under ``torch.inference_mode``), which keeps none."""
    return -1 if t.is_inference() else t._version


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, nkv, S, D] -> [B, nkv * n_rep, S, D]`` (grouped-query attention)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class RMSNorm(LlamaRMSNorm):
    """``LlamaRMSNorm`` (same weights and checkpoint keys) that, at inference on float32 CPU tensors,
    runs as the single fused ``F.rms_norm`` -- bitwise the same result as the module's six ops
    (``tests/test_eagle3.py`` checks it), in one dispatch: the draft runs four norms in every
    level, where each small op costs microseconds.  Other dtypes, devices and training keep the
    module's own code."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            hidden_states.dtype == torch.float32
            and weight.dtype == torch.float32
            and hidden_states.is_cpu
            and not torch.is_grad_enabled()
        ):
            return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)
        return super().forward(hidden_states)


class Eagle3Attention(nn.Module):
    """Self-attention whose q/k/v read the 2·H concatenation of token and hidden streams."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_kv_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        in_dim = 2 * config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotary-embedded ``q [B, nh, T, D]``, ``k`` and ``v [B, nkv, T, D]``."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention with an additive float mask (or causal when None)."""
        k = repeat_kv(k, self.num_kv_groups)
        v = repeat_kv(v, self.num_kv_groups)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=self.scaling)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=self.scaling)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The single draft layer (``midlayer`` in checkpoints)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = bool(config.norm_before_residual)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: AttendFn,
    ) -> torch.Tensor:
        """One draft step; returns the pre-norm output hidden state ``[B, T, H]``."""
        if self.norm_before_residual:
            normed = self.hidden_norm(hidden)
            residual = normed
        else:
            residual = hidden
            normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(input_embeds), normed], dim=-1)
        q, k, v = self.self_attn.project(x, cos, sin)
        attn = attend(q, k, v)
        b, _, t, _ = attn.shape
        attn = self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        hidden = residual + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class Eagle3Output(ModelOutput):
    """Output of :meth:`Eagle3DraftModel.forward`.

    Attributes:
        logits: ``[B, T, draft_vocab_size]`` draft-vocabulary logits.
        hidden_states: ``[B, T, H]`` the hidden state the next draft step consumes
            (pre-norm output, or the final-norm output for ``norm_output`` drafts).
    """

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


def _checkpoint_keys(folder: Path) -> set[str]:
    """Tensor names of a local safetensors checkpoint (headers only), or an empty set."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys |= set(handle.keys())
    return keys


def _layout_kwargs(path: str | os.PathLike, config: Eagle3Config | None) -> dict[str, Any]:
    """``from_pretrained`` keywords that make a public layout load: the config and key renames.

    Local folders only (hub ids load as the SafeAILab / SpecForge layout).
    """
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        return {}
    raw = json.loads(config_file.read_text())
    out: dict[str, Any] = {}
    if config is None:
        if "speculators_model_type" in raw:
            config = Eagle3Config.from_speculators(raw)
        else:
            config = Eagle3Config.from_pretrained(folder)
    keys = _checkpoint_keys(folder)
    if any(k.startswith("layers.0.") for k in keys):
        if any(k.startswith("layers.") and not k.startswith("layers.0.") for k in keys):
            raise ValueError(f"draft checkpoint {folder} has more than one decoder layer; EAGLE-3 has one")
        out["key_mapping"] = {r"^layers\.0\.": "midlayer."}
    if "fc.bias" in keys:
        config.fc_bias = True
    out["config"] = config
    return out


class Eagle3DraftModel(PreTrainedModel):
    """EAGLE-3 draft head, loadable from public checkpoints (``LlamaForCausalLMEagle3``).

    Use it as ``assistant_model`` with a ``SpecFitConfig``; the generation loop calls
    :meth:`make_tree_drafter`.  When the checkpoint has no ``embed_tokens`` the draft
    borrows the target's (frozen) input embeddings on first use and does not save them.
    """

    config_class = Eagle3Config
    base_model_prefix = "eagle3"
    main_input_name = "input_ids"
    _no_split_modules = ["Eagle3DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        h, ht = config.hidden_size, config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(ht, eps=config.rms_norm_eps) for _ in range(3)])
        else:
            self.fc_norm = None
        self.fc = nn.Linear(3 * ht, h, bias=bool(config.fc_bias))
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", self._identity_t2d(config))
        ep = config.expert_predictor
        if ep is not None:
            self.expert_heads = nn.ModuleList(
                [nn.Linear(h, int(ep["num_experts"]), bias=False) for _ in ep["moe_layers"]]
            )
        else:
            self.expert_heads = None
        #: True when ``embed_tokens`` is the target's (absent from the checkpoint).
        self.embeddings_from_target = False
        self._missing_draft_keys: set[str] = set()
        self._missing_required_keys: set[str] = set()
        self.post_init()

    @staticmethod
    def _identity_t2d(config: Eagle3Config) -> torch.Tensor:
        # With d2t all zeros, draft id i is target id i: the first draft_vocab_size ids.
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        return t2d

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self:
            init.zeros_(self.d2t)
            init.copy_(self.t2d, self._identity_t2d(self.config))

    # -- loading / saving ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any):
        """Load a draft folder (public EAGLE-3 layout or ours).

        ``.bin`` weights are only read with ``torch.load(weights_only=True)``; asking for
        ``weights_only=False`` is refused.  A checkpoint without ``embed_tokens.weight``
        takes the target's embeddings in :meth:`attach_target_embeddings`.
        """
        if kwargs.get("weights_only", True) is not True:
            raise ValueError("Eagle3DraftModel only loads .bin checkpoints with weights_only=True")
        kwargs["weights_only"] = True
        kwargs.update(_layout_kwargs(pretrained_model_name_or_path, kwargs.get("config")))
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        loaded = model[0] if isinstance(model, tuple) else model
        missing = loaded._missing_draft_keys
        if missing & {"d2t", "t2d"} and not missing >= {"d2t", "t2d"}:
            loaded._complete_vocab_mapping(missing)  # ModelOpt exports ship d2t only
            missing = missing - {"d2t", "t2d"}
        if loaded._missing_required_keys:
            raise ValueError(
                f"EAGLE-3 checkpoint {pretrained_model_name_or_path} lacks weights: "
                f"{sorted(loaded._missing_required_keys)}"
            )
        if missing & {"d2t", "t2d"} and loaded.config.draft_vocab_size != loaded.config.vocab_size:
            raise ValueError(
                f"EAGLE-3 checkpoint {pretrained_model_name_or_path} has a reduced draft vocabulary "
                f"({loaded.config.draft_vocab_size} < {loaded.config.vocab_size}) but no d2t / t2d mapping"
            )
        if loaded.embeddings_from_target:
            # Free the random table now; the target's is attached before first use.
            loaded.embed_tokens.weight = nn.Parameter(
                torch.empty(0, loaded.config.hidden_size, dtype=loaded.fc.weight.dtype), requires_grad=False
            )
        return model

    @torch.no_grad()
    def _complete_vocab_mapping(self, missing: set[str]) -> None:
        """Derive the missing one of ``t2d`` / ``d2t`` from the other (they encode the same map)."""
        vd = self.config.draft_vocab_size
        if "t2d" in missing:
            ids = torch.arange(vd, device=self.d2t.device) + self.d2t
            if ids.min() < 0 or ids.max() >= self.config.vocab_size or not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError("the checkpoint's d2t does not map draft ids to increasing target ids")
            t2d = torch.zeros_like(self.t2d)
            t2d[ids] = True
            self.t2d.copy_(t2d)
        else:
            ids = torch.nonzero(self.t2d).reshape(-1)
            if ids.numel() != vd:
                raise ValueError(f"the checkpoint's t2d marks {ids.numel()} tokens, draft_vocab_size is {vd}")
            self.d2t.copy_(ids - torch.arange(vd, device=ids.device))
        self._missing_draft_keys -= {"d2t", "t2d"}

    def _adjust_missing_and_unexpected_keys(self, loading_info: Any) -> None:
        # Hook of transformers' loader (5.23): note which optional tensors the
        # checkpoint lacks, and keep them out of the "missing weights" report.
        super()._adjust_missing_and_unexpected_keys(loading_info)
        optional = {"embed_tokens.weight", "d2t", "t2d"}
        self._missing_draft_keys = set(loading_info.missing_keys) & optional
        self.embeddings_from_target = "embed_tokens.weight" in self._missing_draft_keys
        loading_info.missing_keys = set(loading_info.missing_keys) - optional
        self._missing_required_keys = set(loading_info.missing_keys)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Save in the public layout; borrowed target embeddings are left out."""
        if self.embeddings_from_target and kwargs.get("state_dict") is None:
            kwargs["state_dict"] = {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
        # State the feedback choice explicitly: other trainers read norm_output differently.
        self.config.eagle_config = {**(self.config.eagle_config or {}), "hidden_feedback": self.config.hidden_feedback}
        super().save_pretrained(save_directory, *args, **kwargs)
        # transformers records the Python class name; engines dispatch on the public one.
        self.config.architectures = ["LlamaForCausalLMEagle3"]
        self.config.save_pretrained(save_directory)

    def attach_target_embeddings(self, target: nn.Module) -> None:
        """Share the target's input embeddings when the checkpoint has none (no copy, no grad)."""
        if not self.embeddings_from_target:
            return
        weight = target.get_input_embeddings().weight
        if weight.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"the target's embeddings are {tuple(weight.shape)}, "
                f"the draft expects hidden size {self.config.hidden_size}"
            )
        if weight.shape[0] < self.config.vocab_size:
            raise ValueError(
                f"the target has {weight.shape[0]} embeddings, the draft vocab_size is {self.config.vocab_size}"
            )
        self.embed_tokens.weight = weight
        weight.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    # -- vocabulary mapping -------------------------------------------------------------
    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Set ``d2t`` / ``t2d`` from the target id of each draft id (strictly increasing)."""
        ids = torch.as_tensor(draft_to_target_ids, dtype=torch.long).reshape(-1)
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if ids.numel() != vd:
            raise ValueError(f"expected {vd} target ids, got {ids.numel()}")
        if ids.min() < 0 or ids.max() >= v or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft-to-target ids must be strictly increasing ids in [0, vocab_size)")
        dev = self.d2t.device
        self.d2t.copy_((ids - torch.arange(vd)).to(dev))
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        self.t2d.copy_(t2d.to(dev))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]

    def draft_to_target_host_fn(self) -> Callable[[np.ndarray], np.ndarray]:
        """:meth:`draft_to_target` for host (numpy) ids, as a function over ``d2t`` read to the
        host now.

        The tree drafter takes it once per ``generate`` call and maps its top-k ids after
        they reach the host: two small device ops per draft level saved.
        """
        d2t = self.d2t.cpu().numpy()
        return lambda draft_ids: draft_ids + d2t[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Map target ids to draft ids; ``-1`` for target tokens outside the draft vocabulary."""
        table = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        draft_ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        table[self.draft_to_target(draft_ids)] = draft_ids
        return table[target_ids]

    # -- building blocks ---------------------------------------------------------------
    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated low / mid / high target features ``[..., 3·H_t]``."""
        ht = self.config.target_hidden_size
        if target_features.shape[-1] != 3 * ht:
            raise ValueError(
                f"target features must have 3 x target_hidden_size = {3 * ht} channels, got {target_features.shape[-1]}"
            )
        fc = self.fc
        dtype = fc.weight.dtype
        x = target_features if target_features.dtype == dtype else target_features.to(dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.split(ht, dim=-1))], dim=-1)
        return fc(x)

    def embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        weight = self.embed_tokens.weight
        if weight.numel() == 0:
            raise RuntimeError(
                "this draft has no embed_tokens in its checkpoint; call attach_target_embeddings(target) first"
            )
        # The lookup of embed_tokens (a plain nn.Embedding: no padding index, no max norm)
        # without the module call and F.embedding's checks, and no .to() when the dtypes
        # agree: this runs in every draft forward, where each call costs microseconds.
        out = torch.embedding(weight, input_ids)
        dtype = self.fc.weight.dtype
        return out if out.dtype == dtype else out.to(dtype)

    def rotary(self, hidden: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        return self.rotary_emb(hidden, position_ids)

    def rotary_rows(self, positions: range | np.ndarray, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rotary` of host-known 1-D ``positions`` (a ``range`` or an int array), for inference.

        The rows come from a cached table of the rotary embedding's own output for positions
        ``0 .. n - 1`` (its ops are elementwise, so computing many positions at once gives
        the same values): a slice replaces the embedding's ten small ops in every draft
        forward.  Frequencies that change with the sequence length (dynamic / longrope
        scaling) are computed each time instead.
        """
        if isinstance(positions, range):
            if positions.step != 1:
                raise ValueError("rotary_rows takes ranges of step 1")
            start, stop, index = positions.start, positions.stop, None
        else:
            index = np.asarray(positions, dtype=np.int64).reshape(-1)
            start, stop = (int(index.min()), int(index.max()) + 1) if index.size else (0, 1)
        table = self._rotary_table(stop, like)
        if table is None:
            return self.rotary(like, torch.as_tensor(np.asarray(positions), device=like.device))
        cos, sin = table
        if index is None:
            return cos[:, start:stop], sin[:, start:stop]
        if stop - start == 1:  # one position (a tree level: every node at the same depth)
            return cos[:, start:stop].expand(1, index.size, -1), sin[:, start:stop].expand(1, index.size, -1)
        index = torch.from_numpy(index).to(cos.device)
        return cos.index_select(1, index), sin.index_select(1, index)

    def _rotary_table(self, size: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``[1, n, D]`` cos / sin of positions ``0 .. n - 1`` (``n >= size``) on ``like``'s device and
        dtype; ``None`` when the frequencies change with the sequence length."""
        rope = self.rotary_emb
        inv_freq = rope.inv_freq
        table = self.__dict__.get("_rope_table")  # a cache, not module state (not saved, not moved)
        if (
            table is not None
            and table[0] is inv_freq
            and table[1] == _version(inv_freq)
            and table[2] >= size
            and table[3] == like.dtype
            and table[4] == like.device
        ):
            return table[5]
        rope_type = str(rope.rope_type)
        if "dynamic" in rope_type or rope_type == "longrope":
            return None
        n = 1 << max(8, (size - 1).bit_length())  # grows by doubling
        cos_sin = rope(like, torch.arange(n, device=like.device)[None])
        self.__dict__["_rope_table"] = (inv_freq, _version(inv_freq), n, like.dtype, like.device, cos_sin)
        return cos_sin

    def step(
        self,
        input_ids: torch.LongTensor,
        hidden: torch.Tensor,
        position_ids: torch.LongTensor | None,
        attend: AttendFn,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the draft layer on pairs ``(hidden, token)``; returns the pre-norm output ``[B, T, H]``.

        ``rotary``: the positions' ``(cos, sin)`` when the caller has them (:meth:`rotary_rows`);
        ``position_ids`` is then unused.
        """
        cos, sin = self.rotary(hidden, position_ids) if rotary is None else rotary
        return self.midlayer(self.embed(input_ids), hidden, cos, sin, attend)

    def draft_forward(
        self,
        input_ids: torch.LongTensor,
        hidden: torch.Tensor,
        positions: range | np.ndarray,
        attend: AttendFn,
        next_hidden: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting forward over ``T`` rows, every op of it device work: the rotary rows of the host-known
        ``positions`` (:meth:`rotary_rows`), the draft layer (:meth:`step`) and the hidden state the next
        level reads (``next_hidden``: :meth:`next_hidden_fn`'s function, when the caller holds it).

        ``input_ids`` ``[1, T]``, ``hidden`` ``[T, H]``; returns ``(layer output [T, H], next hidden [T, H])``.
        One method for all of it, so a device twin charges the whole forward as one draft level
        (:mod:`specfit_hf.twin`) rather than this CPU's time for the ops around the layer.
        """
        rotary = self.rotary_rows(positions, hidden)
        out = self.step(input_ids, hidden[None], None, attend, rotary=rotary)[0]
        return out, (next_hidden or self.next_hidden_fn())(out)

    def top_children(self, layer_output: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` log-probs and draft-vocabulary ids ``[T, k]`` of each row's next token (on the model's
        device): :meth:`compute_logits`, a float32 log-softmax and a top-k, the device work of choosing a
        node's children (a device twin charges it as the ``lm_head`` and two more kernels)."""
        logits = self.compute_logits(layer_output)
        if logits.dtype != torch.float32:
            logits = logits.float()
        vals, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return vals, ids

    def compute_logits(self, layer_output: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of a layer output (``lm_head(norm(out))``)."""
        return self.lm_head(self.norm(layer_output))

    def next_hidden(self, layer_output: torch.Tensor) -> torch.Tensor:
        """The hidden state the next draft step consumes."""
        return self.next_hidden_fn()(layer_output)

    def next_hidden_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`next_hidden` for the current config, as a function (the tree drafter takes it
        once per ``generate`` call: reading the config costs microseconds every draft level)."""
        return self.norm if self.config.hidden_feedback == "post_norm" else _unchanged

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_features: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DraftKVCache | None = None,
        **kwargs: Any,
    ) -> Eagle3Output:
        """One parallel draft step over ``T`` pairs.

        Args:
            input_ids: ``[B, T]`` the token of each pair (target vocabulary).
            target_features: ``[B, T, 3·H_t]`` target features (projected by ``fc``), or
            hidden_states: ``[B, T, H]`` draft hidden states from a previous step.
            position_ids: ``[B, T]`` or ``[T]``; defaults to ``past + arange(T)``.
            attention_mask: additive float mask ``[B or 1, 1, T, past + T]``; default:
                full attention to the past, causal among the new rows.
            past_key_values: a :class:`DraftKVCache`, appended in place.
        """
        if (target_features is None) == (hidden_states is None):
            raise ValueError("pass exactly one of target_features or hidden_states")
        hidden = self.project_features(target_features) if target_features is not None else hidden_states
        b, t = input_ids.shape
        past = past_key_values.length if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device)
        attn = self.midlayer.self_attn

        def attend(q, k, v):
            if past_key_values is not None:
                k, v = past_key_values.append(k, v)
            mask = attention_mask
            if mask is None and past:
                mask = causal_mask(t, past, q.dtype, q.device)
            return attn.attend(q, k, v, mask)

        out = self.step(input_ids, hidden.to(self.fc.weight.dtype), position_ids, attend)
        return Eagle3Output(logits=self.compute_logits(out), hidden_states=self.next_hidden(out))

    # -- expert predictor ---------------------------------------------------------------
    def expert_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H] -> [N, L_moe, E]`` routing logits of the learned expert heads."""
        if self.expert_heads is None:
            raise ValueError("this draft has no expert predictor (config.expert_predictor is None)")
        heads = self.expert_heads
        if self.training or len(heads) == 1:
            hidden = hidden.to(self.fc.weight.dtype)
            return torch.stack([head(hidden) for head in heads], dim=-2)
        weight, bias = self._stacked_expert_heads()
        return _stacked_logits(hidden, weight, bias, len(heads))

    def _stacked_expert_heads(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The heads' weights (and biases) stacked into one matrix: inference runs the heads after every
        drafted cycle, one matmul over all of them.  Stacked again only when a head's weight is replaced
        or changed in place (its storage or version counter moves)."""
        # module attribute lookups go through nn.Module.__getattr__: read the parameters' dicts directly
        # (this check runs every cycle; through getattr it cost more than the matmul)
        params = [head._parameters for head in self.expert_heads._modules.values()]
        key = tuple([(w.data_ptr(), _version(w)) for w in (p["weight"] for p in params)])
        stacked = self.__dict__.get("_stacked_heads")
        if stacked is None or stacked[0] != key:
            bias = None if params[0].get("bias") is None else torch.cat([p["bias"] for p in params]).detach()
            stacked = (key, torch.cat([p["weight"] for p in params]).detach(), bias)
            self.__dict__["_stacked_heads"] = stacked
        return stacked[1], stacked[2]

    @torch.no_grad()
    def predict_experts(self, hidden: torch.Tensor, top_k: int | None = None) -> torch.LongTensor:
        """``[N, H] -> LongTensor [N, L_moe, k]``: top-k predicted experts per target MoE layer."""
        k = int(top_k or self.config.expert_predictor["top_k"])
        return self.expert_logits(hidden).topk(k, dim=-1).indices

    def expert_predictor_fn(self, top_k: int | None = None) -> Callable[[torch.Tensor], torch.LongTensor]:
        """:meth:`predict_experts` with the heads' weights as they are now, for a caller that predicts many
        times while they stay put (one ``generate`` call; call again after changing them).

        The same operations on the same stacked weights, so the same experts; without :meth:`predict_experts`'
        per-call checks (which heads, whether they changed, grad mode): inside a generation those were most
        of a prediction's host time (CPU, the embedded pair, inside a generation: 90-95 us a call against 59-73).
        """
        if self.expert_heads is None:
            raise ValueError("this draft has no expert predictor (config.expert_predictor is None)")
        k = int(top_k or self.config.expert_predictor["top_k"])
        weight, bias = self._stacked_expert_heads()  # detached: the result never joins autograd
        heads = len(self.expert_heads)

        def predict(hidden: torch.Tensor) -> torch.LongTensor:
            return _stacked_logits(hidden, weight, bias, heads).topk(k, dim=-1).indices

        return predict

    @property
    def expert_moe_layers(self) -> list[int]:
        """Target decoder-layer index of each expert head."""
        ep = self.config.expert_predictor
        return [] if ep is None else [int(i) for i in ep["moe_layers"]]

    # -- generation hook -----------------------------------------------------------------
    def make_tree_drafter(self, target: nn.Module, config: Any):
        """The :class:`~specfit_hf.generation.drafter.Drafter` the SpecFit loop drives."""
        # SpecFitConfig.tree_top_k is the branching factor (config.top_k is the sampling top-k).
        return Eagle3TreeDrafter(self, target, top_k=int(getattr(config, "tree_top_k", 8)))
