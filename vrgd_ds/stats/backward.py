"""Which backward pass a tensor hook runs in, for the sources that count gradient groups with
tensor hooks (``stats/hooks.py``, the hook path of ``stats/local.py``).

A gradient group is one ``backward()`` call. Under *reentrant* activation checkpointing
(``torch.utils.checkpoint(..., use_reentrant=True)``, ``deepspeed.checkpointing``, megatron-core's
``tensor_parallel.checkpoint``) a checkpointed segment's backward is a nested autograd pass of its
own, run from inside the custom Function's backward; a parameter used in two such passes of one
``backward()`` (a layer shared by two checkpointed segments, or used both inside a segment and
outside it) has its hook called once per pass, with part of its gradient each time. Counted as
groups, that would make ``n`` too large and ``Σg²`` a sum of squared parts, not of the squared
gradient (docs/design.md §3).

``BackwardGroups.current()`` names the outermost ``backward()`` a hook runs in; ``record`` refuses
a parameter recorded twice in one. How the outermost pass is found:

* each autograd pass has a graph-task id (``torch._C._current_graph_task_id``); a hook in the
  same pass as the last one is in the same group (one comparison per hook);
* at a pass's first hook, a nested pass has a custom Function's backward on the Python stack
  (``BackwardCFunction.apply``, the frame torch runs every ``autograd.Function.backward`` in); an
  outermost pass does not;
* the group ends when its outermost pass does: a callback queued on that pass
  (``queue_callback``), which a failed pass releases uncalled (``_GroupEnd``: the group ends
  then too). When a nested pass is the first one seen, the outermost pass is found from a
  post-hook on the Function's node, which runs in the calling pass once the nested one returns,
  climbing one level at a time through checkpoints inside checkpoints.
"""
from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.autograd.function import BackwardCFunction

_FUNCTION_BACKWARD = BackwardCFunction.apply.__code__


def _enclosing_function_node() -> Any:
    """The autograd node whose custom backward is running below this frame (a nested pass), or
    None (the outermost pass)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


class _GroupEnd:
    """Queued on an autograd pass (``queue_callback``). Called when the pass ends, it ends the
    group if ``on_call``; released uncalled, as a failed pass releases its callbacks before its
    ``backward()`` raises, it ends the group in any case (the next ``backward()`` is a new one)."""

    def __init__(self, groups: "BackwardGroups", serial: int, on_call: bool) -> None:
        self.groups, self.serial, self.pending = groups, serial, True
        self.on_call = on_call

    def __call__(self) -> None:
        self.pending = False
        if self.on_call:
            self.groups._end(self.serial)

    def __del__(self) -> None:
        if self.pending:
            self.groups._end(self.serial)


class BackwardGroups:
    """The outermost ``backward()`` the calling hook runs in, as a serial number that grows by one
    per ``backward()``. Safe for hooks on several autograd threads (a model on several devices)."""

    def __init__(self) -> None:
        self.serial = 0
        self._task = -2  # the autograd pass of the last hook (-1: a hook called outside any pass)
        self._outer: int | None = None  # the current group's outermost pass, once known
        self._open = False  # the current group's outermost pass has not ended
        self._lock = threading.Lock()
        self._last: dict[Any, int] = {}  # per recorded key, the group it was last recorded in

    def record(self, key: Any, p: Tensor, owner: str, group: int | None = None) -> int:
        """A hook of parameter ``p`` (``key``: how its source names it) records a gradient in
        ``group`` (default: ``current()``, which a caller that read it already passes); the second
        record in one ``backward()`` is an error naming the fix. Returns the group."""
        group = self.current() if group is None else group
        if self._last.get(key) == group:
            raise second_pass_error(p, owner)
        self._last[key] = group
        return group

    def current(self) -> int:
        task = torch._C._current_graph_task_id()
        if task == self._task and task != -1:
            return self.serial
        with self._lock:
            if task != self._task or task == -1:
                self._enter(task)
                self._task = task  # last: another thread's fast path then reads the serial decided here
            return self.serial

    def _enter(self, task: int) -> None:
        """The first hook of pass ``task`` (since the last hook of another pass)."""
        if task == -1:  # not from the autograd engine: a group of its own
            self._start()
            self._open = False
            return
        node = _enclosing_function_node()
        if node is None:  # the outermost pass
            if not (self._open and self._outer in (None, task)):
                self._start()
            if self._outer is None:
                self._outer_found(task)
        elif not self._open:  # a nested pass, the first of a backward() whose own hooks come later
            self._start()
            serial = self.serial
            Variable._execution_engine.queue_callback(_GroupEnd(self, serial, on_call=False))  # if it fails

            def found(grad_inputs: Any, grad_outputs: Any) -> None:
                """Runs in the pass that called the Function's backward, once that returned: the
                outermost pass, or (a checkpoint inside a checkpoint) one more level to climb."""
                with self._lock:
                    if serial != self.serial or self._outer is not None:
                        return
                    outer = _enclosing_function_node()
                    if outer is not None:
                        outer.register_hook(found)
                    else:
                        self._outer_found(torch._C._current_graph_task_id())

            node.register_hook(found)

    def close(self) -> None:
        """Called between steps: when no autograd pass is running, the next hook starts a new
        group (a backward() that raised before its end leaves no group open)."""
        if torch._C._current_graph_task_id() == -1:
            with self._lock:
                self._open = False
                self._task = -2

    def _start(self) -> None:
        self.serial += 1
        self._outer = None
        self._open = True

    def _outer_found(self, task: int) -> None:
        self._outer = task
        Variable._execution_engine.queue_callback(_GroupEnd(self, self.serial, on_call=True))

    def _end(self, serial: int) -> None:
        if serial == self.serial:
            self._open = False


def remove_hooks(handles: list[Any] | dict[Any, Any]) -> None:
    """Removes the hooks of ``handles`` (a list of them, or a dict whose values they are) and
    empties it: also as the finaliser of the statistics that installed them, which hold it."""
    for h in list(handles.values() if isinstance(handles, dict) else handles):
        h.remove()
    handles.clear()


def second_pass_error(p: Tensor, owner: str) -> RuntimeError:
    """The error for a parameter whose hook ran twice in one ``backward()``."""
    return RuntimeError(
        f"{owner}: a parameter of shape {tuple(p.shape)} received its gradient in two autograd passes of one "
        "backward(): it is used in two reentrant activation-checkpointed segments, or inside one and outside it "
        "(torch.utils.checkpoint(..., use_reentrant=True), deepspeed.checkpointing, megatron's "
        "tensor_parallel.checkpoint). VRGD statistics need each parameter's whole gradient of a backward at once: "
        "use torch.utils.checkpoint(..., use_reentrant=False), or do not share the parameter across checkpointed "
        "segments")
