"""Every MOEGEN_* environment variable, typed, in one place.

Read the variables through these functions (never os.environ elsewhere) so that the set of
knobs is discoverable and tests can override them with ``scope``.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Optional

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def template_dir() -> Path:
    """MOEGEN_TEMPLATE_DIR, else the repository's templates/ folder."""
    return Path(os.environ.get("MOEGEN_TEMPLATE_DIR") or _REPO_ROOT / "templates")


def tuned_config_dir() -> Optional[Path]:
    """MOEGEN_TUNED_CONFIG_DIR: a tuning database consulted before the shipped one."""
    value = os.environ.get("MOEGEN_TUNED_CONFIG_DIR")
    return Path(value) if value else None


def require_tuned() -> bool:
    """MOEGEN_REQUIRE_TUNED=1: a tuning-database miss is an error instead of a cost-model default."""
    return _flag("MOEGEN_REQUIRE_TUNED")


def precompile() -> Optional[bool]:
    """MOEGEN_PRECOMPILE: 1 forces, 0 skips compiling kernels into the package at build time;
    unset: compile when the build runs on the spec's target GPU."""
    value = os.environ.get("MOEGEN_PRECOMPILE", "").strip()
    return None if not value else _flag("MOEGEN_PRECOMPILE")


def route_align_max_tokens() -> Optional[int]:
    """MOEGEN_ROUTE_ALIGN_MAX_TOKENS: batches up to this size are routed and aligned by the
    single-program kernel, larger ones by the multi-program pair. Unset: the shape decides (see
    moegen.runtime.fused.single_route_max_tokens)."""
    value = os.environ.get("MOEGEN_ROUTE_ALIGN_MAX_TOKENS", "").strip()
    return int(value) if value else None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through Triton's interpreter."""
    return _flag("TRITON_INTERPRET")


@contextlib.contextmanager
def scope(**values: Optional[str]) -> Iterator[None]:
    """Temporarily set (or, with None, unset) environment variables, e.g. scope(MOEGEN_REQUIRE_TUNED="1")."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
