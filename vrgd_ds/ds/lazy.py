"""Registration with DeepSpeed at ``import vrgd_ds`` without importing DeepSpeed (seconds)
for users who never touch it: if DeepSpeed is imported already, register now; otherwise
register right after ``import deepspeed`` finishes, whoever imports it (HF, Accelerate)."""
from __future__ import annotations

import importlib.abc
import sys


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "deepspeed":
            return None
        # A probe (importlib.util.find_spec, e.g. transformers' is_deepspeed_available) also
        # lands here without importing: stay installed until the module really executes. The
        # spec is the one the finders after this one give, in their order: the path finder for an
        # installed DeepSpeed, an editable install's finder (appended to sys.meta_path) for one
        # installed with pip install -e.
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, _AfterImport) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            exec_module(module)
            from vrgd_ds.ds.integration import register

            try:
                register()
            except Exception:
                # an unsupported DeepSpeed: every import of it fails alike, not the first only
                # (the failed import leaves no module, and the next would register nothing)
                sys.meta_path.insert(0, self)
                raise

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_imported() -> None:
    if "deepspeed" in sys.modules:
        from vrgd_ds.ds.integration import register

        register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
