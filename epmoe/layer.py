"""``DeepEPMoELayer``: the routed experts of a DeepSeek-V3/R1-class MoE block under expert
parallelism. It builds the three seams (router, dispatcher, experts backend), checks the contract
between them once, and composes them per batch:

    route -> dispatch (quantize, send) -> experts (GEMM1, SiLU*up, GEMM2) -> weigh -> combine
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import loading
from .dispatch.base import LOW_LATENCY_PAYLOADS, DispatchConfig, Dispatched
from .dispatch.collective import check_agreement
from .dispatch.deepep_dispatch.sizing import expected_rows_per_expert
from .dispatch.select import select_dispatcher
from .experts.base import ExpertWeights
from .environment import requested
from .experts.select import select_backend
from . import ops
from .inputs import INPUT_DTYPES, check_forward_inputs, check_forward_values
from .layouts import ContiguousBatch, MaskedBatch, gather_weighted, to_contiguous
from .quant.payload import choose_payloads
from .quant.schemes import BLOCK, get_scheme
from .kernels.common import prep_refusal
from .routing import check_routing_config, fused_refusal, select_experts
from .tensors import as_contiguous, check_positive_int, host_reads_allowed, keeping_dtypes, resolve_device
from .timing import phase

log = logging.getLogger("epmoe")


def _resolve_group(group) -> tuple[object, int, int]:
    """``(group, world_size, rank)``; ``None`` means the default group when one exists."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"group={group!r}; allowed: None or a torch.distributed ProcessGroup")
    return group, dist.get_world_size(group), dist.get_rank(group)


class DeepEPMoELayer(nn.Module):
    """Routed experts with expert parallelism.

    Each of the ``world_size`` ranks of ``group`` owns ``num_experts / world_size`` consecutive
    experts (rank ``r`` owns global ids ``[r * E_loc, (r + 1) * E_loc)``) and holds only their
    weights.

    Args:
        num_experts: global routed experts ``E``.
        top_k: experts per token.
        hidden_size: ``H``.
        intermediate_size: ``I`` (per expert).
        quant: ``"bf16" | "int8_channel" | "int8_block" | "fp8_block"``.
        backend: ``"auto" | "torch" | "triton" | "deepgemm" | "cutlass"`` (env ``EPMOE_BACKEND``
            overrides ``"auto"``).
        dispatch: ``"auto" | "local" | "all_to_all" | "deepep_normal" | "deepep_low_latency" |
            "deepep_auto"`` (env ``EPMOE_DISPATCH`` overrides ``"auto"``).
        group: torch.distributed process group; ``None`` is the default group when one is
            initialized, else a single process.
        params_dtype: dtype of unquantized weights (``bf16`` scheme).
        device: where weights and tokens live (default: the current CUDA device, else CPU; the
            meta device under ``with torch.device("meta"):``). On ``"meta"`` the layer builds
            without choosing its backend and dispatcher; ``to_empty(device=...)`` (or ``.to``)
            chooses them for the device it lands on and logs the choice (a forced one that cannot
            run there raises then), then ``load_weights`` as usual. Forward on meta raises.
        renormalize, scoring_func, num_expert_group, topk_group, routed_scaling_factor: routing
            options, see :func:`epmoe.routing.select_experts`.
        use_correction_bias: hold an ``e_score_correction_bias [E]`` fp32 parameter (DeepSeek-V3).
        accumulator: ``"fp32"`` or ``"int32"`` cross-K accumulator (``int8_channel`` only).
        timeout_s: seconds a rank waits on a collective before raising.
        max_tokens_per_rank: capacity of low-latency dispatch (tokens per rank per batch).
        normal_max_tokens_per_rank: a bound on every rank's batch in DeepEP normal mode
            (``None``: no bound). With it the host does not wait for DeepEP's receive counts and,
            with a backend that keeps segment sizes on the device (``triton``), nothing between
            dispatch and combine waits for the GPU; receive buffers are then sized for
            ``world_size x`` this many tokens and expert buffers for ``top_k`` times that. With
            ``dispatch="deepep_normal"`` a larger batch raises on its rank (its peers then wait
            in DeepEP until its timeout); ``"deepep_auto"`` knows every rank's count and runs such a
            batch host-synced instead. ``validate=True`` still reads its checks back on the host
            before the dispatch.
        deepep_buffer: a :class:`epmoe.dispatch.DeepEPBuffer` shared by the layers of one
            group (created on demand when ``None`` and DeepEP is chosen).
        low_latency_int8_payload: for INT8 schemes over low-latency dispatch, ``"float"`` (send
            BF16, quantize after) or ``"fp8_group"`` (send FP8, requantize); see docs/dispatch-deepep.md.
        validate: check inputs (shapes, dtypes, expert-id range, finite router logits); range and
            finiteness checks cost a host sync and are skipped during CUDA-graph capture and while
            ``torch.compile`` traces (docs/compile.md).
        decode_prep: a small batch given with router logits on a dispatcher that moves nothing
            (``local``) has its routing, layout, scatter and activation quantization done by one
            kernel (:func:`epmoe.ops.decode_prep`) instead of three or four (a CUDA-graphed decode
            step pays a launch gap for each): ``None`` on CUDA, ``True`` on any device (on CPU
            under Triton's interpreter, as the tests run it), ``False`` never. It applies up to
            :data:`~epmoe.kernels.common.COPY_MAX_SLOTS` (token, slot) pairs within the prep's
            routing tile and the fused routing kernel's limits
            (:func:`~epmoe.kernels.common.prep_refusal`, :func:`~epmoe.routing.fused_refusal`),
            with a backend that takes device-sized segments (or, while ``torch.compile`` traces,
            one with ``compile_segments``); other batches take the separate kernels.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        quant: str = "bf16",
        backend: str = "auto",
        dispatch: str = "auto",
        group=None,
        params_dtype: torch.dtype = torch.bfloat16,
        device=None,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        use_correction_bias: bool = False,
        accumulator: str = "fp32",
        timeout_s: float = 300.0,
        max_tokens_per_rank: int = 128,
        normal_max_tokens_per_rank: int | None = None,
        deepep_buffer=None,
        low_latency_int8_payload: str = "float",
        validate: bool = True,
        decode_prep: bool | None = None,
    ) -> None:
        super().__init__()
        self.scheme = get_scheme(quant)
        num_experts, top_k, hidden_size, intermediate_size, max_tokens_per_rank = (
            check_positive_int(name, value) for name, value in (
                ("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size),
                ("intermediate_size", intermediate_size), ("max_tokens_per_rank", max_tokens_per_rank),
            )
        )  # fmt: skip
        _, num_expert_group, topk_group = check_routing_config(
            num_experts, top_k, scoring_func, num_expert_group, topk_group, routed_scaling_factor
        )
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if self.scheme.needs_block_alignment and value % BLOCK:
                raise ValueError(
                    f"{name}={value} must be a multiple of {BLOCK} for quant={quant!r} "
                    "(128x128 weight blocks, 1x128 activation groups)"
                )
        if params_dtype not in INPUT_DTYPES:
            raise ValueError(f"params_dtype={params_dtype}; allowed: {list(INPUT_DTYPES)}")
        if not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
        if low_latency_int8_payload not in LOW_LATENCY_PAYLOADS:
            raise ValueError(
                f"low_latency_int8_payload={low_latency_int8_payload!r}; allowed: "
                f"{list(LOW_LATENCY_PAYLOADS)}"
            )
        self.group, self.world_size, self.rank = _resolve_group(group)
        if num_experts % self.world_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the EP size {self.world_size} "
                "(each rank must own the same number of experts)"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_local_experts = num_experts // self.world_size
        self.first_expert = self.rank * self.num_local_experts
        self.params_dtype = params_dtype
        self.device = resolve_device(device)
        self.routing = dict(
            renormalize=renormalize,
            scoring_func=scoring_func,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
        )
        if decode_prep not in (None, True, False):
            raise ValueError(f"decode_prep={decode_prep!r}; allowed: None (on CUDA), True, False")
        self.validate = validate
        self.decode_prep = decode_prep
        self.low_latency_int8_payload = low_latency_int8_payload
        self._create_parameters(use_correction_bias)

        # What the seams are built from; on the meta device (a model built before its weights are
        # loaded) they are built when the layer lands on a real device (see _apply).
        self._request = dict(
            dispatch=requested("dispatch", dispatch, "EPMOE_DISPATCH"),
            backend=requested("backend", backend, "EPMOE_BACKEND"),
            accumulator=accumulator, timeout_s=timeout_s, max_tokens_per_rank=max_tokens_per_rank,
            normal_max_tokens_per_rank=normal_max_tokens_per_rank, deepep_buffer=deepep_buffer,
        )  # fmt: skip
        # The backend's view of the weights, rebuilt whenever a weight tensor is replaced or
        # written (keyed on storage and version counter), not per batch.
        self._prepared: tuple[tuple, ExpertWeights] | None = None
        self._bias_checked: tuple | None = None  # (storage, version) of the bias last found finite
        self.backend = self.dispatcher = None
        self._agreed = self.world_size == 1
        if self.device.type != "meta":
            self._build_seams()

    def _build_seams(self, agree: bool = True) -> None:
        """Select and build the dispatcher and the experts backend for ``self.device``; compare the
        arguments over the group now when ``agree`` (at build), else at the first forward."""
        r = self._request
        dispatch, backend, accumulator = r["dispatch"], r["backend"], r["accumulator"]
        normal_max_tokens_per_rank = r["normal_max_tokens_per_rank"]
        num_experts, top_k, quant = self.num_experts, self.top_k, self.scheme.name
        hidden_size, intermediate_size = self.hidden_size, self.intermediate_size

        # Availability needs only the sizes and the group; the backend is picked for the chosen
        # dispatcher's layouts; then the dispatcher is built from the complete (frozen) config.
        cfg = DispatchConfig(
            num_experts=num_experts,
            hidden_size=hidden_size,
            top_k=top_k,
            group=self.group,
            world_size=self.world_size,
            rank=self.rank,
            device=self.device,
            timeout_s=r["timeout_s"],
            max_tokens_per_rank=r["max_tokens_per_rank"],
            normal_max_tokens_per_rank=normal_max_tokens_per_rank,
            deepep_buffer=r["deepep_buffer"],
        )
        dispatcher_cls, dlines = select_dispatcher(dispatch.value, cfg, dispatch.label)
        backend_cls, blines = select_backend(
            backend.value, self.scheme, dispatcher_cls.layouts, self.device, hidden_size, intermediate_size,
            accumulator, backend.label,
        )
        self.backend = backend_cls(self.scheme, accumulator=accumulator)
        payload, low_latency_payload = choose_payloads(
            self.scheme, dispatcher_cls.payloads, self.low_latency_int8_payload
        )
        cfg = dataclasses.replace(
            cfg, alignment=self.backend.alignment, payload=payload, low_latency_payload=low_latency_payload
        )
        self.dispatcher = dispatcher_cls(cfg)
        if normal_max_tokens_per_rank is not None and "normal" not in getattr(dispatcher_cls, "modes_needed", ()):
            log.warning(
                "rank %d: normal_max_tokens_per_rank=%d has no effect with dispatch=%s (it bounds "
                "DeepEP normal mode only)", self.rank, normal_max_tokens_per_rank, self.dispatcher.name,
            )  # fmt: skip
        elif normal_max_tokens_per_rank is not None and not self.backend.device_segments:
            log.warning(
                "rank %d: backend %s needs host-side segment sizes: with normal_max_tokens_per_rank "
                "the layer reads the receive counts back itself (one host sync per normal batch)",
                self.rank, self.backend.name,
            )  # fmt: skip
        if self.decode_prep and not (self.dispatcher.keeps_rows and self.backend.device_segments):
            log.warning(
                "rank %d: decode_prep=True has no effect with dispatch=%s and backend=%s%s (it needs a "
                "dispatcher that moves nothing, 'local', and a backend that takes the segment sizes on "
                "the device, 'triton' or 'cutlass', or 'torch' under torch.compile): the routing, "
                "layout and quantization kernels run one by one", self.rank, self.dispatcher.name,
                self.backend.name, " outside torch.compile" if self.dispatcher.keeps_rows
                and self.backend.compile_segments else "",
            )  # fmt: skip
        if agree and not self._agreed:
            self._agree(self.device)
        for line in dlines + blines:
            log.info("rank %d: %s", self.rank, line)
        log.info(
            "rank %d: DeepEPMoELayer E=%d (local %d from %d) top_k=%d H=%d I=%d quant=%s "
            "backend=%s dispatch=%s payload=%s low_latency_payload=%s",
            self.rank, num_experts, self.num_local_experts, self.first_expert, top_k,
            hidden_size, intermediate_size, quant, self.backend.name, self.dispatcher.name,
            cfg.payload, cfg.low_latency_payload,
        )  # fmt: skip

    # ----------------------------------------------------------------------------- parameters
    def _create_parameters(self, use_correction_bias: bool) -> None:
        e, h, i = self.num_local_experts, self.hidden_size, self.intermediate_size
        wdtype = self.scheme.qdtype or self.params_dtype

        def param(*shape, dtype):
            # Never-loaded values are NaN where the dtype has one (float weights, every scale, the
            # bias): an expert left out of a load turns its tokens' outputs into NaN instead of
            # plausible zeros (int8 weights stay 0; their NaN scales carry it).
            fill = float("nan") if dtype.is_floating_point else 0
            return nn.Parameter(torch.full(shape, fill, dtype=dtype, device=self.device), requires_grad=False)

        self.w13_weight = param(e, 2 * i, h, dtype=wdtype)
        self.w2_weight = param(e, h, i, dtype=wdtype)
        s13 = self.scheme.weight_scale_shape(e, 2 * i, h)
        s2 = self.scheme.weight_scale_shape(e, h, i)
        self.w13_weight_scale = None if s13 is None else param(*s13, dtype=torch.float32)
        self.w2_weight_scale = None if s2 is None else param(*s2, dtype=torch.float32)
        self.e_score_correction_bias = (
            param(self.num_experts, dtype=torch.float32) if use_correction_bias else None
        )

    def _apply(self, fn, recurse=True):
        # Module dtype casts (model.to(torch.bfloat16), .half()) keep quantized weights, their
        # scales and the correction bias in their dtypes; device moves still move them.
        fixed = [self.w13_weight_scale, self.w2_weight_scale, self.e_score_correction_bias]
        if self.scheme.quantized:
            fixed += [self.w13_weight, self.w2_weight]
        out = super()._apply(keeping_dtypes(fn, fixed), recurse)
        if self.backend is None and self.w13_weight.device.type != "meta":
            # Materialized from the meta device (to_empty / to): select for the landing device now;
            # a forced choice that cannot run there raises here.
            self.device = resolve_device(self.w13_weight.device)
            self._build_seams(agree=False)  # materializing does not communicate; the first forward does
        return out

    def expert_weights(self) -> ExpertWeights:
        """The local experts' weights as the backend contract wants them."""
        return ExpertWeights(
            self.scheme, self.w13_weight, self.w2_weight, self.w13_weight_scale, self.w2_weight_scale
        )

    def load_experts(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> None:
        """Load weights of all ``E`` experts (global tensors); this rank keeps its slice.

        Args:
            w13: ``[E, 2I, H]`` in the scheme's storage dtype (int8 / e4m3 / float for bf16).
            w2: ``[E, H, I]``.
            w13_scale, w2_scale: fp32 scales of the scheme's shape over all ``E`` experts.
        """
        loading.load_experts(self, w13, w2, w13_scale, w2_scale)

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        strict: bool = True,
        *,
        prefix: str | None = None,
    ) -> set[str]:
        """Load checkpoint tensors named the DeepSeek/HF way.

        Names end in ``experts.{e}.{gate_proj|up_proj|down_proj}.{weight|weight_scale|
        weight_scale_inv}`` with a global expert id ``e`` (Mixtral's ``w1|w3|w2`` too), in
        ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` (the fused
        tensors of a transformers 5 ``state_dict()``), or in ``e_score_correction_bias``. Both scale
        names mean the multiplier that dequantizes (``w = q * scale``): ``[N, 1]`` per channel or
        ``[ceil(N/128), ceil(K/128)]`` per block. Experts of other ranks are skipped. A slot filled
        twice in one call is an error, so a whole checkpoint cannot silently overwrite one layer
        with another's experts. Every tensor is checked before any is copied.

        Args:
            named_tensors: ``(name, tensor)`` pairs or a mapping (``safetensors.load_file``, a
                ``state_dict``): one MoE layer's, or a whole checkpoint's with ``prefix``.
            strict: as in ``nn.Module.load_state_dict``: every tensor of this rank's experts (and
                the correction bias, when the layer has one) must be given, else ``ValueError``
                naming the first missing ones and the count (:meth:`expected_weight_names` lists
                them); without ``prefix``, a name that is not an expert tensor is an error too.
                ``False`` loads what is given and skips the rest.
            prefix: the MoE block's prefix in the checkpoint (``"model.layers.3.mlp."``,
                ``"model.layers.3.block_sparse_moe."`` for Mixtral): only names under it are
                considered, and of those only the routed experts and the correction bias are
                loaded; the router weight, shared experts and everything else are ignored.

        Returns:
            The names that were loaded into this rank's parameters.
        """
        return loading.load_weights(self, named_tensors, strict, prefix)

    def expected_weight_names(self, prefix: str = "") -> list[str]:
        """The checkpoint names a strict :meth:`load_weights` needs on this rank: every tensor of
        this rank's experts under its global id (``{prefix}experts.{e}.{proj}.weight``, and
        ``.weight_scale`` / ``.weight_scale_inv`` as the scheme's checkpoints name the scale), then
        ``{prefix}gate.e_score_correction_bias`` when the layer has a correction bias. Use it to
        read only this rank's tensors from a checkpoint."""
        return loading.expected_weight_names(self, prefix)

    # ---------------------------------------------------------------------------------- forward
    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, E]`` logits -> ``(topk_ids [T, k] int64, topk_weights [T, k] fp32)``."""
        self._check_bias()
        return select_experts(
            router_logits, self.top_k, correction_bias=self.e_score_correction_bias, **self.routing
        )

    def _check_bias(self) -> None:
        """Refuse a correction bias with NaN / Inf (never loaded, or a broken checkpoint): it would
        route every token to the same experts with finite, wrong outputs. Checked once per bias
        tensor and version (one host sync after each load, none per batch), whatever ``validate``
        and the batch size, so every rank of a group raises at the same batch."""
        bias = self.e_score_correction_bias
        if bias is None or bias.device.type == "meta":
            return
        if not host_reads_allowed(self.device):
            return  # under capture or compile: checked by the eager forwards (warm-up) only
        key = (bias.data_ptr(), bias._version)
        if key == self._bias_checked:
            return
        if not bool(torch.isfinite(bias).all()):
            raise ValueError(
                "e_score_correction_bias holds NaN or Inf: it was never loaded (load_weights with the "
                "checkpoint's mlp.gate.e_score_correction_bias, e.g. iter_expert_weights(..., "
                "correction_bias=True)) or was loaded with non-finite values"
            )
        self._bias_checked = key

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        *,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed-experts output for this rank's tokens.

        Args:
            hidden_states: ``[T, H]`` bf16/fp16/fp32 (``T = 0`` allowed).
            router_logits: ``[T, E]``; or instead ``topk_ids [T, k]`` (int, global ids) and
                ``topk_weights [T, k]``. An id of ``-1`` (padding, as DeepEP and vLLM use it)
                selects no expert: the slot contributes nothing, whatever its weight, with every
                dispatcher and with ``validate`` on or off (a token whose slots are all ``-1`` gets
                zeros). Any other negative id, or one ``>= num_experts``, is refused by
                ``validate=True``.

        Across ranks: the layer compares its arguments over the group once (one small
        collective, when it is built; at its first forward when built on the meta device) and
        raises :class:`~epmoe.dispatch.RankMismatchError` on every rank naming the first that
        differs; a batch whose input dtype differs between
        the ranks raises the same way with ``all_to_all`` (its per-batch header carries it; with
        DeepEP the rows travel as BF16 or the layer's fixed payload whatever the input dtype).

        Returns:
            ``[T, H]`` in the dtype of ``hidden_states``. A NaN/Inf in a token's hidden state makes
            that token's output non-finite and leaves the other tokens' outputs unchanged.
        """
        if self.backend is None:
            raise RuntimeError(
                "DeepEPMoELayer is on the meta device: materialize it first (layer.to_empty(device=...) "
                "then load_weights); the backend and dispatcher are chosen for the device it lands on"
            )
        check_forward_inputs(
            hidden_states, router_logits, topk_ids, topk_weights, hidden_size=self.hidden_size,
            num_experts=self.num_experts, top_k=self.top_k, device=self.device,
        )  # fmt: skip
        if self.validate:
            check_forward_values(
                router_logits, topk_ids, topk_weights, num_experts=self.num_experts, device=self.device,
                dispatch_name=self.dispatcher.name, distinct_experts="masked" in self.dispatcher.layouts,
            )  # fmt: skip
        if not self._agreed:
            self._agree(hidden_states.device)
        if router_logits is not None and self._uses_prep(hidden_states, router_logits):
            with phase("epmoe.prep"):
                batch, weights = self._prep_batch(hidden_states, router_logits)
            # The dispatcher keeps the rows where they are: nothing to send, nothing to combine.
            return self._experts_and_gather(batch, weights, hidden_states.dtype)
        if router_logits is not None:
            with phase("epmoe.route"):
                topk_ids, topk_weights = self.route(router_logits)
        # as_contiguous: no-op conversions cost microseconds of host time, which eager decode pays.
        ids, weights = as_contiguous(topk_ids, torch.int64), as_contiguous(topk_weights, torch.float32)
        with phase("epmoe.dispatch"):
            dispatched = self.dispatcher.dispatch(hidden_states, ids, weights)
        y = self._run_experts(dispatched, hidden_states.dtype)
        with phase("epmoe.combine"):
            out = self.dispatcher.combine(y, dispatched)
        return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)

    def _fingerprint(self) -> dict:
        """What every rank must agree on (their wire formats and sizes follow from it). Before the
        seams are chosen (a layer still on the meta device) the requested dispatcher stands in for
        the chosen one and the payloads and alignment are not known yet."""
        r, d = self._request, self.dispatcher
        cfg = d.cfg if d is not None else None
        return {
            "quant": self.scheme.name, "num_experts": self.num_experts, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "top_k": self.top_k,
            "dispatch": d.name if d is not None else r["dispatch"].value,
            "payload": cfg.payload if cfg else "not chosen",
            "low_latency_payload": cfg.low_latency_payload if cfg else "not chosen",
            "accumulator": r["accumulator"], "params_dtype": self.params_dtype,
            "alignment": cfg.alignment if cfg else "not chosen", "max_tokens_per_rank": r["max_tokens_per_rank"],
            "normal_max_tokens_per_rank": r["normal_max_tokens_per_rank"],
        }  # fmt: skip

    def _agree(self, device: torch.device) -> None:
        """Compare the fingerprint over the group: one small all-gather, once per layer.

        At build, so that a mismatch surfaces where the arguments are, before a checkpoint is
        loaded into a layer that cannot run (every rank builds its layers in the same order, as
        it will call them). A layer built on the meta device must not communicate (nothing is
        materialized yet, and the collective's tensor needs a real device): it compares at its
        first forward instead, which is collective anyway. A mismatch raises on every rank,
        before any token moves."""
        if not host_reads_allowed(device):
            raise RuntimeError(
                "the first forward of a DeepEPMoELayer compares its arguments over the group (one "
                "collective); run one batch eagerly before capturing a CUDA graph or compiling"
            )
        check_agreement(
            {k: str(v) for k, v in self._fingerprint().items()}, what="DeepEPMoELayer arguments",
            group=self.group, device=device, rank=self.rank, world=self.world_size,
            timeout_s=self._request["timeout_s"],
        )  # fmt: skip
        self._agreed = True

    def _weights(self) -> ExpertWeights:
        if torch.compiler.is_compiling():
            # Traced into the graph (contiguous views and fp32 scales: no-ops on loaded
            # weights); the eager cache's storage pointers do not exist on fake tensors.
            return self.backend.prepare_weights(self.expert_weights())
        weights = self.expert_weights()
        tensors = (weights.w13, weights.w2, weights.w13_scale, weights.w2_scale)
        key = tuple(None if t is None else (t.data_ptr(), t._version, t.dtype, t.shape) for t in tensors)
        if self._prepared is None or self._prepared[0] != key:
            self._prepared = (key, self.backend.prepare_weights(weights))
        return self._prepared[1]

    def _contiguous_batch(self, d: Dispatched) -> ContiguousBatch:
        """What arrived, laid out for the backend: sized on the device from the segment hint
        (aligned for the kernel that batch size runs on), else from the host sizes."""
        hint = self._segment_hint(d)
        align = self.backend.alignment if hint is None else self.backend.alignment_for(hint, self.device)
        rows = d.padded_rows if hint is None else None  # host sizes, or the hint's device sizes
        return to_contiguous(
            d.x, d.x_scale, d.topk_ids, self.num_local_experts, align, rows, expected_m=hint,
            scale_mn_major=self.backend.mn_major_scales,
        )

    def _run_experts(self, d: Dispatched, dtype: torch.dtype) -> torch.Tensor:
        """Experts on what arrived; returns what ``combine`` takes."""
        if d.layout == "masked":
            batch = MaskedBatch(d.x, d.x_scale, d.masked_m, d.expected_m)
            with phase("epmoe.experts"):
                return self.backend.run_masked(batch, self._weights(), dtype)
        with phase("epmoe.scatter"):
            batch = self._contiguous_batch(d)
        weights = d.topk_weights
        if d.combine_applies_weights:
            weights = torch.ones_like(weights)
        return self._experts_and_gather(batch, weights, dtype)

    def _experts_and_gather(self, batch: ContiguousBatch, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The experts on a contiguous batch, then each token's weighted sum of its rows."""
        with phase("epmoe.experts"):
            out = self.backend.run_contiguous(batch, self._weights(), dtype)
        with phase("epmoe.gather"):
            return gather_weighted(out, batch.slot_pos, weights, dtype)

    def _uses_prep(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> bool:
        """Whether this batch runs its glue before the experts as one decode-prep launch (see
        ``decode_prep``): decided from the configuration and the shapes only (traceable)."""
        if self.decode_prep is False or not self.dispatcher.keeps_rows:
            return False
        if not (hidden_states.is_cuda or self.decode_prep):
            return False
        b = self.backend
        if not (b.device_segments or (torch.compiler.is_compiling() and b.compile_segments)):
            return False
        t, e = router_logits.shape
        return fused_refusal(e, self.top_k) is None and prep_refusal(t, self.top_k, e) is None

    def _prep_batch(self, hidden_states: torch.Tensor, router_logits: torch.Tensor):
        """``(ContiguousBatch, topk_weights)`` of a batch from one decode-prep launch: what routing,
        the payload's quantizer and the device-sized scatter give (:meth:`_contiguous_batch`'s
        layout for the local dispatcher's hint), every expert local."""
        self._check_bias()
        hint = expected_rows_per_expert(hidden_states.shape[0], 1, self.top_k, self.num_local_experts)
        align = self.backend.alignment_for(hint, self.device)
        _, weights, offsets, slot_pos, m_indices, counts, x, x_scale = ops.decode_prep(
            router_logits, self.top_k, hidden_states, alignment=align, payload=self.dispatcher.cfg.payload,
            correction_bias=self.e_score_correction_bias, scale_mn_major=self.backend.mn_major_scales, **self.routing,
        )  # fmt: skip
        return ContiguousBatch(x, x_scale, offsets, m_indices, slot_pos, counts, hint, align), weights

    def _segment_hint(self, d: Dispatched) -> int | None:
        """``expected_m`` for the scatter: a rows-per-expert hint when the segment sizes are to
        stay on the device (no host read), ``None`` for a batch sized on the host.

        Device sizes need a backend that takes them (``device_segments``, or ``compile_segments``
        while dynamo traces) and no host sizes from the dispatcher. A backend that picks its
        kernels by the host's row counts (``prefers_host_sizes``) gets them in eager mode unless
        the dispatcher already skipped the read; while a CUDA graph is captured or dynamo traces,
        nothing may read back, so every such backend gets device sizes then. Dispatchers that
        did not wait for their counts give the hint; otherwise it is the mean over the slots."""
        b = self.backend
        compiling = torch.compiler.is_compiling()
        # Traced, host sizes would be baked into the graph as constants (a recompile per batch):
        # a dispatcher's host list is ignored then and the sizes stay on the device.
        if d.padded_rows is not None and not compiling:
            return None
        if not (b.device_segments or (compiling and b.compile_segments)):
            return None
        if d.expected_m is not None:
            return d.expected_m
        if b.prefers_host_sizes and host_reads_allowed(self.device):
            return None
        return expected_rows_per_expert(d.topk_ids.shape[0], 1, d.topk_ids.shape[1], self.num_local_experts)

    @property
    def payload(self) -> str:
        """What activations travel as: the low-latency payload for a dispatcher that only has that
        path, else the normal one (an auto dispatcher uses both)."""
        cfg = self.dispatcher.cfg
        if self.dispatcher.layouts == frozenset({"masked"}):
            return cfg.low_latency_payload
        if "masked" in self.dispatcher.layouts:
            return f"{cfg.payload}|{cfg.low_latency_payload}"
        return cfg.payload

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts}, top_k={self.top_k}, "
            f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"quant={self.scheme.name}, backend={self.backend.name}, dispatch={self.dispatcher.name}"
        )
