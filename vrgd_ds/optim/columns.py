"""The kernel interface's data: the per-segment tables the kernels take, by name (one schema
per kernel, written once), the GSNR placements by index, and the failure a compiled kernel raises.

Every kernel call gets a contiguous float64 table ``[S, k]`` with one row per segment; the
three implementations read its columns by these names — the reference through ``COL``, the
C++ kernels through the ``col::k...`` constants in ``_fused/kernels.cpp``, the Triton kernels
through the constants in ``_triton.py`` — and a test checks that all three agree with the
schemas here. The first three columns of every schema are the GSNR scale's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

Tensors = Sequence[Tensor]

GSNR = ("inv_mean", "lo", "bc3")  # 1/mean r of the tensor, the lower clamp (gamma, or 1 without information),
#                                   the bias correction of the GSNR momentum
NORMS = GSNR  # scaled_grad_norms
SGD = GSNR + ("lr_mult", "first")  # sgd_step: LARS local LR (else 1), the momentum buffer's first step (1/0)
ADAM = GSNR + ("bc1", "bc2s", "grad_mult")  # adam_step: 1 - beta1^t, sqrt(1 - beta2^t), NVLAMB pre-normalisation
LAMB_APPLY = GSNR + ("bc1", "bc2s", "trust")  # lamb_apply: as ADAM, and the trust ratio

SCHEMAS = {"norms": NORMS, "sgd": SGD, "adam": ADAM, "lamb_apply": LAMB_APPLY}

#: Where the Adam family applies the GSNR scale p̂, by the index the kernels take
#: (``Placement`` in ``_fused/kernels.cpp``): the first moment only (m from p̂ ⊙ g, v from g²),
#: both moments (cancels in m̂/√v̂ wherever p̂ is steady), or the final update m̂/(√v̂+eps).
PLACEMENTS = ("first_moment", "both_moments", "update")
FIRST_MOMENT, BOTH_MOMENTS, UPDATE = range(3)


@dataclass(eq=False)
class BucketTable:
    """Where each segment of a flat local gradient (an engine's bucket, or one parameter's
    gradient) goes in a statistics buffer: ``rows``, a host int64 ``[S, 5]`` of (start in the
    source, start of its scaled gradient in the buffer, start of its squares in the buffer,
    length, accumulate 1/0). A table is built once per bucket layout and reused every
    micro-step; ``cache`` keeps what an implementation derives from it (the Triton kernels'
    device chunk table), so a steady micro-step does no table work."""

    rows: Tensor
    cache: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rows.dtype != torch.long or self.rows.dim() != 2 or self.rows.shape[1] != 5 \
                or self.rows.device.type != "cpu":
            raise ValueError("a bucket table is a host int64 [S, 5] tensor (source start, gradient start, squares "
                             "start, length, accumulate)")
        self.rows = self.rows.contiguous()

    @property
    def segments(self) -> int:
        return self.rows.shape[0]

    def check(self, src: Tensor, out: Tensor, with_g: bool, main: Tensor | None = None) -> None:
        """``Kernels.pack_bucket``'s arguments, from shapes alone (no device read): a contiguous
        source the table stays inside, a contiguous fp32 buffer that holds every destination
        (``with_g``: a gradient is written too), a ``main`` shaped like the source."""
        if not src.is_contiguous() or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("pack_bucket: a contiguous source and a contiguous fp32 buffer")
        if main is not None and (not main.is_contiguous() or main.numel() != src.numel()
                                 or main.dtype not in (torch.float32, src.dtype)):
            raise ValueError("pack_bucket: main must be contiguous, as long as the source, fp32 or the source's dtype")
        ends = self.cache.get("ends")
        if ends is None:
            r = self.rows
            if self.segments:
                lo = int(r[:, :3].min())
                ends = (lo, int((r[:, 0] + r[:, 3]).max()), int((r[:, 1] + r[:, 3]).max()),
                        int((r[:, 2] + r[:, 3]).max()))
            else:
                ends = (0, 0, 0, 0)
            self.cache["ends"] = ends
        if ends[0] < 0 or ends[1] > src.numel():
            raise ValueError(f"pack_bucket: the table reads up to element {ends[1]} of a source of {src.numel()}")
        if max(ends[2] if with_g else 0, ends[3]) > out.numel():
            raise ValueError(f"pack_bucket: the table writes up to element {max(ends[2:])} of a buffer of "
                             f"{out.numel()}")


class KernelFailure(RuntimeError):
    """A kernel of a compiled implementation failed to compile or launch; ``cause`` is the
    compiler's or driver's exception."""

    def __init__(self, kernel: str, flags: dict, cause: BaseException) -> None:
        super().__init__(f"kernel {kernel} {flags} failed: {type(cause).__name__}: {cause}")
        self.kernel, self.flags, self.cause = kernel, flags, cause


def index(schema: tuple[str, ...], name: str) -> int:
    return schema.index(name)


def build(schema: tuple[str, ...], **columns: Tensor) -> Tensor:
    """The table of ``schema`` from its columns given by name (all of them, no others)."""
    if set(columns) != set(schema):
        missing, extra = set(schema) - set(columns), set(columns) - set(schema)
        raise ValueError(f"kernel table {schema}: missing {sorted(missing)}, unknown {sorted(extra)}")
    return torch.stack([columns[name].double() for name in schema], dim=1).contiguous()


class COL:
    """Column positions for the reference implementation (``segf[i, COL.ADAM_BC1]``)."""

    INV_MEAN, LO, BC3 = (GSNR.index(n) for n in GSNR)
    SGD_LR_MULT, SGD_FIRST = SGD.index("lr_mult"), SGD.index("first")
    ADAM_BC1, ADAM_BC2S, ADAM_GRAD_MULT = ADAM.index("bc1"), ADAM.index("bc2s"), ADAM.index("grad_mult")
    LAMB_BC1, LAMB_BC2S, LAMB_TRUST = (LAMB_APPLY.index("bc1"), LAMB_APPLY.index("bc2s"),
                                       LAMB_APPLY.index("trust"))


class Kernels(Protocol):
    """The operations every implementation offers with these arguments: the reference
    (``_impl.Reference``), the C++ kernels (``_fused/kernels.cpp`` through ``_impl.Fused``) and
    the Triton kernels (``_triton.Triton``); ``tests/unit/test_kernel_interface.py`` checks all
    three against this. ``sync_free``: the implementation skips a step on the device from
    ``found_inf`` (a float64 0-dim device tensor, 1 = skip) and keeps its tables there; the
    others take ``found_inf=None`` (the host decided the skip before calling)."""

    name: str
    sync_free: bool

    def gsnr_moments(self, sum_g: Tensors, sum_sq: Tensors, seg: Tensor, inv_n: float, eps: float) -> Tensor: ...

    def scaled_grad_norms(self, params: Tensors, grads: Tensors, sum_g: Tensors, sum_sq: Tensors, avg: Tensors,
                          seg: Tensor, segf: Tensor, inv_n: float, eps: float, beta3: float) -> Tensor: ...

    def sgd_step(self, params: Tensors, grads: Tensors, bufs: Tensors, sum_g: Tensors, sum_sq: Tensors,
                 avg: Tensors, seg: Tensor, segf: Tensor, inv_n: float, eps: float, beta3: float, lr: float,
                 weight_decay: float, momentum: float, dampening: float, nesterov: bool,
                 found_inf: Tensor | None = None) -> Tensor:
        """Returns per segment [clip low count, clip high count, Σ p̂]."""

    def adam_step(self, params: Tensors, grads: Tensors, exp_avg: Tensors, exp_avg_sq: Tensors, sum_g: Tensors,
                  sum_sq: Tensors, avg: Tensors, seg: Tensor, segf: Tensor, inv_n: float, eps_gsnr: float,
                  beta3: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  apply: bool, placement: int, found_inf: Tensor | None = None,
                  apply_dtype: torch.dtype | None = None) -> Tensor:
        """Returns per segment [clip low, clip high, Σ p̂] (apply) or [‖θ‖², ‖u‖², clip low,
        clip high, Σ p̂] (LAMB's first pass); ``placement`` indexes ``PLACEMENTS``.
        ``apply_dtype``: the dtype of the parameters ``lamb_apply`` then steps, where it is not
        ``params``' (LAMB's L2 mode passes fp32 copies here); kernels compiled ahead take it."""

    def lamb_apply(self, params: Tensors, exp_avg: Tensors, exp_avg_sq: Tensors, sum_g: Tensors, sum_sq: Tensors,
                   avg: Tensors, seg: Tensor, segf: Tensor, inv_n: float, eps_gsnr: float, beta3: float, lr: float,
                   eps: float, weight_decay: float, found_inf: Tensor | None = None) -> None:
        """LAMB's second pass; the statistics are given (non-empty) only for the ``update``
        placement, whose p̂ it reads back after ``adam_step`` advanced the GSNR momentum."""

    def nonfinite(self, tensors: Tensors, seg: Tensor) -> Tensor:
        """Per segment 1.0 where the tensors hold an inf or NaN, else 0.0 (float64 [S])."""

    def pack_squares(self, src: Tensor, g_out: Tensor | None, sq_out: Tensor, c: float,
                     accumulate: bool = False) -> None:
        """One pass over a flat local gradient: ``g_out = float(src)`` (when given) and
        ``sq_out = (c · float(src))²`` (fp32 squares after removing the loss scale); with
        ``accumulate`` both are added instead of written."""

    def pack_bucket(self, src: Tensor, table: BucketTable, out: Tensor, c: float, g_scale: float | None,
                    main: Tensor | None = None) -> None:
        """One pass over a flat local gradient for the statistics, every segment of ``table`` in
        one launch: ``w = c · float(src[i])`` (the loss scale removed, in fp32); ``w²`` goes to the
        segment's squares in ``out`` and, unless ``g_scale`` is None, ``g_scale · float(src[i])``
        to its gradient there (``g_scale = c``: ``w`` itself); a segment with its accumulate flag
        set adds to what is there instead of writing. ``main`` (laid out like ``src``, fp32 or
        ``src``'s dtype): the engine's gradient accumulation in the same pass, ``main[i] +=
        src[i]`` rounded as ``Tensor.add_`` rounds it (Megatron's ``main_grad``)."""

    def unpack_bucket(self, src: Tensor, table: BucketTable, out: Tensor, src_sq: int, with_g: bool) -> None:
        """The reverse move of a reduced statistics bucket (fp32 ``src``: its ``Σg`` at a row's
        source start, its ``Σg²`` ``src_sq`` further) into the buffer the step reads: per row
        ``out[Σg² start + i] = src[start + src_sq + i]`` and, ``with_g``, ``out[Σg start + i] =
        src[start + i]``; a row with its accumulate flag set adds instead. One launch."""

    def accumulate_moments(self, grad: Tensor, sum_g: Tensor, sum_sq: Tensor, fresh: bool, inv_n: float = 0.0,
                           eps: float = 0.0) -> Tensor | None:
        """Adds one backward's gradient to the statistics; with ``inv_n > 0`` an implementation
        may also return ``gsnr_moments``' row for the tensor as one segment (``None``: it does
        not, and the step computes it)."""


class DeviceTables(Protocol):
    """What a ``sync_free`` implementation adds for the step itself (``functional.step_plans``):
    pass 1 with the gradient's non-finite check in one launch, and the per-segment tables, skip
    decision, step counters, trust ratios and metric rows of the Adam and SGD members in kernels
    of their own, so a steady step runs no torch operations on them (``_triton.Triton``
    documents each)."""

    def checked_moments(self, sum_g: Tensors, sum_sq: Tensors, grads: Tensors | None, seg: Tensor, inv_n: float,
                        eps: float) -> Tensor: ...

    def adam_tables(self, flags: Tensor, found: Tensor, skipped: Tensor | None, counters: Tensors, powers: Tensor,
                    tensor_of: Tensor, sum_r: Tensor, numel: Tensor, mult: Tensor | None, out: Tensor, gamma: float,
                    lr: float, bc1_mult: float, gsnr: bool, ema: bool, bias: bool) -> None: ...

    def finish(self, res: Tensor, norms: Tensor, table: Tensor, sum_r: Tensor, numel: Tensor, moments: Tensor,
               keys: Tensor, length: Tensor, share: Tensor, lamb: Tensor | None, sums: Tensor, maxs: Tensor,
               lr: float, min_coeff: float, max_coeff: float, gsnr: bool, trust: int, adapt: bool) -> None: ...

    def sgd_tables(self, flags: Tensor, found: Tensor, skipped: Tensor | None, counters: Tensors, powers: Tensor,
                   tensor_of: Tensor, sum_r: Tensor, numel: Tensor, created: Tensor | None, out: Tensor,
                   norms_out: Tensor | None, gamma: float, gsnr: bool, ema: bool, momentum: bool) -> None: ...

    def lars_trust(self, norms: Tensor, table: Tensor, trust: Tensor, weight_decay: float, eps: float,
                   coefficient: float, lr: float, adapt: bool, clip: bool) -> None: ...
