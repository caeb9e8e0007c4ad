"""The kernel interface's data: the per-segment tables the kernels take, by name (one schema
per kernel, written once), the GSNR placements by index, and the failure a compiled kernel raises.

Every kernel call gets a contiguous float64 table ``[S, k]`` with one row per segment; the
three implementations read its columns by these names — the reference through ``COL``, the
C++ kernels through the ``col::k...`` constants in ``_fused/kernels.cpp``, the Triton kernels
through the constants in ``_triton.py`` — and a test checks that all three agree with the
schemas here. The first three columns of every schema are the GSNR scale's.
"""
from __future__ import annotations

import torch
from torch import Tensor

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
