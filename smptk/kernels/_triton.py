"""Triton for smptk: imported on the first Triton-path call, never at ``import smptk``; stand-ins without it.

Importing triton takes about 0.23 s and decorating smptk's kernels another 0.08 s (``python -X importtime``,
torch 2.13 CPU + triton 3.9; torch itself takes 1.9 s), and it loads Triton's CUDA backend into processes
that only run the PyTorch path, build a model on meta or print ``smptk info``. So the split is:

- **Kernel modules** define ``@triton.jit`` functions at import (``_gemm``, ``_epilogue``, ``_index``,
  ``_moe_route_kernels``, ``_moe_dispatch_kernels``, ``collectives``) and take Triton from here:
  ``from smptk.kernels._triton import tl, triton``. Those names (and :data:`HAVE_TRITON`,
  :data:`INTERPRETER_AT_IMPORT`) are resolved on first access through the module ``__getattr__``
  (PEP 562): that is when triton is imported, or the stand-ins installed.
- **Host modules** (the public ops, :mod:`~smptk.kernels.runtime`, :mod:`smptk.comm`) never import a kernel
  module at their top. They hold a :func:`kernel_module` handle, which imports its module on its first
  attribute access, i.e. inside a Triton-path call, and size grids with :func:`cdiv` and
  :func:`next_power_of_2` (plain arithmetic, no import). :func:`available` says whether triton can be
  imported, without importing it.

Why a handle rather than an ``import`` inside each launcher: it is one loader in one place, the launch code
reads as before (``_gemm.matmul(...)``, ``K.OPS``), and the module it names is spelled once, at the top of
the file, where a reader looks for imports. ``tests/test_lazy_triton.py`` checks that importing every
package and running the PyTorch path leaves ``triton`` out of ``sys.modules``.

Without Triton installed (macOS, Windows, a CPU-only install) every op takes its pure-PyTorch path
(:mod:`smptk.kernels.runtime` reads :func:`available`), and a kernel module still imports, with stand-ins
that keep module-level code working and fail loudly at launch:

- ``triton.jit``, ``triton.autotune(...)``, ``triton.heuristics(...)`` give a kernel whose launch
  (``kernel[grid](...)``) raises ``RuntimeError`` saying Triton is missing and what to do instead;
- ``triton.Config`` is a plain record; ``triton.cdiv`` and ``triton.next_power_of_2`` are the real
  arithmetic (:func:`cdiv`, :func:`next_power_of_2`);
- ``tl.constexpr(v)`` returns ``v``; any other ``tl.X`` (``tl.float32``, ``tl.int64``...) is a named
  placeholder that can be stored, compared and printed, but not called.

:data:`INTERPRETER_AT_IMPORT` records ``TRITON_INTERPRET`` as it was when triton was imported: Triton decides
at each ``@triton.jit``, once, whether a function is interpreted or compiled, its own library functions
(``tl.cdiv``...) when triton is imported and smptk's kernels when their module is. So the variable must be
set before triton is imported, by smptk's first Triton-path call or by other code before it (torch's meta
kernels import ``torch._dynamo``, which imports triton), and the runtime can tell a later change (which
Triton would not honour) from the state the functions were built in. :func:`interpreter_at_import` reads it
without importing anything (None while triton is not imported).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from smptk import settings

if TYPE_CHECKING:  # resolved on first access by __getattr__ below
    import triton
    import triton.language as tl

    HAVE_TRITON: bool
    INTERPRETER_AT_IMPORT: bool

MISSING_MESSAGE = (
    "triton is not installed: the Triton kernels cannot run here; use SMPTK_KERNELS=torch (the pure-PyTorch "
    "path, also what SMPTK_KERNELS=auto picks without Triton) or install triton"
)


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for positive ``y``, as ``triton.cdiv``."""
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# --- the lazy import ----------------------------------------------------------------------------------------

_LAZY_NAMES = ("triton", "tl", "HAVE_TRITON", "INTERPRETER_AT_IMPORT")
_load_lock = threading.Lock()
# What _load found, for the checks that run on every call (a dict, not globals(): torch.compile traces them)
_LOADED: dict[str, bool] = {}


def _load() -> None:
    """Import triton (or make the stand-ins) and record ``TRITON_INTERPRET`` at its import; once."""
    with _load_lock:
        if "INTERPRETER_AT_IMPORT" in _LOADED:
            return
        imported_before = "triton" in sys.modules  # by other code: torch._dynamo imports triton too
        try:
            import triton
            import triton.language as tl

            have = True
        except ImportError:
            triton = _MissingTriton()
            tl = triton.language
            have = False
        globals().update(triton=triton, tl=tl, HAVE_TRITON=have)
        interpreted = have and (_library_interpreted(tl) if imported_before else settings.triton_interpret())
        if interpreted and settings.interpreter_fast_calls():
            _skip_repatching_in_kernels(tl)
        globals()["INTERPRETER_AT_IMPORT"] = interpreted  # last: marks the load done
        _LOADED.update(HAVE_TRITON=have, INTERPRETER_AT_IMPORT=interpreted)


def _library_interpreted(tl: Any) -> bool:
    """Whether Triton's own ``@jit`` library functions (``tl.cdiv``, ``tl.sigmoid``...) were built for the
    interpreter: Triton decides it for them when it is imported, as for every kernel when it is decorated.
    Read from the function's type (``InterpretedFunction``), for a triton that other code imported first."""
    return type(tl.cdiv).__name__ == "InterpretedFunction"


# --- the interpreter's helper calls ---------------------------------------------------------------------
#
# Triton's interpreter (3.x) patches ``triton.language`` for host execution when a kernel starts, and undoes
# it when the kernel ends. It also runs the same patching again at every call of a ``@triton.jit`` helper
# inside the kernel, where the modules are patched already: ``inspect.getmembers`` over tl, tl.core,
# tl.tensor and tl.math, about 1.7 ms a call, which re-wraps nothing (the members it would wrap are wrappers
# by then). smptk's kernels call helpers in their loops (spin-waits, tile copies), so this was about half of
# the interpreter's time: the 2-rank collectives test job took 78 s with it and 46 s without it (triton 3.9,
# 2 CPU cores). While a kernel of this thread runs, a helper whose globals see only language modules patched
# since the kernel started skips the repeat; anything else goes to Triton's own function. Off with
# SMPTK_INTERPRETER_FAST_CALLS=0; a Triton without this structure is left as it is.

_kernel_langs = threading.local()  # .stack: per running kernel of this thread, the ids of the modules patched


class _Unpatched:
    """The scope of a skipped re-patch: nothing to restore."""

    def restore(self) -> None:
        pass


class _KernelScope:
    """The scope of a kernel's own patching: restoring it also ends the kernel's entry in the stack."""

    def __init__(self, scope: Any, stack: list[frozenset[int]]):
        self._scope, self._stack = scope, stack

    def restore(self) -> None:
        self._stack.pop()
        self._scope.restore()


def _skip_repatching_in_kernels(tl: Any) -> None:
    """Wrap ``triton.runtime.interpreter._patch_lang`` as described above; once per process."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "smptk_wrapped", False):
        return
    languages = (tl, tl.core)

    @functools.cache
    def langs_of(fn: Any) -> frozenset[int]:  # the language modules a function's globals see
        seen = fn.__globals__.values()
        return frozenset(id(v) for v in seen if isinstance(v, ModuleType) and v in languages)

    def patch_lang(fn: Any) -> Any:
        stack = getattr(_kernel_langs, "stack", None)
        if stack is None:
            stack = _kernel_langs.stack = []
        langs = langs_of(fn)
        if stack and langs:  # a helper called inside a running kernel (none seen: Triton's own error)
            if langs <= stack[-1]:
                return _Unpatched()
            stack[-1] = stack[-1] | langs  # Triton never restores a helper's patching: patched from here on
            return patch(fn)
        scope = patch(fn)
        stack.append(langs)
        return _KernelScope(scope, stack)

    patch_lang.smptk_wrapped = True  # type: ignore[attr-defined]
    patch_lang.triton_patch_lang = patch  # type: ignore[attr-defined]  # Triton's own, for tests
    interpreter._patch_lang = patch_lang


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _findable() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder that refuses triton; a half-removed install
        return False


# Whether the import system finds triton, asked once, here (find_spec imports nothing): a constant that
# torch.compile reads, where torch 2.11's Dynamo refuses to trace find_spec behind a functools.cache
_FINDABLE = _findable()


def available() -> bool:
    """True when the ``triton`` package imports here; asks the import system where it is, without importing
    it (after the import, whether it worked)."""
    loaded = _LOADED.get("HAVE_TRITON")
    return _FINDABLE if loaded is None else loaded


def interpreter_at_import() -> bool | None:
    """:data:`INTERPRETER_AT_IMPORT`; None while triton is not imported (then nothing is built yet). Imports
    nothing: once other code has imported triton, this reads the state it was imported in."""
    if "INTERPRETER_AT_IMPORT" not in _LOADED:
        if "triton" not in sys.modules:
            return None
        _load()
    return _LOADED["INTERPRETER_AT_IMPORT"]


def _torch_alloc(size: int, alignment: int, stream: int | None) -> Any:
    import torch

    return torch.empty(size, device="cuda", dtype=torch.int8)


def ensure_allocator() -> None:
    """Device-side tensor descriptors (``tl.make_tensor_descriptor`` in a compiled kernel) need scratch
    memory from Triton's allocator hook; install a torch one unless one is set. Called at every launch that
    builds descriptors (the GEMM engine's TMA path, the collectives' TMA copies): Triton keeps the hook in a
    ContextVar, and autograd runs CUDA backwards on its own thread, where a hook set on the main thread is
    not visible. Nothing to do under the interpreter."""
    if interpreter_at_import() is not False:
        return
    import triton as real_triton

    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except Exception:  # private module moved: install ours
        pass
    real_triton.set_allocator(_torch_alloc)


class _KernelModule:
    """A kernel module that is imported on first attribute access (see :func:`kernel_module`)."""

    __slots__ = ("_module", "_name")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # introspection (doctest, copy, inspect.unwrap) must not import triton
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"<kernel module {self._name!r} ({state})>"


def kernel_module(name: str) -> Any:
    """A handle on the kernel module ``name`` (``"smptk.kernels._gemm"``) that imports it, and so triton, on
    the first attribute access: ``_gemm = kernel_module("smptk.kernels._gemm")`` at the top of a host
    module, then ``_gemm.matmul(...)`` on its Triton path."""
    return _KernelModule(name)


# --- stand-ins where triton is not installed ------------------------------------------------------------


class _Unlaunchable:
    """What ``triton.jit`` and friends give without Triton: a named kernel whose launch raises."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = getattr(fn, "fn", fn)
        functools.update_wrapper(self, self.fn)

    def __getitem__(self, grid: object) -> Callable[..., Any]:
        return self._raise

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._raise()

    def _raise(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{MISSING_MESSAGE} (kernel {self.fn.__name__})")


def _decorator(*args: Any, **kwargs: Any) -> Any:
    """``@triton.jit`` and ``@triton.jit(...)`` alike: wrap the function, or return what wraps it."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _Unlaunchable(args[0])
    return _Unlaunchable


class _Config:
    """``triton.Config`` without Triton: the block sizes and launch options, kept as given."""

    def __init__(self, kwargs: dict[str, Any], num_warps: int = 4, num_stages: int = 3, **options: Any):
        self.kwargs = dict(kwargs)
        self.num_warps, self.num_stages = num_warps, num_stages
        self.options = options  # num_ctas, maxnreg, pre_hook...

    def all_kwargs(self) -> dict[str, Any]:
        return {
            **self.kwargs,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **self.options,
        }

    def __repr__(self) -> str:
        return f"Config({self.all_kwargs()})"


class _Placeholder:
    """A ``tl`` attribute without Triton (``tl.float32``...): storable and printable, not callable."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{MISSING_MESSAGE} ({self._name} called)")

    def __repr__(self) -> str:
        return f"<{self._name}: triton is not installed>"


class _MissingModule:
    """Base of the ``triton`` / ``triton.language`` stand-ins: unknown attributes are placeholders."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _MissingLanguage(_MissingModule):
    def __init__(self) -> None:
        super().__init__("triton.language")

    @staticmethod
    def constexpr(value: Any) -> Any:
        return value


class _MissingTriton(_MissingModule):
    __version__ = None
    jit = staticmethod(_decorator)
    Config = _Config
    cdiv = staticmethod(cdiv)
    next_power_of_2 = staticmethod(next_power_of_2)

    def __init__(self) -> None:
        super().__init__("triton")
        self.language = _MissingLanguage()

    @staticmethod
    def autotune(*args: Any, **kwargs: Any) -> Callable[[Any], _Unlaunchable]:
        return _Unlaunchable

    heuristics = autotune  # triton.heuristics(...) too: a decorator that makes an unlaunchable kernel


__all__ = [
    "HAVE_TRITON",
    "INTERPRETER_AT_IMPORT",
    "MISSING_MESSAGE",
    "available",
    "cdiv",
    "ensure_allocator",
    "interpreter_at_import",
    "kernel_module",
    "next_power_of_2",
    "tl",
    "triton",
]
