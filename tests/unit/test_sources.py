"""The seam between statistics and optimizer (``vrgd_ds/stats/source.py``): every source of the
package has the protocol's shape, takes its kernels through the selection rule and never calls
the optimizer; and the family's variants are data, not classes made at run time or recognised by
name."""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

from vrgd_ds.optim import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vrgd_ds"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _source_classes():
    """Every class of the package that hands out statistics (defines ``moments``)."""
    found = {}
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(isinstance(f, ast.FunctionDef) and f.name == "moments"
                                                      for f in node.body):
                found[f"{name}.{node.name}"] = (name, node.name)
    return found


SOURCES = _source_classes()


def test_every_engine_has_a_source():
    """The list the next test runs over is the package's, found in the code (a new source is
    checked without being named here)."""
    short = {key.rsplit(".", 1)[1] for key in SOURCES}
    assert {"TensorHookStats", "LocalStats", "ReductionStats", "DDPStats", "GivenStatistics"} <= short, short


@pytest.mark.parametrize("key", sorted(k for k in SOURCES if not k.endswith(".StatisticsSource")))
def test_every_source_has_the_protocols_shape(key):
    """``n`` (a property, or an attribute its constructor sets), ``moments(params)``, ``reset()``,
    and where offered ``taken_moments(params, n, eps)``: what ``functional.step_plans`` calls."""
    module, name = SOURCES[key]
    cls = getattr(importlib.import_module(module), name)
    assert list(inspect.signature(cls.moments).parameters) == ["self", "params"]
    assert list(inspect.signature(cls.reset).parameters) == ["self"]
    if hasattr(cls, "taken_moments"):
        assert list(inspect.signature(cls.taken_moments).parameters) == ["self", "params", "n", "eps"]
    sets_n = any(isinstance(node, ast.Attribute) and node.attr == "n" and isinstance(node.ctx, ast.Store)
                 for c in cls.__mro__ if c.__module__.startswith("vrgd_ds")
                 for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(c)))))
    assert isinstance(inspect.getattr_static(cls, "n", None), property) or sets_n, f"{name} has no n"


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            yield node


def test_no_source_calls_the_optimizer_for_its_kernels():
    """Sources and the code attaching them take kernels through ``_impl.select``/``select_for``;
    only the optimizer itself calls ``self.kernels()``."""
    offenders = []
    for name, path in _modules():
        for call in _calls(path):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr == "kernels" and not (
                    isinstance(f.value, ast.Name) and f.value.id == "self" and name == "vrgd_ds.optim.base"):
                offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}: {ast.unparse(call)}")
    assert offenders == []


def test_no_class_is_made_at_run_time_and_none_is_recognised_by_its_name():
    """Variants are ``registry.Variant`` data: no class made by ``type(name, bases, ns)`` in the package
    (tests may build stand-ins, not of a member), and no member told apart
    by its class name (``__name__ == 'X'``, ``'Merit' in __name__``, ``__name__.endswith``): what a
    member needs is a registry capability."""
    members = set(REGISTRY) | {"Merit", "Lamb", "Lars", "Adam", "SGD"}
    offenders = []
    for package, path in [*_modules(), *((None, p) for p in sorted((ROOT / "tests").rglob("*.py")))]:
        if path.name == "test_sources.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" \
                    and len(node.args) == 3 and (package or any(m in ast.unparse(node.args[1]) for m in members)):
                offenders.append(f"{where}: {ast.unparse(node)}")  # a subclass of a member made at run time
            if isinstance(node, (ast.Compare, ast.Call)):
                text = ast.unparse(node)
                if "__name__" in text and any(f"'{m}'" in text or f'"{m}"' in text for m in members):
                    offenders.append(f"{where}: {text}")
    assert offenders == []


def _created(cls) -> set[str]:
    """The private attributes ``cls``'s own ``__init__`` creates on ``self`` (a subclass may go on
    to use its base's state in other methods, as ``NodeStats`` does ``LocalStats``'s counters)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    init = [f for f in body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    return {t.attr for node in (ast.walk(init[0]) if init else ())
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            and t.attr.startswith("_") and not t.attr.startswith("__")}


def test_no_source_reuses_a_private_attribute_of_the_source_it_extends():
    """A subclass of a statistics source whose ``__init__`` creates a private attribute its base's
    also creates replaces the base's state: ``FSDPStats._groups`` (its FSDP parameter groups, a list) hid
    ``LocalStats._groups`` when the base started using that name, and every FSDP step raised in
    ``end_step``. Fails on f08f656's code, where both assigned ``_groups``."""
    classes = {name: module for module, name in SOURCES.values()}
    trees = [(module, ast.parse(path.read_text())) for module, path in _modules()]
    grew = True
    while grew:  # the sources' subclasses, at any depth (FSDPStats extends LocalStats without its own moments)
        grew = False
        for module, tree in trees:
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name not in classes and any(
                        ast.unparse(b).rpartition(".")[2] in classes for b in node.bases):
                    classes[node.name], grew = module, True
    assert {"FSDPStats", "NodeStats", "LocalStats"} <= set(classes)
    offenders = []
    for name, module in classes.items():
        key = f"{module}.{name}"
        cls = getattr(importlib.import_module(module), name)
        mine = _created(cls)
        for base in cls.__mro__[1:]:
            if base.__module__.startswith("vrgd_ds"):
                offenders += [f"{key}.{a} (also {base.__name__}.{a})" for a in sorted(mine & _created(base))]
    assert offenders == []
