"""Reading a checkpoint directory for the layer: which scheme its experts are stored in, the
layer's constructor arguments from ``config.json``, and one layer's routed-expert tensors."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from .files import read_json
from .formats import CONFIG_NAME, INDEX_NAME, QUANT_METHOD_SCHEME, SCALE_SUFFIX, SINGLE_FILE_NAME
from .names import PROJS, is_correction_bias, layer_index, parse_expert_name



def checkpoint_scheme(path: str | os.PathLike) -> str:
    """The epmoe scheme of the routed-expert weights of the checkpoint in ``path``.

    ``fp8`` -> ``fp8_block``, ``w8a8_int8`` -> ``int8_channel``, ``blockwise_int8`` ->
    ``int8_block``, no quantization_config -> ``bf16``.
    """
    config = read_json(Path(path) / CONFIG_NAME, "config")
    qc = config.get("quantization_config")
    if qc is None:
        return "bf16"
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in QUANT_METHOD_SCHEME:
        raise ValueError(
            f"{Path(path) / CONFIG_NAME}: quantization_config.quant_method={method!r}; "
            f"epmoe reads {sorted(QUANT_METHOD_SCHEME)} (or no quantization_config for bf16)"
        )
    return QUANT_METHOD_SCHEME[method]


# Routing each model family uses when its config.json does not spell it out (transformers 5 writes
# no scoring_func / topk_method for DeepSeek-V3): (keys of E and I, scoring, correction bias,
# renormalize default). Mixtral takes the softmax of the top-k logits: the same as softmax over all
# experts, then renormalized.
_FAMILIES = {
    "deepseek_v3": (("n_routed_experts",), "moe_intermediate_size", "sigmoid", "noaux_tc", True),
    "qwen3_moe": (("num_experts", "num_local_experts"), "moe_intermediate_size", "softmax", "greedy", False),
    "qwen2_moe": (("num_experts", "num_local_experts"), "moe_intermediate_size", "softmax", "greedy", False),
    "mixtral": (("num_local_experts",), "intermediate_size", "softmax", "greedy", True),
}
_TOPK_METHODS = {"noaux_tc": True, "greedy": False, "group_limited_greedy": False}  # -> correction bias


def layer_kwargs_from_config(path: str | os.PathLike) -> dict:
    """``DeepEPMoELayer`` constructor arguments read from a model's ``config.json``.

    DeepSeek-V3 keys (``n_routed_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
    ``n_group``, ``topk_group``, ``norm_topk_prob``, ``scoring_func``, ``routed_scaling_factor``,
    ``topk_method``) are read as written; what a config leaves out comes from its ``model_type``
    (``deepseek_v3``: sigmoid scoring, ``noaux_tc`` with the correction bias, as transformers 5
    writes it without those keys; ``qwen3_moe``, ``qwen2_moe``, ``mixtral``: softmax, no bias).
    ``quant`` comes from :func:`checkpoint_scheme`.

    Raises:
        ValueError: sizes missing, or routing that can be neither read nor derived from
            ``model_type`` (the layer refuses to guess: a wrong scoring function or a missing
            bias changes which experts most tokens go to).
    """
    cfg_path = Path(path) / CONFIG_NAME
    config = read_json(cfg_path, "config")
    model_type = config.get("model_type")
    family = _FAMILIES.get(model_type)
    expert_keys, inter_key, scoring, topk_method, renormalize = family or (
        ("n_routed_experts",), "moe_intermediate_size", None, None, True,
    )  # fmt: skip
    experts_key = next((k for k in expert_keys if k in config), expert_keys[0])
    required = (experts_key, "num_experts_per_tok", "hidden_size", inter_key)
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(
            f"{cfg_path} (model_type={model_type!r}) lacks {missing}; it does not describe an MoE "
            f"model epmoe can read (known model types: {sorted(_FAMILIES)})"
        )
    scoring = config.get("scoring_func", scoring)
    topk_method = config.get("topk_method", topk_method)
    if scoring is None or topk_method is None:
        absent = [k for k, v in (("scoring_func", scoring), ("topk_method", topk_method)) if v is None]
        raise ValueError(
            f"{cfg_path}: routing cannot be determined: no {absent} and model_type={model_type!r} "
            f"has no known default (known: {sorted(_FAMILIES)}); add the keys to config.json"
        )
    if topk_method not in _TOPK_METHODS:
        raise ValueError(f"{cfg_path}: topk_method={topk_method!r}; epmoe routes {sorted(_TOPK_METHODS)}")
    n_group, topk_group = config.get("n_group"), config.get("topk_group")
    grouped = n_group is not None and topk_group is not None and n_group > 1
    return {
        "num_experts": int(config[experts_key]),
        "top_k": int(config["num_experts_per_tok"]),
        "hidden_size": int(config["hidden_size"]),
        "intermediate_size": int(config[inter_key]),
        "quant": checkpoint_scheme(path),
        "renormalize": bool(config.get("norm_topk_prob", renormalize)),
        "scoring_func": scoring,
        "num_expert_group": int(n_group) if grouped else None,
        "topk_group": int(topk_group) if grouped else None,
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "use_correction_bias": _TOPK_METHODS[topk_method],
    }


def _weight_map(root: Path) -> tuple[dict[str, str], Path]:
    """``tensor name -> shard`` from the index (or of a single ``model.safetensors``), and the file
    it came from (for messages)."""
    if not (root / INDEX_NAME).exists() and (root / SINGLE_FILE_NAME).is_file():
        # save_pretrained writes one model.safetensors and no index when the model fits one shard.
        from safetensors import safe_open

        with safe_open(str(root / SINGLE_FILE_NAME), "pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE_NAME), root / SINGLE_FILE_NAME
    index = read_json(root / INDEX_NAME, "index")
    return index.get("weight_map") or {}, root / INDEX_NAME


def expert_ids(path: str | os.PathLike, layer: int) -> list[int]:
    """The sorted global ids of the routed experts of decoder layer ``layer`` in a checkpoint."""
    weight_map, _ = _weight_map(Path(path))
    ids = set()
    for name in weight_map:
        parsed = parse_expert_name(name)
        if parsed is not None and parsed.layer == int(layer):
            ids.add(parsed.expert)
    return sorted(ids)


def iter_expert_weights(
    path: str | os.PathLike,
    layer: int,
    experts: Iterable[int] | None = None,
    *,
    correction_bias: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the routed-expert tensors of decoder layer ``layer`` from a checkpoint directory.

    Yields ``(name, tensor)`` with the checkpoint's names (``model.layers.{L}.mlp.experts.{e}.
    {proj}.{weight|weight_scale|weight_scale_inv}``), one tensor read at a time, shard by shard, in
    the storage format of the checkpoint's scheme: pass the iterator to
    ``DeepEPMoELayer.load_weights``. ``experts`` restricts to those global expert ids.
    ``correction_bias`` also yields the layer's ``mlp.gate.e_score_correction_bias`` (for a layer
    built with ``use_correction_bias=True``).

    Raises:
        FileNotFoundError: neither an index nor a single ``model.safetensors``, or a missing shard.
        ValueError: the layer has no routed experts in the checkpoint, or a requested expert lacks
            one of its three projections.
    """
    from safetensors import safe_open

    root = Path(path)
    weight_map, where = _weight_map(root)
    wanted = None if experts is None else {int(e) for e in experts}
    layer = int(layer)
    by_shard: dict[str, list[str]] = {}
    found: dict[int, dict[str, str]] = {}
    layer_ids: set[int] = set()
    have_bias = False
    for name, shard in weight_map.items():
        if layer_index(name) != layer:
            continue
        if correction_bias and is_correction_bias(name) and name.endswith(".gate.e_score_correction_bias"):
            by_shard.setdefault(shard, []).append(name)
            have_bias = True
            continue
        parsed = parse_expert_name(name)
        if parsed is None or parsed.layer != layer:
            continue
        layer_ids.add(parsed.expert)
        if wanted is None or parsed.expert in wanted:
            by_shard.setdefault(shard, []).append(name)
            if parsed.kind == "weight":
                found.setdefault(parsed.expert, {})[parsed.proj] = name
    if not layer_ids:
        raise ValueError(f"{where} has no routed expert weights for layer {layer}")
    if correction_bias and not have_bias:
        raise ValueError(
            f"{where} has no e_score_correction_bias for layer {layer}; "
            "pass correction_bias=False for a model without one"
        )
    scheme = checkpoint_scheme(root)
    scale_suffix = SCALE_SUFFIX.get(scheme)
    for e in sorted(wanted if wanted is not None else found):
        have = found.get(e, {})
        if set(have) != set(PROJS):
            raise ValueError(
                f"layer {layer} expert {e}: checkpoint has projections {sorted(have)}; "
                "expected gate_proj, up_proj and down_proj"
            )
        for w in have.values():
            if scale_suffix is not None and w[: -len("weight")] + scale_suffix not in weight_map:
                raise ValueError(
                    f"{w!r} has no {scale_suffix!r}: a {scheme} checkpoint stores "
                    "one fp32 scale tensor with every expert weight"
                )
    for shard in sorted(by_shard):
        if not (root / shard).is_file():
            raise FileNotFoundError(f"shard {root / shard} named by {where.name} does not exist")
        with safe_open(str(root / shard), "pt") as f:
            held = set(f.keys())
            for name in sorted(by_shard[shard]):
                if name not in held:
                    raise ValueError(f"{where.name} maps {name!r} to {shard}, but that shard does not hold it")
                yield name, f.get_tensor(name)
