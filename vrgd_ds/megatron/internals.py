"""The megatron-core release the integration is written against, and how a missing internal
fails (the DeepSpeed counterpart is ``vrgd_ds/ds/internals.py``). Each module lists the
megatron-core attributes it reads next to the code that reads them and checks them with
``require`` when the optimizer is built, so a renamed attribute fails there, naming it."""
from __future__ import annotations

from typing import Any

#: megatron-core releases whose internals the integration was written against (the
#: ``megatron`` extra pins the last one). 0.16.1 is the newest release for Python 3.11.
SUPPORTED_MEGATRON_CORE = ("0.16.1",)


class UnsupportedMegatronConfiguration(ValueError):
    """A Megatron configuration the VRGD statistics do not cover (the message names the option)."""


def version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_version() -> None:
    try:
        found = version()
    except ImportError:
        raise ImportError("vrgd_ds.megatron needs megatron-core: pip install 'vrgd-ds[megatron]' "
                          f"(megatron-core=={SUPPORTED_MEGATRON_CORE[-1]})") from None
    if found not in SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"vrgd_ds.megatron supports megatron-core {', '.join(SUPPORTED_MEGATRON_CORE)}, found {found}: it reads "
            "Megatron's gradient buffers and distributed-optimizer ranges, which change between releases. Install: "
            f"pip install megatron-core=={SUPPORTED_MEGATRON_CORE[-1]}")


def require(obj: Any, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise RuntimeError(
            f"vrgd_ds: megatron-core {version()} lacks {where}.{', '.join(missing)}, which the VRGD statistics use; "
            f"supported megatron-core versions: {', '.join(SUPPORTED_MEGATRON_CORE)}")
