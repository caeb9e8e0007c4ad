"""The three implementations of the kernels expose the operations of ``columns.Kernels`` with its
arguments, in its order: the reference and the Triton kernels by their Python signatures, the
C++ kernels by pybind11's (through ``_impl.Fused``, which adds ``found_inf=None`` to the steps, and
``apply_dtype=None`` to ``adam_step``)."""
from __future__ import annotations

import inspect
import re

import pytest

from vrgd_ds.optim import _fused, _impl, columns

OPERATIONS = [name for name, member in inspect.getmembers(columns.Kernels, inspect.isfunction)
              if not name.startswith("_")]
STEPS = ("sgd_step", "adam_step", "lamb_apply")
#: the steps' last keywords, which the host alone reads (``_impl.Fused`` takes them and does not
#: pass them on): the skip decided on the host, and the dtype that kernels compiled ahead take
HOST_ONLY = ("found_inf", "apply_dtype")


def host_only(op: str) -> list[str]:
    return [p for p in protocol(op) if p in HOST_ONLY]


def protocol(op: str) -> list[str]:
    return [p for p in inspect.signature(getattr(columns.Kernels, op)).parameters if p != "self"]


def python(cls: type, op: str) -> list[str]:
    return [p for p in inspect.signature(getattr(cls, op)).parameters if p != "self"]


def cpp(op: str) -> list[str]:
    """Argument names from pybind11's signature line (``adam_step(params: list[...], ...) -> ...``)."""
    doc = getattr(_fused.load(), op).__doc__
    line = doc.strip().splitlines()[0]
    inner = line[line.index("(") + 1: line.rindex(")")]
    return re.findall(r"(?:^|, )(\w+): ", inner)


def test_the_protocol_declares_the_step_operations_and_sync_free():
    assert {"gsnr_moments", "scaled_grad_norms", "nonfinite", "pack_squares", "pack_bucket", "unpack_bucket",
            "accumulate_moments",
            *STEPS} == set(OPERATIONS)
    assert "sync_free" in columns.Kernels.__annotations__
    for op in STEPS:
        last = host_only(op)
        assert last[0] == "found_inf" and protocol(op)[-len(last):] == last


@pytest.mark.parametrize("op", OPERATIONS)
def test_reference_and_triton_take_the_protocols_arguments(op):
    pytest.importorskip("triton")
    from vrgd_ds.optim import _triton

    assert python(_impl.Reference, op) == protocol(op)
    assert python(_triton.Triton, op) == protocol(op)


@pytest.mark.skipif(not _fused.available(), reason="no C++ toolchain")
@pytest.mark.parametrize("op", OPERATIONS)
def test_the_cpp_kernels_take_the_protocols_arguments(op):
    want = protocol(op)
    if op in STEPS:  # the host's keywords: _impl.Fused takes them and does not pass them on
        last = host_only(op)
        assert set(last) <= set(inspect.signature(getattr(_impl.Fused, op)).parameters)
        want = want[:-len(last)]
    assert cpp(op) == want


def test_every_implementation_says_whether_it_is_sync_free():
    pytest.importorskip("triton")
    from vrgd_ds.optim import _triton

    assert (_impl.Reference.sync_free, _impl.Fused.sync_free, _triton.Triton.sync_free) == (False, False, True)
