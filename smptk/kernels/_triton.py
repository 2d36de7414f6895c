"""``triton`` and ``triton.language`` for the kernel modules, with stand-ins where Triton is not installed.

Every kernel module imports Triton through here (``from smptk.kernels._triton import triton, tl``), so
``import smptk.kernels`` works on a machine without Triton (macOS, Windows, a CPU-only install) and every
op takes its pure-PyTorch path there (:mod:`smptk.kernels.runtime` reads :data:`HAVE_TRITON`).

The stand-ins keep module-level code working and fail loudly at launch:

- ``triton.jit``, ``triton.autotune(...)``, ``triton.heuristics(...)`` give a kernel whose launch
  (``kernel[grid](...)``) raises ``RuntimeError`` saying Triton is missing and what to do instead;
- ``triton.Config`` is a plain record; ``triton.cdiv`` and ``triton.next_power_of_2`` are the real
  arithmetic (launchers size grids with them before anything launches);
- ``tl.constexpr(v)`` returns ``v``; any other ``tl.X`` (``tl.float32``, ``tl.int64``...) is a named
  placeholder that can be stored, compared and printed, but not called.

:data:`INTERPRETER_AT_IMPORT` records ``TRITON_INTERPRET`` as it was when this module was first imported,
which is when ``import smptk.kernels`` runs the ``@triton.jit`` decorators: Triton decides there, once,
whether a kernel is interpreted or compiled, so the runtime can tell a later change of the variable
(which Triton would not honour) from the state the kernels were built in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from smptk import settings

MISSING_MESSAGE = (
    "triton is not installed: the Triton kernels cannot run here; use SMPTK_KERNELS=torch (the pure-PyTorch "
    "path, also what SMPTK_KERNELS=auto picks without Triton) or install triton"
)


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


def _cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for positive ``y``, as ``triton.cdiv``."""
    return (x + (y - 1)) // y


def _next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


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
    cdiv = staticmethod(_cdiv)
    next_power_of_2 = staticmethod(_next_power_of_2)

    def __init__(self) -> None:
        super().__init__("triton")
        self.language = _MissingLanguage()

    @staticmethod
    def autotune(*args: Any, **kwargs: Any) -> Callable[[Any], _Unlaunchable]:
        return _Unlaunchable

    @staticmethod
    def heuristics(*args: Any, **kwargs: Any) -> Callable[[Any], _Unlaunchable]:
        return _Unlaunchable


try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    triton = _MissingTriton()
    tl = triton.language
    HAVE_TRITON = False

INTERPRETER_AT_IMPORT = HAVE_TRITON and settings.triton_interpret()

__all__ = ["HAVE_TRITON", "INTERPRETER_AT_IMPORT", "MISSING_MESSAGE", "tl", "triton"]
