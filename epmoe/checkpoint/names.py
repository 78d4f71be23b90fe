"""The one parser of routed-expert tensor names in DeepSeek / Hugging Face checkpoints.

A routed-expert tensor is named ``{prefix}experts.{e}.{proj}.{kind}``: ``e`` a global expert id,
``proj`` one of ``gate_proj``, ``up_proj``, ``down_proj``, ``kind`` one of ``weight``,
``weight_scale`` (per-channel INT8 checkpoints) or ``weight_scale_inv`` (block-scaled FP8 / INT8
checkpoints; despite the name, also the multiplier that dequantizes). ``prefix`` is everything
before it, ``model.layers.{L}.mlp.`` in DeepSeek-V3 checkpoints. The router's correction bias ends
in ``e_score_correction_bias`` (``model.layers.{L}.mlp.gate.e_score_correction_bias``); shared
experts are ``{prefix}shared_experts.{proj}.weight``.

Two other spellings of the same tensors are read too: Mixtral's ``experts.{e}.{w1|w3|w2}.weight``
(gate, up, down; what transformers' ``save_pretrained`` writes for Mixtral), and the fused
tensors transformers 5 keeps in memory (``model.state_dict()``): ``{prefix}experts.gate_up_proj``
``[E, 2I, H]`` (gate rows, then up rows) and ``{prefix}experts.down_proj`` ``[E, H, I]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PROJS = ("gate_proj", "up_proj", "down_proj")
KINDS = ("weight", "weight_scale", "weight_scale_inv")
CORRECTION_BIAS = "e_score_correction_bias"

_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?)experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\."
    r"(?P<kind>weight|weight_scale|weight_scale_inv)$"
)
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED = re.compile(r"^(?P<prefix>(?:.*\.)?)experts\.(?P<proj>gate_up_proj|down_proj)$")
_BIAS = re.compile(rf"(?:^|\.){CORRECTION_BIAS}$")
_SHARED = re.compile(r"(?:^|\.)shared_experts\.(?:gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

EXPECTED_FORMS = (
    "'experts.<id>.<gate_proj|up_proj|down_proj>.<weight|weight_scale|weight_scale_inv>' (or "
    f"Mixtral's w1|w3|w2), 'experts.<gate_up_proj|down_proj>' (fused, all experts) or '{CORRECTION_BIAS}'"
)
"""The accepted name forms, as error messages state them."""


@dataclass(frozen=True)
class ExpertTensorName:
    """One parsed routed-expert tensor name.

    Attributes:
        prefix: the text before ``experts.`` (``"model.layers.3.mlp."``; ``""`` when none).
        expert: the global expert id.
        proj: ``"gate_proj" | "up_proj" | "down_proj"``.
        kind: ``"weight" | "weight_scale" | "weight_scale_inv"``.
    """

    prefix: str
    expert: int
    proj: str
    kind: str

    @property
    def is_scale(self) -> bool:
        return self.kind != "weight"

    @property
    def layer(self) -> int | None:
        """The decoder layer named by ``layers.{L}.`` in the prefix, if any."""
        return layer_index(self.prefix)


def parse_expert_name(name: str) -> ExpertTensorName | None:
    """The parts of a routed-expert tensor name, or ``None`` for any other name."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    return ExpertTensorName(m["prefix"], int(m["expert"]), _MIXTRAL.get(m["proj"], m["proj"]), m["kind"])


def parse_fused_expert_name(name: str) -> tuple[str, str] | None:
    """``(prefix, "gate_up_proj" | "down_proj")`` for a fused all-experts tensor of transformers 5
    (``{prefix}experts.gate_up_proj`` ``[E, 2I, H]``, ``{prefix}experts.down_proj`` ``[E, H, I]``),
    else ``None``."""
    m = _FUSED.match(name)
    return None if m is None else (m["prefix"], m["proj"])


def expert_name(expert: int, proj: str, kind: str = "weight", prefix: str = "") -> str:
    """``{prefix}experts.{expert}.{proj}.{kind}``: the inverse of :func:`parse_expert_name`."""
    return f"{prefix}experts.{expert}.{proj}.{kind}"


def is_correction_bias(name: str) -> bool:
    """Whether ``name`` is a router's ``e_score_correction_bias``."""
    return _BIAS.search(name) is not None


def is_shared_expert_weight(name: str) -> bool:
    """Whether ``name`` is the weight of a DeepSeek shared expert (``shared_experts.{proj}.weight``)."""
    return _SHARED.search(name) is not None


def layer_index(name: str) -> int | None:
    """The decoder layer ``L`` of a name that contains ``layers.{L}.``, else ``None``."""
    m = _LAYER.search(name)
    return None if m is None else int(m[1])
