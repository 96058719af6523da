"""Kernel tests run the Triton kernels compiled on CUDA, or under the interpreter on the CPU.

triton 3.7 reads TRITON_INTERPRET (triton.knobs.runtime.interpret) each time a function is
decorated with @triton.jit, and triton.language's own helpers (tl.zeros, tl.cdiv, ...) are
decorated when `import triton` runs. So the choice must be made before triton is first imported in
the process: this file sets TRITON_INTERPRET=1 when there is no CUDA device (or keeps it when the
caller set it), before anything here imports triton. kernels/ itself never imports triton on the
CPU path, so collecting other test packages first does not spoil it.

The interpreter does not support bfloat16 arithmetic (triton's debugging guide says so). It
stores bf16 as raw uint16, so (1) its `tl.dot` multiplies those bit patterns (triton-lang/triton
#11584: "we just don't support it yet"), and (2) its float32 -> bfloat16 cast truncates where the
GPU rounds to nearest even. `_interpreter_bf16` makes both do what the GPU does: dot operands are
converted to float32 first (bf16 products are exact in float32 and accumulate in float32), and
the cast rounds to nearest even (NaN stays NaN). Nothing else in the interpreter is patched.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
TRITON_IMPORTED_EARLY = "triton" in sys.modules
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _interpreter_bf16() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "radixmesh_bf16", False):
        return
    original_dot: Callable[..., Any] = builder.create_dot
    original_cast: Callable[..., Any] = builder.cast_impl

    def as_float32(handle: Any) -> Any:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        return original_dot(self, as_float32(a), as_float32(b), d, *args)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return original_cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
        return interpreter.TensorHandle(rounded, tl.bfloat16)

    create_dot.radixmesh_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl


def _triton_is_interpreted() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """The device the Triton kernels run on here; fails clearly if the interpreter cannot be had."""
    if INTERPRET:
        if not _triton_is_interpreted():
            pytest.fail(
                "triton was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1 "
                f"(imported early: {TRITON_IMPORTED_EARLY}); run with TRITON_INTERPRET=1 in the "
                "environment, or set it in tests/conftest.py"
            )
        _interpreter_bf16()
    return DEVICE


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under the interpreter, `gpu` tests would run interpreted: skip them even with a GPU."""
    if not (INTERPRET and torch.cuda.is_available()):
        return  # without CUDA, tests/conftest.py skips them already
    skip = pytest.mark.skip(reason="TRITON_INTERPRET=1: gpu tests need compiled kernels")
    for item in items:
        if "gpu" in item.keywords and "tests/kernels" in str(item.path).replace(os.sep, "/"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from tests.kernels.helpers import MAX_ERRORS

    if MAX_ERRORS:
        terminalreporter.section(
            "kernel checks: largest relative error norm seen, per check and dtype"
        )
        for (kernel, dtype), error in sorted(MAX_ERRORS.items()):
            terminalreporter.write_line(f"{kernel:<28} {dtype:<9} {error:.3e}")
