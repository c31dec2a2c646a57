"""A faster Triton interpreter for tpfuse's CPU runs (emulated ranks, CI): one patch of
``triton.language`` per kernel launch instead of one per helper call.

Triton 3.6's interpreter swaps ``triton.language``'s builtins for interpreted ones when a
kernel is launched (``GridExecutor``) and restores them when the grid is done. It also does it
again at every call of a ``@triton.jit`` helper inside the kernel (``InterpretedFunction``),
walking three modules with ``inspect.getmembers`` each time (about 1.5 ms), and never restores
that second patch: the launch's restore undoes it. In a fused all-reduce test on CPU ranks,
9,883 helper calls spent 15 of 48 s there. While a launch's patch is in place, a helper whose
language modules it already covers needs no patch of its own, so this skips it; everything
else (a launch, a helper that sees another language module) goes through Triton's own code.

Installed by ``tpfuse._runtime`` under the interpreter only, and only where Triton's
interpreter has the functions it wraps; elsewhere nothing changes.
"""

from __future__ import annotations

import inspect
import threading


def install() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original_patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original_patch is None or executor is None or getattr(original_patch, "tpfuse_once", False):
        return
    original_launch = executor.__call__
    class Launch(threading.local):  # per thread: Triton's patching is process-wide, a launch a thread's
        starting = False
        langs = None  # the language modules the running launch patched

    launch = Launch()

    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang_once(fn):
        if launch.starting:  # the launch's own patch, which it restores when its grid is done
            launch.starting = False
            scope = original_patch(fn)
            launch.langs = langs_of(fn)
            return scope
        if launch.langs is not None and langs_of(fn) <= launch.langs:
            return None  # a helper inside the launch: InterpretedFunction ignores what this returns
        return original_patch(fn)

    def launch_patching_once(self, *args, **kwargs):
        launch.starting, launch.langs = True, None
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            launch.starting, launch.langs = False, None

    patch_lang_once.tpfuse_once = True
    interpreter._patch_lang = patch_lang_once
    executor.__call__ = launch_patching_once
