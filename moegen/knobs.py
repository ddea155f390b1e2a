"""Every MOEGEN_* environment variable, typed, in one place.

Read the variables through these functions (never os.environ elsewhere) so that the set of
knobs is discoverable and tests can override them with ``scope``.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from moegen.errors import SettingError

SHIPPED_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _value(name: str) -> str:
    return os.environ.get(name, "").strip()


def _switch(name: str, meaning: str) -> Optional[bool]:
    """An on/off variable: None when unset or empty. A value that is neither is an error, not off."""
    value = _value(name)
    if not value:
        return None
    if value.lower() in _ON + _OFF:
        return value.lower() in _ON
    raise SettingError(name, value, "not an on/off value", f"set it to 1 ({meaning}) or 0, or unset it")


def readable_folder(path: Path) -> bool:
    """Whether this process may list the folder and open what is in it."""
    return os.access(path, os.R_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids)


def _folder(name: str, must_exist: bool) -> Optional[Path]:
    """A folder variable's path (~ expanded); unless must_exist, one that can still be created."""
    value = _value(name)
    if not value:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_dir():
            if readable_folder(path):
                return path
            problem = "a folder moegen may not read"
        elif path.exists():
            problem = "is a file, not a folder"
        elif must_exist:
            problem = "no such folder"
        else:
            above = next(parent for parent in path.parents if parent.exists())  # "/" at worst
            if above.is_dir():
                return path
            problem = f"{above} is a file, not a folder"
    except OSError as error:  # a name too long, a loop of links, a folder on the way not searchable
        problem = f"unusable ({error.strerror})"
    raise SettingError(name, value, problem, "point it at a folder, or unset it")


def template_dir() -> Path:
    """MOEGEN_TEMPLATE_DIR (a copy of templates/, edited), else the repository's templates/ folder."""
    folder = _folder("MOEGEN_TEMPLATE_DIR", must_exist=True)
    if folder is None:
        return SHIPPED_TEMPLATES
    missing = sorted({p.name for p in SHIPPED_TEMPLATES.glob("*.jinja")}
                     - {p.name for p in folder.glob("*.jinja") if p.is_file()})
    if missing:
        raise SettingError("MOEGEN_TEMPLATE_DIR", str(folder), f"lacks {', '.join(missing)}",
                           "copy every template of templates/ there, or unset it")
    return folder


def tuned_config_dir() -> Optional[Path]:
    """MOEGEN_TUNED_CONFIG_DIR: a tuning database consulted before the shipped one (created on save)."""
    return _folder("MOEGEN_TUNED_CONFIG_DIR", must_exist=False)


def require_tuned() -> bool:
    """MOEGEN_REQUIRE_TUNED=1: a tuning-database miss is an error instead of a cost-model default."""
    return bool(_switch("MOEGEN_REQUIRE_TUNED", "a miss is an error"))


def precompile() -> Optional[bool]:
    """MOEGEN_PRECOMPILE: 1 forces, 0 skips compiling kernels into the package at build time;
    unset: compile when the build runs on the spec's target GPU."""
    return _switch("MOEGEN_PRECOMPILE", "compile kernels at build time")


def route_align_max_tokens() -> Optional[int]:
    """MOEGEN_ROUTE_ALIGN_MAX_TOKENS: batches up to this size are routed and aligned by the
    single-program kernel, larger ones by the multi-program pair. Unset: the shape decides (see
    moegen.runtime.fused.single_route_max_tokens)."""
    value = _value("MOEGEN_ROUTE_ALIGN_MAX_TOKENS")
    if not value:
        return None
    if value.isdecimal() and len(value) <= 9:
        return int(value)
    raise SettingError("MOEGEN_ROUTE_ALIGN_MAX_TOKENS", value, "not a token count",
                       "set it to a whole number of tokens (0: always the multi-program pair), or unset it")


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through Triton's interpreter (Triton's own
    variable, which Triton parses: read leniently here)."""
    return _value("TRITON_INTERPRET").lower() in _ON


@dataclass(frozen=True)
class Variable:
    """One MOEGEN_* variable: its name, what it does, and the function that reads it here."""

    name: str
    meaning: str
    read: Callable[[], object]


VARIABLES = (
    Variable("MOEGEN_TUNED_CONFIG_DIR", "a tuning database searched before the shipped tuned/ (and where tune "
             "saves)", tuned_config_dir),
    Variable("MOEGEN_REQUIRE_TUNED", "1: a bucket missing from the tuning database is an error, not a cost-model "
             "default", require_tuned),
    Variable("MOEGEN_PRECOMPILE", "0/1: skip / force compiling kernels into the package at build time (unset: "
             "on the spec's target GPU)", precompile),
    Variable("MOEGEN_TEMPLATE_DIR", "kernel templates (default: templates/)", template_dir),
    Variable("MOEGEN_ROUTE_ALIGN_MAX_TOKENS", "batches up to this size are routed by the single-program kernel, "
             "larger ones by the parallel pair (unset: the shape decides)", route_align_max_tokens),
)


def check() -> None:
    """Read every MOEGEN_* variable, so that a bad value stops a command before it does anything."""
    for variable in VARIABLES:
        variable.read()


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
