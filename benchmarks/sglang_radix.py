"""SGLang's Python radix cache and KV allocators, loaded from its wheel for a side-by-side run.

`fetch_wheel` runs `pip download sglang==<version> --no-deps` into a directory (nothing is
vendored or committed); `load` extracts the files the prefix cache is made of (the tree, its
parameter types, the eviction policies and events, the token and paged allocators) and imports
them with every other `sglang` module they name replaced by an inert stub. Those stubs stand for
GPU kernels, metrics, platform probes and the scheduler, none of which the tree's match, insert,
lock and evict paths call. The few helpers they do call are given their real behaviour in
`_OVERRIDES` (the debug switch reads False, as it does unless SGLANG_DEBUG_MEMORY_POOL is set).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SGLANG_VERSION = "0.5.23"

_REAL = (
    "sglang/srt/mem_cache/radix_cache.py",
    "sglang/srt/mem_cache/base_prefix_cache.py",
    "sglang/srt/mem_cache/cache_init_params.py",
    "sglang/srt/mem_cache/evict_policy.py",
    "sglang/srt/mem_cache/events.py",
    "sglang/srt/mem_cache/utils.py",
    "sglang/srt/mem_cache/allocator/__init__.py",
    "sglang/srt/mem_cache/allocator/base.py",
    "sglang/srt/mem_cache/allocator/token.py",
    "sglang/srt/mem_cache/allocator/paged.py",
)
"""What is imported for real; any other `sglang.*` module is a stub."""

_OVERRIDES: dict[str, dict[str, Any]] = {
    "sglang.srt.utils": {
        "get_bool_env_var": lambda name, default="false": False,
        "is_hip": lambda: False,
        "next_power_of_2": lambda n: 1 << max(0, n - 1).bit_length(),
    },
    "sglang.srt.utils.common": {"ceil_align": lambda n, align: -(-n // align) * align},
    # no Triton here: alloc_extend / alloc_decode would fall back to their torch versions
    "sglang.srt.platforms": {
        "current_platform": SimpleNamespace(capabilities=SimpleNamespace(supports_triton=False))
    },
}


class _Stub(type):
    """A stand-in for any name a stubbed module exports: attributes and calls give stubs."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _Stub(cls.__name__, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every `sglang.*` module that the extracted files do not provide."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__dict__.update(_OVERRIDES.get(spec.name, {}))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@dataclass(frozen=True)
class SGLang:
    """The loaded classes."""

    version: str
    RadixCache: Any
    RadixKey: Any
    CacheInitParams: Any
    MatchPrefixParams: Any
    InsertParams: Any
    EvictParams: Any
    TokenToKVPoolAllocator: Any
    PagedTokenToKVPoolAllocator: Any


def fetch_wheel(dest: Path, version: str = SGLANG_VERSION) -> Path | None:
    """The sglang wheel in `dest`, downloaded if absent; None when pip cannot get it."""
    found = sorted(dest.glob(f"sglang-{version}-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps"]
        run = subprocess.run(
            [*pip, "--only-binary", ":all:", "--quiet", "--dest", str(dest)],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        found = sorted(dest.glob(f"sglang-{version}-*.whl"))
        if run.returncode != 0 or not found:
            return None
    return found[0]


def load(wheel: Path, into: Path, version: str = SGLANG_VERSION) -> SGLang:
    """Extract the prefix cache's files from `wheel` into `into` and import them."""
    with zipfile.ZipFile(wheel) as archive:
        for name in _REAL:
            archive.extract(name, into)
    for package in ("sglang", "sglang/srt", "sglang/srt/mem_cache"):
        (into / package / "__init__.py").write_text("")  # plain packages, not the real inits
    sys.path.insert(0, str(into))
    sys.meta_path.append(_StubFinder())  # after the path finder: only what is not extracted
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    params = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
    token = importlib.import_module("sglang.srt.mem_cache.allocator.token")
    paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    for module in (radix, base, params, token, paged):
        assert str(into) in (module.__file__ or ""), f"{module.__name__} is not the real file"
    return SGLang(
        version,
        radix.RadixCache,
        radix.RadixKey,
        params.CacheInitParams,
        base.MatchPrefixParams,
        base.InsertParams,
        base.EvictParams,
        token.TokenToKVPoolAllocator,
        paged.PagedTokenToKVPoolAllocator,
    )
