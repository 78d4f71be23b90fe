"""Hugging Face transformers (v5) MoE models with their routed experts in ``DeepEPMoELayer``.

transformers v5 MoE blocks keep their router and call an experts module as
``experts(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k])``; the module
stores its experts fused, ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
``down_proj [E, H, I]`` (``is_transposed`` modules: ``[E, H, 2I]`` and ``[E, I, H]``), and its
forward is looked up in ``transformers.integrations.moe.ExpertsInterface`` under
``config._experts_implementation``. This module registers ``"epmoe"`` there: the experts forward
becomes ``layer(hidden_states, topk_ids=top_k_index, topk_weights=top_k_weights)``. The router,
the shared experts (and Qwen2-MoE's shared-expert gate), attention and everything else stay the
model's; the layer takes the model's ids and weights as they are (no renormalization, no scaling:
the routers already applied theirs).

Three entries:

* :func:`enable` converts a loaded model in place (any scheme, optionally expert-parallel).
* ``from_pretrained(..., experts_implementation="epmoe")`` (after importing this module): BF16
  with the layer's defaults, converted at each experts module's first forward.
* :func:`from_pretrained` here builds the model on the meta device and reads only this rank's
  experts from the checkpoint (expert parallelism under ``torchrun``).

Tested with transformers 5.17.0 (GPU and CPU) and 5.24.0 (CPU) (:data:`TESTED_VERSIONS`). The loader uses transformers' own
checkpoint key renamings (``transformers.core_model_loading.rename_source_key``), an internal API.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface, _default_apply_gate

from ..checkpoint.names import expert_name
from ..layer import DeepEPMoELayer
from ..checkpoint.files import SafetensorsFile
from ..checkpoint.formats import INDEX_NAME
from ..checkpoint.reading import checkpoint_scheme
from ..quant.reference import dequantize_weight, quantize_weight
from ..quant.schemes import SCHEMES, get_scheme
from ..linear import DENSE_BACKENDS, Int8Linear
from ..tensors import check_bool, check_choice, resolve_device

log = logging.getLogger("epmoe")

IMPLEMENTATION = "epmoe"
"""The name under which the experts forward is registered in transformers' ExpertsInterface."""
TESTED_VERSIONS = ("5.17.0", "5.24.0")
LAYER_ATTR = "epmoe_layer"
"""The submodule of an experts module that holds its DeepEPMoELayer once converted."""
VALIDATE_DEFAULT = False
"""The layers' ``validate`` unless the caller passes one. The layer's per-batch value checks (ids in
range, finite weights) cost a host synchronisation per MoE layer and forward, which serialises an
eager decode step and forbids CUDA-graph capture; here they check what the model's own router
guarantees: its ids are a top-k over the model's ``E`` experts (the layer is built with that ``E``,
from the module's weights, at enable time), and its weights are finite unless the hidden states
are not, in which case the token's output is non-finite as in the eager model (never a plausible
wrong value). The shape, dtype and device checks still run on every forward (host-only, no sync).
Pass ``validate=True`` to have the value checks too."""
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
_SINGLE_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------ finding
def _family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__


def _is_interface_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts class wrapped by transformers' ``use_experts_implementation``
    (its __init__ sets these four flags)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


def _missing_features(module: nn.Module) -> list[str]:
    """What the layer cannot express about an interface experts module ([] when it can)."""
    missing = []
    if not module.has_gate:
        missing.append("experts without a gate projection (has_gate=False); the layer computes silu(gate) * up")
    if module.has_bias:
        missing.append("expert biases (gate_up_proj_bias / down_proj_bias); the layer's experts have none")
    if not module.is_concatenated:
        missing.append("interleaved gate/up rows (is_concatenated=False)")
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        missing.append(
            f"its own gating function {type(module).__name__}._apply_gate (e.g. GPT-OSS clamps gate and "
            "up and computes (up + 1) * gate * sigmoid(1.702 * gate)); the layer computes silu(gate) * up"
        )
    act = getattr(module, "act_fn", None)
    if not isinstance(act, (SiLUActivation, nn.SiLU)):
        name = getattr(getattr(module, "config", None), "hidden_act", type(act).__name__)
        missing.append(f"activation {name!r}; the layer computes SiLU")
    for attr in ("gate_up_proj", "down_proj"):
        if not isinstance(getattr(module, attr, None), torch.Tensor):
            missing.append(f"a fused {attr} tensor")
    return missing


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every MoE experts module of ``model`` that the layer can run.

    Raises:
        ValueError: the model has no MoE experts module, or one that the layer cannot express
            (the message names the model family, the module and what is missing).
    """
    family = _family(model)
    found = []
    for name, module in model.named_modules():
        if _is_interface_experts(module):
            missing = _missing_features(module)
            if missing:
                raise ValueError(
                    f"epmoe cannot run the experts of model family {family!r} ({name}: "
                    f"{type(module).__name__}): it has " + "; ".join(missing)
                )
            found.append((name, module))
        elif type(module).__name__.endswith("Experts") and not isinstance(module, nn.ModuleList):
            raise ValueError(
                f"epmoe cannot run the experts of model family {family!r} ({name}: {type(module).__name__}): "
                "the module is not called as experts(hidden_states, top_k_index, top_k_weights) through "
                "transformers' ExpertsInterface (Llama4, for one, multiplies the router scores into the "
                "experts' input and runs every expert on every token)"
            )
    if not found:
        raise ValueError(
            f"model family {family!r} ({type(model).__name__}) has no MoE experts module "
            "(no module built with transformers' use_experts_implementation): nothing for epmoe to run"
        )
    return found


def _fused_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate_up [E, 2I, H], down [E, H, I])`` views of the module's weights, whatever its layout."""
    w13, w2 = module.gate_up_proj, module.down_proj
    if module.is_transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    return w13, w2


def _shape(module: nn.Module) -> tuple[int, int, int]:
    """``(E, H, I)`` from the module's weights."""
    w13, w2 = _fused_weights(module)
    e, two_i, h = w13.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"{type(module).__name__}: gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} "
            "do not form [E, 2I, H] and [E, H, I]"
        )
    return e, h, two_i // 2


def _top_k(module: nn.Module) -> int:
    config = module.config
    for key in ("num_experts_per_tok", "moe_topk", "top_k"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    raise ValueError(f"{type(config).__name__} has no num_experts_per_tok: the experts' top-k is unknown")


# -------------------------------------------------------------------------------- the layer
ROUTING_KWARGS = (
    "renormalize", "scoring_func", "num_expert_group", "topk_group", "routed_scaling_factor", "use_correction_bias",
)  # fmt: skip
"""``DeepEPMoELayer`` arguments of its own routing, refused by the integration: the model's router
gives the layer its experts and weights."""


def build_layer(module: nn.Module, quant: str = "bf16", group=None, *, device=None, **layer_kwargs) -> DeepEPMoELayer:
    """A ``DeepEPMoELayer`` for one experts module, without touching the module.

    Args:
        module: an experts module of a transformers v5 MoE model (see :func:`experts_modules`).
        quant: the layer's scheme.
        group: process group for expert parallelism (``None``: the default group when one is
            initialized, else one process).
        device: where the layer lives (default: where the module's weights are; required when
            they are on the meta device).
        **layer_kwargs: more ``DeepEPMoELayer`` arguments (``backend``, ``dispatch``,
            ``accumulator``, ...). ``validate`` defaults to ``False`` here (see
            :data:`VALIDATE_DEFAULT`).

    Returns:
        The layer, its weights not loaded (NaN): :func:`load_module_experts` fills them.
    """
    if not _is_interface_experts(module):
        raise ValueError(f"{type(module).__name__} is not a transformers experts module (use_experts_implementation)")
    missing = _missing_features(module)
    if missing:
        raise ValueError(f"{type(module).__name__} cannot run in DeepEPMoELayer: it has " + "; ".join(missing))
    e, h, i = _shape(module)
    w13, _ = _fused_weights(module)
    if device is None:
        if w13.device.type == "meta":
            raise ValueError(f"{type(module).__name__} is on the meta device: pass device=")
        device = w13.device
    given = [k for k in ROUTING_KWARGS if k in layer_kwargs]
    if given:
        raise ValueError(
            f"{given[0]}={layer_kwargs[given[0]]!r}: the model's own router picks and weighs the experts "
            f"here, so routing arguments have no effect; allowed: none of {list(ROUTING_KWARGS)}"
        )
    kwargs = dict(layer_kwargs)
    kwargs.setdefault("validate", VALIDATE_DEFAULT)
    if not get_scheme(quant).quantized:
        kwargs.setdefault("params_dtype", w13.dtype)
    return DeepEPMoELayer(e, _top_k(module), h, i, quant=quant, group=group, device=device, **kwargs)


def _per_expert_tensors(expert: int, gate_up: torch.Tensor, down: torch.Tensor, scheme) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's float weights as ``load_weights`` names them, quantized for ``scheme``."""
    i = gate_up.shape[0] // 2
    for proj, w in (("gate_proj", gate_up[:i]), ("up_proj", gate_up[i:]), ("down_proj", down)):
        if not scheme.quantized:
            yield expert_name(expert, proj), w
            continue
        q, s = quantize_weight(w.unsqueeze(0).float(), scheme)
        suffix = "weight_scale" if scheme.weight_granularity == "channel" else "weight_scale_inv"
        yield expert_name(expert, proj), q[0]
        yield expert_name(expert, proj, suffix), s[0]


@torch.no_grad()
def load_module_experts(layer: DeepEPMoELayer, module: nn.Module) -> None:
    """Copy this rank's experts of ``module`` into ``layer``, one expert at a time (quantized on the
    device the weights are on: the temporaries are one expert's)."""
    w13, w2 = _fused_weights(module)
    for e in range(layer.first_expert, layer.first_expert + layer.num_local_experts):
        layer.load_weights(_per_expert_tensors(e, w13[e], w2[e], layer.scheme), strict=False)  # one expert per call


def _attach(module: nn.Module, layer: DeepEPMoELayer) -> None:
    """Give ``module`` its layer and drop its own expert weights (freed unless referenced elsewhere)."""
    for attr in ("gate_up_proj", "down_proj"):
        if attr in module._parameters:
            del module._parameters[attr]
        elif hasattr(module, attr):
            delattr(module, attr)
    module.add_module(LAYER_ATTR, layer)


def epmoe_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The ``"epmoe"`` experts forward registered in transformers' ``ExpertsInterface``.

    A module that :func:`enable` or :func:`from_pretrained` did not convert is converted at its
    first call: BF16 (in the weights' dtype), the layer's defaults, the default process group when
    one is initialized.
    """
    layer = self._modules.get(LAYER_ATTR)
    if layer is None:
        missing = _missing_features(self)
        if missing:
            raise ValueError(f"experts_implementation='epmoe' cannot run {type(self).__name__}: it has " + "; ".join(missing))
        layer = build_layer(self, "bf16")
        load_module_experts(layer, self)
        _attach(self, layer)
    return layer(hidden_states, topk_ids=top_k_index, topk_weights=top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, epmoe_experts_forward)


def _check_version() -> None:
    if transformers.__version__ not in TESTED_VERSIONS:
        log.warning(
            "transformers %s: epmoe's integration was tested with %s (the experts layout and "
            "interface it relies on may differ)", transformers.__version__, list(TESTED_VERSIONS),
        )  # fmt: skip


def _switch_implementation(model: nn.Module) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    for module in model.modules():  # experts modules share a config with the model, or a sub-config
        cfg = getattr(module, "config", None)
        if _is_interface_experts(module) and cfg is not None and cfg._experts_implementation != IMPLEMENTATION:
            cfg._experts_implementation_internal = IMPLEMENTATION


@torch.no_grad()
def enable(model: nn.Module, quant: str = "bf16", group=None, **layer_kwargs) -> nn.Module:
    """Run every routed-experts module of a loaded transformers MoE model through ``DeepEPMoELayer``.

    For each experts module: builds one layer holding this rank's ``E / ep`` experts (on the device
    the module's weights are on), copies them in one expert at a time (quantized there for an INT8
    / FP8 ``quant``), then drops the module's own fused weights, before the next module: peak
    memory is the model plus one MoE layer's experts in the layer's format. The module's forward
    then calls ``layer(hidden_states, topk_ids=top_k_index, topk_weights=top_k_weights)``.

    Args:
        model: a transformers v5 MoE model (``*ForCausalLM`` or its base model).
        quant: ``"bf16" | "int8_channel" | "int8_block" | "fp8_block"``.
        group: process group of expert parallelism (``None``: the default group when one is
            initialized, else one process). Every rank runs the whole model on its own batch.
        **layer_kwargs: more ``DeepEPMoELayer`` arguments (``backend``, ``dispatch``,
            ``accumulator``, ...; ``validate`` defaults to ``False``, :data:`VALIDATE_DEFAULT`);
            routing arguments (:data:`ROUTING_KWARGS`) are refused: the model routes.

    Returns:
        ``model``, converted in place.

    Raises:
        ValueError: ``quant`` unknown; the model was already enabled; it has no MoE experts
            module; or its experts need something the layer does not compute (biases, another
            activation or gating, Llama4's input-scaled experts): the message names the family.
    """
    if quant not in SCHEMES:
        raise ValueError(f"quant={quant!r}; allowed: {sorted(SCHEMES)}")
    if any(LAYER_ATTR in m._modules for m in model.modules()):
        raise ValueError(f"{type(model).__name__} is already enabled: its experts already run in DeepEPMoELayer")
    _check_version()
    modules = experts_modules(model)
    for name, module in modules:
        layer = build_layer(module, quant, group, **layer_kwargs)
        load_module_experts(layer, module)
        _attach(module, layer)
        log.info("epmoe: %s -> %s", name, layer.extra_repr())
    _switch_implementation(model)
    return model


# ---------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class LoadReport:
    """What :func:`from_pretrained` read and held on this rank.

    Attributes:
        checkpoint_bytes: bytes of every tensor in the checkpoint.
        bytes_read: bytes of the tensors this rank read (non-expert weights + its experts).
        peak_host_rss_bytes: the process's peak resident memory after loading (``ru_maxrss``).
        peak_gpu_bytes: ``torch.cuda.max_memory_allocated`` on the device (0 on CPU).
        local_experts: experts this rank holds per MoE layer, of ``num_experts``.
    """

    checkpoint_bytes: int
    bytes_read: int
    peak_host_rss_bytes: int
    peak_gpu_bytes: int
    local_experts: int
    num_experts: int


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters created inside go to the meta device; buffers (rotary tables) stay real."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _shards(root: Path) -> list[str]:
    index = root / INDEX_NAME
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (root / _SINGLE_FILE).is_file():
        return [_SINGLE_FILE]
    raise FileNotFoundError(f"{root} has neither {INDEX_NAME} nor {_SINGLE_FILE}")


def _expert_proj_names(model: nn.Module) -> dict[str, str]:
    """Checkpoint projection name -> ``gate_proj | up_proj | down_proj``, from transformers' own
    converters of the model (Mixtral: ``w1``, ``w3``, ``w2``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    names = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
    pat = re.compile(r"experts\.\*\.(\w+)\.weight$")
    for t in get_model_conversion_mapping(model):
        if not isinstance(t, WeightConverter):
            continue
        targets = [str(p) for p in t.target_patterns]
        sources = [m[1] for m in (pat.search(str(s)) for s in t.source_patterns) if m]
        if any(p.endswith("experts.gate_up_proj") for p in targets) and len(sources) == 2:
            names.update({sources[0]: "gate_proj", sources[1]: "up_proj"})
        elif any(p.endswith("experts.down_proj") for p in targets) and len(sources) == 1:
            names[sources[0]] = "down_proj"
    return names


def _renamer(model: nn.Module):
    """Checkpoint key -> model key, with transformers' renamings for this model (not its converters)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    meta = model.state_dict()

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [], model.base_model_prefix, meta)[0]

    return rename


def _dequantize(name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` from a stored 1-byte weight and its channel ``[N, 1]`` or block scale."""
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    try:
        return dequantize_weight(q.unsqueeze(0), scale.unsqueeze(0).float())[0]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _set_int8_linear(model: nn.Module, base: str, tensors: dict[str, torch.Tensor], device, accumulator, backend) -> None:
    """Replace the ``nn.Linear`` at ``base`` by an :class:`~epmoe.linear.Int8Linear` holding its
    stored INT8 weight and scale (``weight_scale`` ``[N, 1]``: ``int8_channel``; block
    ``weight_scale_inv``: ``int8_block``)."""
    parent_name, _, attr = base.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, attr, None)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{base}.weight is int8 but {base} is a {type(linear).__name__}, not an nn.Linear")
    scale = next(t for k, t in tensors.items() if k != "weight")
    scheme = "int8_channel" if tuple(scale.shape) == (linear.out_features, 1) else "int8_block"
    if scheme == "int8_channel" and accumulator is None:
        accumulator = "fp32"  # the experts' default, so one accumulator runs the whole model
    has_bias = linear.bias is not None
    module = Int8Linear(linear.in_features, linear.out_features, has_bias, scheme,
                        accumulator if scheme == "int8_channel" else None, backend, device=device)  # fmt: skip
    module.load_weights({k: t.to(device) for k, t in tensors.items()})
    if has_bias and linear.bias.device.type != "meta":  # read before the weight: carried over
        with torch.no_grad():
            module.bias.copy_(linear.bias.float())
    setattr(parent, attr, module)


def _has_place(key: str, expert, places: set[str], layers: dict) -> bool:
    """Whether checkpoint tensor ``key`` (``expert``: its match of the experts' name pattern) goes
    somewhere in the model: a parameter or buffer (a scale: beside its weight), or an expert of one
    of its MoE layers."""
    if expert is not None:
        return expert["module"] in layers
    base, _, kind = key.rpartition(".")
    return key in places or (kind in _SCALE_SUFFIXES and base + ".weight" in places)


def _set_tensor(model: nn.Module, key: str, tensor: torch.Tensor, device) -> None:
    path, _, attr = key.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        module = None
    current = None if module is None else module._parameters.get(attr, module._buffers.get(attr))
    if current is None:
        raise ValueError(
            f"checkpoint tensor {key!r} has no place in {type(model).__name__}; allowed: the names of "
            "its state_dict (or of its _keys_to_ignore_on_load_unexpected, which are skipped)"
        )
    if tuple(current.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}; the model has {tuple(current.shape)}")
    value = tensor.to(device=device, dtype=current.dtype if current.is_floating_point() else tensor.dtype)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


@torch.no_grad()
def from_pretrained(
    path,
    quant: str | None = None,
    group=None,
    device=None,
    dtype: torch.dtype | None = None,
    *,
    int8_dense: bool = False,
    dense_backend: str = "auto",
    **layer_kwargs,
) -> nn.Module:
    """Load a transformers MoE checkpoint directory with its experts in ``DeepEPMoELayer``,
    reading only this rank's experts.

    The model is built with its parameters on the meta device; every non-expert tensor is read
    and placed on ``device`` (attention and dense layers are replicated: each rank runs the whole
    model on its own batch); of the routed experts only this rank's ``E / ep`` are read, one expert
    at a time, straight into the layers. Reads ``save_pretrained`` directories (one file or
    sharded), ``epmoe convert`` outputs (INT8 experts) and DeepSeek-style FP8-block checkpoints.
    Non-expert weights stored as FP8 / INT8 with scales are dequantized to the model's dtype.

    Args:
        path: the checkpoint directory (``config.json`` + safetensors).
        quant: the layer's scheme; ``None``: the checkpoint's (``bf16`` for an unquantized one).
            A float checkpoint is quantized at load; an FP8 one can load as ``fp8_block`` or be
            requantized to INT8 / dequantized to ``bf16``; an INT8 one loads only as its own scheme.
        group: process group of expert parallelism (``None``: the default group if initialized).
        device: where the model runs (default: the current CUDA device, else CPU).
        dtype: the model's float dtype (default: the config's, else bfloat16).
        int8_dense: run every ``nn.Linear`` whose weight the checkpoint stores as INT8 (an
            ``epmoe convert --dense`` output: attention, dense MLPs, shared experts; without
            ``--dense`` only the shared experts) as an :class:`~epmoe.linear.Int8Linear` with the
            stored weight and scale, instead of dequantizing it. Its accumulator is the layer's
            ``accumulator`` (``int8_channel``; default fp32), its scheme the stored one.
        dense_backend: the ``Int8Linear`` backend (``"auto"``, ``"cutlass"``, ``"triton"``,
            ``"torch"``) with ``int8_dense``.
        **layer_kwargs: more ``DeepEPMoELayer`` arguments.

    Returns:
        The model in eval mode; ``model.epmoe_load_report`` is a :class:`LoadReport`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_version()
    root = Path(path)
    stored = checkpoint_scheme(root)
    quant = stored if quant is None else quant
    if quant not in SCHEMES:
        raise ValueError(f"quant={quant!r}; allowed: {sorted(SCHEMES)}")
    if stored in ("int8_channel", "int8_block") and quant != stored:
        raise ValueError(
            f"{root} stores {stored} experts; quant={quant!r} would requantize INT8 codes (load it "
            f"with quant={stored!r}, or convert the FP8 source to {quant!r})"
        )
    int8_dense = check_bool("int8_dense", int8_dense)
    check_choice("dense_backend", dense_backend, ("auto", *DENSE_BACKENDS))
    if int8_dense and stored not in ("int8_channel", "int8_block"):
        raise ValueError(
            f"int8_dense=True needs INT8 linear weights; {root} stores {stored} (convert the FP8 "
            "checkpoint with `epmoe convert --dense` first)"
        )
    device = resolve_device(device)
    config = AutoConfig.from_pretrained(root)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized / handed to the layers here
    if dtype is None:
        dtype = config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.bfloat16
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    modules = dict(experts_modules(model))
    layers = {}
    for name, module in modules.items():
        layers[name] = build_layer(module, quant, group, device=device, **layer_kwargs)
        _attach(module, layers[name])
    for buf_owner in model.modules():  # rotary tables and other buffers built on the CPU
        for k, b in list(buf_owner._buffers.items()):
            if b is not None and b.device.type != "meta":
                buf_owner._buffers[k] = b.to(device)
    rename, projs = _renamer(model), _expert_proj_names(model)
    expert_re = re.compile(
        r"^(?P<module>.*experts)\.(?P<e>\d+)\.(?P<proj>" + "|".join(map(re.escape, projs))
        + r")\.(?P<kind>weight|weight_scale|weight_scale_inv)$"
    )
    scheme = get_scheme(quant)
    total = read = 0
    pending: dict[str, dict] = {}  # non-expert 1-byte weights waiting for their scale (or reverse)
    experts: dict[tuple[str, int], dict[tuple[str, str], torch.Tensor]] = {}
    loaded = set()

    def finish_expert(mod: str, e: int, parts: dict) -> None:
        layer = layers[mod]
        quantized_src = any(k in _SCALE_SUFFIXES for _, k in parts)
        if len(parts) < (6 if quantized_src else 3):
            return
        if quantized_src and quant != stored:  # FP8 -> bf16 or INT8: dequantize, then quantize as enable does
            w = {p: _dequantize(f"{mod}.{e}.{p}", parts[(p, "weight")], next(v for (pp, k), v in parts.items() if pp == p and k != "weight")) for p in ("gate_proj", "up_proj", "down_proj")}
            tensors = _per_expert_tensors(e, torch.cat([w["gate_proj"], w["up_proj"]]).to(device), w["down_proj"].to(device), scheme)
        elif quantized_src:
            tensors = ((expert_name(e, p, k), v.to(device)) for (p, k), v in parts.items())
        else:
            tensors = _per_expert_tensors(e, torch.cat([parts[("gate_proj", "weight")], parts[("up_proj", "weight")]]).to(device), parts[("down_proj", "weight")].to(device), scheme)
        layer.load_weights(tensors, strict=False)  # one expert per call
        loaded.add((mod, e))
        del experts[(mod, e)]

    # What transformers skips too (DeepSeek-V3's multi-token-prediction layer 61): never read. As
    # there, a pattern only skips a tensor the model has no place for (GLM-4.5's patterns name its
    # layer 46, the MTP layer of the 46-layer Air and a real layer of the 92-layer model).
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    places = set(model.state_dict()) if ignored else set()
    skipped = 0
    for shard in _shards(root):
        f = SafetensorsFile(root / shard)
        for raw in sorted(f.tensors, key=lambda n: f.tensors[n].begin):
            total += f.tensors[raw].nbytes
            key = rename(raw)
            m = expert_re.match(key)
            if any(p.search(key) for p in ignored) and not _has_place(key, m, places, layers):
                skipped += 1
                continue
            if m is not None and m["module"] in layers:
                mod, e, layer = m["module"], int(m["e"]), layers[m["module"]]
                if not layer.first_expert <= e < layer.first_expert + layer.num_local_experts:
                    continue
                read += f.tensors[raw].nbytes
                parts = experts.setdefault((mod, e), {})
                parts[(projs[m["proj"]], m["kind"])] = f.read(raw)
                finish_expert(mod, e, parts)
                continue
            read += f.tensors[raw].nbytes
            t = f.read(raw)
            base, _, kind = key.rpartition(".")
            if kind in _SCALE_SUFFIXES or t.dtype in (torch.int8, torch.float8_e4m3fn):
                slot = pending.setdefault(base, {})
                slot[kind if kind in _SCALE_SUFFIXES else "weight"] = t
                if len(slot) == 2:
                    if int8_dense and slot["weight"].dtype == torch.int8:
                        _set_int8_linear(model, base, slot, device, layer_kwargs.get("accumulator"), dense_backend)
                    else:
                        scale = next(v for k, v in slot.items() if k != "weight")
                        _set_tensor(model, base + ".weight", _dequantize(base, slot["weight"], scale), device)
                    del pending[base]
                continue
            _set_tensor(model, key, t, device)
    if pending or experts:
        left = sorted(pending) + [f"{mod}.{e}" for mod, e in experts]
        raise ValueError(f"{root}: incomplete 1-byte weights or experts (weight or scale missing): {left[:5]}")
    for name, layer in layers.items():
        missing = [e for e in range(layer.first_expert, layer.first_expert + layer.num_local_experts) if (name, e) not in loaded]
        if missing:
            raise ValueError(f"{root} lacks experts {missing[:5]} of {name}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise ValueError(f"{root} lacks {len(still_meta)} tensors of the model, e.g. {still_meta[:5]}")
    _switch_implementation(model)
    model.eval()
    first = next(iter(layers.values()))
    report = LoadReport(
        checkpoint_bytes=total,
        bytes_read=read,
        peak_host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        local_experts=first.num_local_experts,
        num_experts=first.num_experts,
    )
    model.epmoe_load_report = report
    if skipped:
        log.info("epmoe: skipped %d checkpoint tensors that %s ignores (_keys_to_ignore_on_load_unexpected: %s)",
                 skipped, type(model).__name__, [p.pattern for p in ignored])
    log.info(
        "epmoe: loaded %s (%s experts, %d of %d per layer on rank %d): read %.1f of %.1f MB, peak RSS "
        "%.1f MB, peak GPU %.1f MB", root, quant, first.num_local_experts, first.num_experts, first.rank,
        read / 1e6, total / 1e6, report.peak_host_rss_bytes / 1e6, report.peak_gpu_bytes / 1e6,
    )  # fmt: skip
    return model


# ---------------------------------------------------------------------------- tiny models
_TINY_COMMON = dict(
    vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
_DEEPSEEK_MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
TINY_FAMILIES = {
    "deepseek_v3": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1,
        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, **_DEEPSEEK_MLA,
    ),
    # Kimi-K2 ships as DeepSeek-V3 (model_type deepseek_v3 in transformers): one expert group,
    # 384 experts top-8 at full size.
    "kimi_k2": dict(
        n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=128, first_k_dense_replace=1,
        n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.827, **_DEEPSEEK_MLA,
    ),
    "deepseek_v2": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1,
        n_shared_experts=2, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5, **{**_DEEPSEEK_MLA, "q_lora_rank": None},
    ),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, head_dim=64, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=128, head_dim=64),
    "glm4_moe": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1,
        n_group=1, topk_group=1, n_shared_experts=1, head_dim=64,
    ),
}
"""Small configurations of every tested family (hidden 128, expert intermediate 128: the block
schemes need multiples of 128), for trying the integration on a CPU."""


def tiny_config(family: str):
    """A transformers config of ``family`` (a key of :data:`TINY_FAMILIES`) at toy size."""
    from transformers import AutoConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"family={family!r}; allowed: {sorted(TINY_FAMILIES)}")
    model_type = "deepseek_v3" if family == "kimi_k2" else family
    return AutoConfig.for_model(model_type, **{**_TINY_COMMON, **TINY_FAMILIES[family]})
