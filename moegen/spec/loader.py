"""Spec loader: YAML text -> the frozen dataclasses of schema.py, or every problem as SpecProblems.

The walk over the schema is generic (dataclasses.fields + type hints): a new field in schema.py is
parsed and type-checked with no change here; only value bounds and cross-field rules live in this
file. Nothing from the spec is evaluated: the YAML is composed into plain nodes with the safe
resolver, and only untagged scalars, lists and mappings are accepted.

Problems are collected in document order (a field with a problem is skipped and the walk goes on),
then, where every field was readable, the cross-field rules in a fixed order (of a chain of
dependent rules, the first that fails); each as FILE:LINE:COL: field.path: what is wrong; how to fix it. A YAML syntax error stops
the reading at once: nothing after it can be trusted.
"""
from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import os
import re
import stat
import typing
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Union

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from moegen import target as gpus
from moegen.errors import SpecError, SpecProblems
from moegen.quant.formats import FP8_MIN_ARCH
from moegen.spec import schema
from moegen.spec.schema import Spec

# Bounds far above any real model, yet low enough that a typo (an extra digit) is caught before
# it becomes a huge allocation or an absurd kernel grid. Named in the messages.
MAX_DIM = 1 << 20  # hidden_size, intermediate_size, shared_intermediate_size
MAX_EXPERTS = 1 << 16  # num_experts, n_group, topk_group
MAX_TOP_K = 64
MAX_LAYERS = 4096
MAX_SHARED_EXPERTS = 64
MAX_TOKENS = 1 << 20  # one token bucket
MAX_BUCKETS = 64  # entries in workload.token_buckets: each one is a compiled/tuned variant
MAX_SM_COUNT = 1024
MAX_NAME_LEN = 64
MAX_SPEC_BYTES = 1 << 20

_YAML_TAG = "tag:yaml.org,2002:"
_MAP_TAG, _SEQ_TAG = _YAML_TAG + "map", _YAML_TAG + "seq"
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*\Z")


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's YAML 1.1 with numbers read as YAML 1.2 (and people) write them: 1e2 is a number,
    12:30 (base 60 in 1.1) a string, 012 twelve rather than octal ten."""


_INT_TAG, _FLOAT_TAG = _YAML_TAG + "int", _YAML_TAG + "float"
_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_SpecLoader.add_implicit_resolver(_INT_TAG, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$"),
                                  list("-+0123456789"))
_SpecLoader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9][0-9_]*(?:\.[0-9_]*)?)(?:[eE][-+]?[0-9]+)?"
                           r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


class _SpecConstructor(SafeConstructor):
    """Plain scalars into int/float/bool/str only; integers as _SpecLoader resolves them."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node).replace("_", "")
        return int(text, 16 if text.startswith("0x") else 8 if text.startswith("0o") else 10)


_SpecConstructor.add_constructor(_INT_TAG, _SpecConstructor.construct_yaml_int)


@dataclass(frozen=True)
class _Bound:
    lo: float
    hi: Optional[float] = None
    hi_name: str = ""  # the named limit, e.g. "MAX_DIM = 2^20"
    open_lo: bool = False  # lo itself is not allowed (strictly positive floats)


_POSITIVE = _Bound(0, open_lo=True)
# A rate override: slower than any device (the interpreter target's 0.01) or a million times
# faster than today's is a typo, and would give the planner infinite or zero times.
_RATE = _Bound(0.01, 1e6, "10^6, a thousand times today's fastest GPU")
_BOUNDS: dict[str, _Bound] = {
    "model.hidden_size": _Bound(1, MAX_DIM, "MAX_DIM = 2^20"),
    "model.intermediate_size": _Bound(1, MAX_DIM, "MAX_DIM = 2^20"),
    "model.num_experts": _Bound(1, MAX_EXPERTS, "MAX_EXPERTS = 65536"),
    "model.top_k": _Bound(1, MAX_TOP_K, "MAX_TOP_K = 64"),
    "model.num_layers": _Bound(1, MAX_LAYERS, "MAX_LAYERS = 4096"),
    "model.n_group": _Bound(1, MAX_EXPERTS, "MAX_EXPERTS = 65536"),
    "model.topk_group": _Bound(1, MAX_EXPERTS, "MAX_EXPERTS = 65536"),
    "model.routed_scaling_factor": _Bound(0, 1e6, "10^6", open_lo=True),
    "model.num_shared_experts": _Bound(0, MAX_SHARED_EXPERTS, "MAX_SHARED_EXPERTS = 64"),
    "model.shared_intermediate_size": _Bound(0, MAX_DIM, "MAX_DIM = 2^20"),
    "target.expert_memory_gib": _POSITIVE,
    "target.hbm_gbps": _RATE,
    "target.bf16_tflops": _RATE,
    "target.host_link_gbps": _RATE,
    "target.sm_count": _Bound(1, MAX_SM_COUNT, "MAX_SM_COUNT = 1024"),
    "workload.token_buckets[]": _Bound(1, MAX_TOKENS, "MAX_TOKENS = 2^20"),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.activation": schema.ACTIVATIONS,
    "model.scoring": schema.SCORINGS,
    "model.dtype": schema.DTYPES,
    "model.router_dtype": schema.DTYPES,
    "model.quantization": schema.QUANTIZATIONS,
    "offload.policy": schema.OFFLOAD_POLICIES,
    "offload.prefetch": schema.PREFETCH_MODES,
}


@dataclass(frozen=True)
class _Issue:
    """A problem found by a field check; index points at the offending list item, if any."""

    problem: str
    fix: str
    index: Optional[int] = None


# ---------------------------------------------------------------------------------------------
# Entry points


def load_spec(path) -> Spec:
    """Read, parse and validate a spec file; raises SpecError naming file, line, field and fix."""
    filename = str(path)
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise SpecError(filename, "", "is a directory", "pass the path of a .yaml spec file")
        if not stat.S_ISREG(mode):  # a pipe would block, a device never end
            raise SpecError(filename, "", "not a regular file", "pass the path of a .yaml spec file")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(filename, "", "file not found",
                        "check the path (relative paths start at the current directory)") from None
    except OSError as exc:
        raise SpecError(filename, "", f"cannot read the file ({exc.strerror or exc})",
                        "check that it exists and is readable") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(filename, "", f"file is over the {MAX_SPEC_BYTES} byte limit",
                        "a spec is a few dozen lines; check that this is the right file")
    try:
        text = raw.decode("utf-8-sig")  # -sig: tolerate a byte-order mark from Windows editors
    except UnicodeDecodeError as exc:
        raise SpecError(filename, "", f"not UTF-8 text (bad byte at offset {exc.start})",
                        "save the file as UTF-8") from None
    return load_spec_text(text, filename)


def load_spec_text(text: str, filename: str = "<string>") -> Spec:
    """Parse and validate spec YAML text; filename is only used in messages. Raises SpecProblems
    with every problem found."""
    root = _compose(text, filename)
    walker = _Walker(filename)
    try:
        spec = walker.build(Spec, root, "")
    except _Skipped:
        spec = None
    if spec is not None:
        walker.cross_check(spec)
    if walker.problems:
        raise SpecProblems(walker.problems)
    return spec


def _compose(text: str, filename: str) -> MappingNode:
    """The YAML node tree (nodes keep their marks), or a SpecError for syntax problems."""
    try:
        root = yaml.compose(text, Loader=_SpecLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or "syntax error"
        if exc.context:
            problem += f" ({exc.context})"
        if "\\t" in problem or "\t" in problem:
            fix = "indent with spaces, not tabs"
        elif "single document" in problem:
            fix = "a spec is one YAML document; remove the extra '---'"
        else:
            fix = "fix the YAML syntax here (indentation, ':' after keys, matching quotes and brackets)"
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        raise SpecError(filename, "", f"invalid YAML: {problem}", fix, line, col) from None
    except RecursionError:
        raise SpecError(filename, "", "invalid YAML: nested too deeply",
                        "a spec nests its fields two levels deep; check the brackets") from None
    except yaml.reader.ReaderError as exc:  # a control character; the reader knows only its offset
        before = text[: exc.position]
        line, col = before.count("\n") + 1, exc.position - (before.rfind("\n") + 1) + 1
        raise SpecError(filename, "", f"invalid YAML: unacceptable character #x{exc.character:04x}",
                        "remove the non-printable character", line, col) from None
    if root is None:
        raise SpecError(filename, "", "the spec is empty",
                        "start from a shipped spec such as specs/mixtral-8x7b.yaml")
    if not isinstance(root, MappingNode):
        raise SpecError(filename, "", f"the top level must be a mapping, got {_describe(root)}",
                        "write `name: ...` and a `model:` section at the top level", *_pos(root))
    return root


# ---------------------------------------------------------------------------------------------
# The generic walk


class _Skipped(Exception):
    """A value with a problem (recorded): the field is skipped and the walk goes on."""


class _Walker:
    """Builds schema dataclasses from nodes, recording each problem and going on with the next
    field; remembers each field's position for later rules."""

    def __init__(self, filename: str):
        self.file = filename
        self.problems: list[SpecError] = []
        self.positions: dict[str, tuple[int, int]] = {"": (1, 1)}  # path -> value's (line, col)
        self.key_positions: dict[str, tuple[int, int]] = {"": (1, 1)}  # path -> its key's (line, col)
        self._constructor = _SpecConstructor()

    def note(self, path: str, where: Union[Node, tuple[int, int]], problem: str, fix: str) -> None:
        line, col = where if isinstance(where, tuple) else _pos(where)
        self.problems.append(SpecError(self.file, path, problem, fix, line, col))

    def fail(self, path: str, where: Union[Node, tuple[int, int]], problem: str, fix: str) -> NoReturn:
        """Record the problem and skip the value it is in."""
        self.note(path, where, problem, fix)
        raise _Skipped

    def build(self, cls: type, node: Node, path: str) -> Any:
        """One dataclass from a mapping node: keys in document order, then missing keys. Skipped
        (after recording what is wrong) where any of its fields has a problem."""
        if _is_null(node):  # an empty section (`offload:` with nothing under it) means defaults
            node = MappingNode(_MAP_TAG, [], node.start_mark, node.end_mark)
        if not isinstance(node, MappingNode) or node.tag != _MAP_TAG:
            self.fail(path, node, f"expected a mapping, got {_describe(node)}",
                      f"write the {path} fields as indented `key: value` lines")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        problems_before = len(self.problems)
        for key_node, value_node in node.value:
            try:
                self._field(cls, path, fields, hints, key_node, value_node, first_line, values)
            except _Skipped:
                pass
        for f in fields.values():
            # A misspelt key already names the missing one in its fix ("did you mean ...?").
            misspelt = any(_close_field(key, cls) == f.name for key in first_line if key not in fields)
            if f.name not in first_line and _is_required(f) and not misspelt:
                where = f"under `{path}:`" if path else "at the top level"
                self.note(_join(path, f.name), self.key_positions.get(path, _pos(node)),
                          f"missing required key {f.name!r}",
                          f"add `{f.name}: <{_expected(hints[f.name])}>` {where}")
        if len(self.problems) > problems_before:
            raise _Skipped
        return cls(**values)

    def _field(self, cls: type, path: str, fields: dict, hints: dict, key_node: Node, value_node: Node,
               first_line: dict[str, int], values: dict[str, Any]) -> None:
        """One `key: value` of a mapping into values (first_line: where each key was first set)."""
        if not isinstance(key_node, ScalarNode):
            self.fail(path, key_node, f"a key must be a plain name, got {_describe(key_node)}",
                      "write keys as plain words followed by ':'")
        key, sub = key_node.value, _join(path, key_node.value)
        if key in first_line:
            self.fail(_join(path, _short(key)), key_node,
                      f"duplicate key '{_short(key)}' (first set on line {first_line[key]})",
                      "keep only one of them")
        first_line[key] = _pos(key_node)[0]
        self.key_positions[sub] = _pos(key_node)
        if key not in fields:
            self.fail(_join(path, _short(key)), key_node, f"unknown key '{_short(key)}'",
                      _unknown_key_fix(key, cls, hints, path))
        self.positions[sub] = _pos(value_node)
        values[key] = self.convert(hints[key], value_node, sub, fields[key].default)

    def convert(self, hint: Any, node: Node, path: str, default: Any = dataclasses.MISSING) -> Any:
        """A value of the schema type `hint`, then the path's bound, choice and field checks."""
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is Union:  # Optional[X]: null is allowed and means "not set"
            if _is_null(node):
                return None
            return self.convert(next(a for a in args if a is not type(None)), node, path)
        if dataclasses.is_dataclass(hint):
            return self.build(hint, node, path)
        if origin in (tuple, list):
            if not isinstance(node, SequenceNode) or node.tag != _SEQ_TAG:
                self.fail(path, node, f"expected {_expected(hint)}, got {_describe(node)}",
                          "write a list such as [1, 4, 16]")
            problems_before, items = len(self.problems), []
            for i, item in enumerate(node.value):  # every item's problem, not only the first
                try:
                    items.append(self.convert(args[0], item, f"{path}[{i}]"))
                except _Skipped:
                    pass
            if len(self.problems) > problems_before:
                raise _Skipped
            value = tuple(items) if origin is tuple else items
        elif hint in (bool, int, float, str):
            value = self.scalar(hint, node, path, default)
        else:  # a schema type this walker does not know yet: a programming error, not a spec error
            raise TypeError(f"moegen.spec.loader cannot read {hint!r} (field {path})")
        self.check(path, value, node)
        return value

    def scalar(self, hint: type, node: Node, path: str, default: Any) -> Any:
        kind = _kind(node)
        accepted = {bool: ("bool",), int: ("int",), float: ("int", "float"), str: ("str",)}[hint]
        if kind not in accepted:
            self.fail(path, node, f"expected {_expected(hint)}, got {_describe(node)}",
                      _type_fix(hint, kind, node, default))
        try:
            value = self._constructor.construct_object(node)
        except (ValueError, KeyError, yaml.YAMLError):  # e.g. `!!int abc`, or thousands of digits
            if kind == "int":
                self.fail(path, node, f"{_short(node.value)} is too large", f"write {_expected(hint)} of a few digits")
            self.fail(path, node, f"'{_short(node.value)}' is not {_expected(hint)}",
                      f"write {_expected(hint)}")
        if hint is float:
            try:
                value = float(value)
            except OverflowError:  # an integer of hundreds of digits
                value = math.inf
            if not math.isfinite(value):
                self.fail(path, node, f"expected a finite number, got {_short(node.value)}", "write a finite number")
        return value

    def check(self, path: str, value: Any, node: Node) -> None:
        """Per-field rules that need only this field's value."""
        generic = re.sub(r"\[\d+\]", "[]", path)
        bound = _BOUNDS.get(generic)
        if bound is not None:
            issue = _check_bound(value, bound)
            if issue:
                self.fail(path, node, *issue)
        choices = _CHOICES.get(generic)
        if choices is not None and value not in choices:
            close = difflib.get_close_matches(value.lower(), choices, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            self.fail(path, node, f"{value!r} is not supported", f"{hint}use one of: {', '.join(choices)}")
        field_check = _FIELD_CHECKS.get(generic)
        if field_check is not None:
            issue = field_check(value)
            if issue is not None:
                where = node.value[issue.index] if issue.index is not None else node
                item_path = path if issue.index is None else f"{path}[{issue.index}]"
                self.fail(item_path, where, issue.problem, issue.fix)

    def cross_check(self, spec: Spec) -> None:
        """Rules across fields, in a fixed order; each points at the field that must change. In
        a chain of rules only the first that fails is reported: the later ones assume it holds."""
        for chain in _CROSS_RULES:
            found = next(filter(None, (rule(spec) for rule in chain)), None)
            if found is not None:
                path, problem, fix = found
                self.note(path, self.position(path), problem, fix)

    def position(self, path: str) -> tuple[int, int]:
        """Where a field's value is written; for a defaulted field, the key of its section."""
        if path in self.positions:
            return self.positions[path]
        while path not in self.key_positions:
            path = path.rpartition(".")[0]
        return self.key_positions[path]


# ---------------------------------------------------------------------------------------------
# Node helpers


def _pos(node: Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == _YAML_TAG + "null"


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _kind(node: Node) -> str:
    """'null', 'bool', 'int', 'float', 'str', 'list', 'mapping', or the node's other tag."""
    if isinstance(node, MappingNode):
        return "mapping"
    if isinstance(node, SequenceNode):
        return "list"
    return node.tag.removeprefix(_YAML_TAG)


def _short(text: str) -> str:
    """A value as messages quote it: at most 40 characters, control characters escaped."""
    text = text if len(text) <= 40 else text[:37] + "..."
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _describe(node: Node) -> str:
    kind = _kind(node)
    if kind in ("mapping", "list"):
        plain = node.tag in (_MAP_TAG, _SEQ_TAG)
        return f"a {kind}" if plain else f"a {kind} tagged {_short(node.tag.removeprefix(_YAML_TAG))!r}"
    text = _short(node.value)
    return {
        "null": "null",
        "bool": f"a boolean ({text})",
        "int": f"an integer ({text})",
        "float": f"a number ({text})",
        "str": f"a string ({text!r})",
    }.get(kind, f"a value tagged {kind!r} ({text})")


def _expected(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return _expected(next(a for a in args if a is not type(None))) + " or null"
    if origin in (tuple, list):
        return f"a list of {_expected(args[0]).removeprefix('an ').removeprefix('a ')}s"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _type_fix(hint: type, kind: str, node: Node, default: Any) -> str:
    if kind == "null":
        if default is dataclasses.MISSING:
            return f"write {_expected(hint)}"
        return f"write {_expected(hint)}, or remove the key to use the default ({default!r})"
    if hint is int and kind == "bool":
        return "write a whole number (true/false/yes/no/on/off are booleans in YAML)"
    if hint is int and kind == "float":
        return "write a whole number, without a decimal point"
    if hint in (int, float) and kind == "str":
        return "write a plain number, without quotes or units"
    if hint is str and kind in ("int", "float", "bool"):
        return f"quote it: \"{node.value}\""
    if hint is bool:
        return "write true or false"
    return f"write {_expected(hint)} (YAML tags such as !!x are not supported)"


def _close_field(key: str, cls: type) -> Optional[str]:
    """The field of cls that an unknown key is likely a misspelling of."""
    close = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(cls)], n=1, cutoff=0.6)
    return close[0] if close else None


def _unknown_key_fix(key: str, cls: type, hints: dict[str, Any], path: str) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = _close_field(key, cls)
    if close:
        return f"did you mean {close!r}?"
    for name in names:  # a key of a sub-section written one level too high, e.g. top-level top_k
        sub = hints[name]
        if dataclasses.is_dataclass(sub) and key in {f.name for f in dataclasses.fields(sub)}:
            return f"it belongs under `{_join(path, name)}:`"
    return f"remove it; {'`' + path + ':`' if path else 'the top level'} accepts: {', '.join(names)}"


# ---------------------------------------------------------------------------------------------
# Field checks (one field's value)


def _check_bound(value: float, bound: _Bound) -> Optional[tuple[str, str]]:
    lo = int(bound.lo) if float(bound.lo).is_integer() else bound.lo
    if bound.open_lo and value <= bound.lo:
        return f"must be greater than {lo}, got {value}", "use a positive value"
    if value < bound.lo:
        span = f"{lo}..{bound.hi}" if bound.hi is not None else f">= {lo}"
        return f"must be at least {lo}, got {value}", f"use a value in {span}"
    if bound.hi is not None and value > bound.hi:
        return (f"{value} is larger than {bound.hi}",
                f"use a value in {lo}..{bound.hi} ({bound.hi_name} is far above any real model; "
                "check for an extra digit)")
    return None


def _check_name(name: str) -> Optional[_Issue]:
    example = "use ASCII letters, digits, '-', '_' and '.', starting with a letter, e.g. 'mixtral-8x7b'"
    if not name:
        return _Issue("name is empty", example)
    if not _NAME_RE.match(name):
        if not ("a" <= name[0].lower() <= "z"):
            return _Issue(f"{name!r} must start with an ASCII letter", example)
        bad = next(c for c in name if not re.match(r"[A-Za-z0-9_.\-]", c))
        return _Issue(f"{name!r} contains {bad!r}", example)
    if len(name) > MAX_NAME_LEN:
        return _Issue(f"name is {len(name)} characters long", f"use at most {MAX_NAME_LEN} characters")
    package = name.replace("-", "_").replace(".", "_")
    if keyword.iskeyword(package):
        return _Issue(f"{name!r} would make the package name {package!r}, a Python keyword",
                      f"pick another name, e.g. '{name}-moe'")
    return None


def _check_gpu(gpu: str) -> Optional[_Issue]:
    if gpus.lookup_gpu(gpu) is not None:
        return None
    close = gpus.suggest_gpu(gpu)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return _Issue(f"unknown gpu {gpu!r}", f"{hint}known: {', '.join(gpus.known_gpu_names())}")


def _check_buckets(buckets: tuple[int, ...]) -> Optional[_Issue]:
    if not buckets:
        return _Issue("token_buckets is empty", "list the batch sizes to compile for, e.g. [1, 16, 256]")
    if len(buckets) > MAX_BUCKETS:
        return _Issue(f"{len(buckets)} token buckets, over MAX_BUCKETS = {MAX_BUCKETS}",
                      "keep the powers of two you serve; each bucket is compiled and tuned")
    for i in range(1, len(buckets)):
        if buckets[i] == buckets[i - 1]:  # earlier buckets are increasing, so only a neighbour can repeat
            return _Issue(f"duplicate token bucket {buckets[i]}", "remove the duplicate and sort them ascending", i)
        if buckets[i] < buckets[i - 1]:
            return _Issue(f"token buckets must be strictly increasing, but {buckets[i]} follows {buckets[i - 1]}",
                          f"sort them ascending: {sorted(set(buckets))}", i)
    return None


def _check_group_size(size: int) -> Optional[_Issue]:
    if size not in schema.INT4_GROUP_SIZES:
        return _Issue(f"{size} is not a supported group size",
                      f"use one of: {', '.join(map(str, schema.INT4_GROUP_SIZES))} (inputs per scale)")
    return None


_FIELD_CHECKS: dict[str, Callable[[Any], Optional[_Issue]]] = {
    "name": _check_name,
    "model.quantization_group_size": _check_group_size,
    "target.gpu": _check_gpu,
    "workload.token_buckets": _check_buckets,
}


# ---------------------------------------------------------------------------------------------
# Cross-field rules: each returns (field path, problem, fix) or None


def _top_k_fits(spec: Spec):
    m = spec.model
    if m.top_k > m.num_experts:
        return ("model.top_k", f"top_k {m.top_k} is larger than num_experts {m.num_experts}",
                f"use a top_k in 1..{m.num_experts}")


def _groups_divide_experts(spec: Spec):
    m = spec.model
    if m.num_experts % m.n_group:
        divisors = [d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0][:8]
        return ("model.n_group", f"num_experts {m.num_experts} is not divisible by n_group {m.n_group}",
                f"use a divisor of {m.num_experts}, e.g. {', '.join(map(str, divisors))}")


def _topk_group_fits(spec: Spec):
    m = spec.model
    if m.topk_group > m.n_group:
        return ("model.topk_group", f"topk_group {m.topk_group} is larger than n_group {m.n_group}",
                f"use a topk_group in 1..{m.n_group}")


def _enough_eligible_experts(spec: Spec):
    m = spec.model
    per_group = m.num_experts // m.n_group
    if m.topk_group * per_group < m.top_k <= m.num_experts:  # a top_k over num_experts: _top_k_fits
        need = -(-m.top_k // per_group)
        return ("model.topk_group",
                f"only topk_group * num_experts / n_group = {m.topk_group * per_group} experts are "
                f"eligible, fewer than top_k {m.top_k}",
                f"raise topk_group to at least {need} or lower top_k")


def _bias_groups_have_two(spec: Spec):
    m = spec.model
    if m.correction_bias and m.n_group > 1 and m.num_experts // m.n_group < 2:
        return ("model.n_group",
                f"n_group {m.n_group} leaves 1 expert per group, but with correction_bias a group's "
                "score is the sum of its top-2 experts",
                f"use an n_group of at most {m.num_experts // 2}")


def _shared_experts_sized(spec: Spec):
    m = spec.model
    if m.num_shared_experts > 0 and m.shared_intermediate_size <= 0:
        return ("model.shared_intermediate_size",
                f"num_shared_experts is {m.num_shared_experts} but shared_intermediate_size is "
                f"{m.shared_intermediate_size}",
                "set shared_intermediate_size to each shared expert's FFN width, or num_shared_experts: 0")


def _int4_fields_only_for_int4(spec: Spec):
    m = spec.model
    if m.quantization == "int4_group":
        return None
    if m.quantization_group_size != 128:
        return ("model.quantization_group_size",
                f"a group size of {m.quantization_group_size} with quantization {m.quantization}: only int4_group "
                "has groups (fp8_block's blocks are 128 x 128)", "remove it (or 128), or use int4_group")
    if m.quantization_zero_point:
        return ("model.quantization_zero_point", f"zero points with quantization {m.quantization}: only "
                "int4_group has them", "remove it (or false), or use int4_group")


def _fp8_needs_fp8_tensor_cores(spec: Spec):
    gpu = gpus.lookup_gpu(spec.target.gpu)
    if spec.model.weight_format.fp8 and gpu is not None and 0 < gpu.arch < FP8_MIN_ARCH:
        return ("model.quantization", f"{spec.model.quantization} multiplies on fp8 tensor cores, which the "
                f"{gpu.alias} (sm_{gpu.arch}) lacks", f"use int4_group, or target an sm_{FP8_MIN_ARCH} or newer GPU")


def _expert_memory_fits(spec: Spec):
    budget, gpu = spec.target.expert_memory_gib, gpus.lookup_gpu(spec.target.gpu)
    if budget is not None and gpu is not None and budget > gpu.memory_gib:
        return ("target.expert_memory_gib",
                f"{budget:g} GiB is more than the {gpu.alias}'s {gpu.memory_gib:g} GiB of memory",
                f"use at most {gpu.memory_gib:g} (or null for 90%: {0.9 * gpu.memory_gib:.1f})")


def _gib_at_least(nbytes: int) -> float:
    """nbytes in GiB, rounded up at the third significant digit (a whole GiB would tell a small
    model's user nothing)."""
    gib = nbytes / 2**30
    step = 10.0 ** (math.floor(math.log10(gib)) - 2)
    return math.ceil(gib / step - 1e-9) * step


def expert_memory_shortfall(spec: Spec):
    """Offloading needs a slot for each of a token's top_k experts in every layer."""
    m, budget = spec.model, gpus.expert_memory_gib(spec)
    slots, need = int(budget * 2**30) // m.expert_bytes, m.num_layers * m.top_k
    if slots < need:
        need_gib, gpu = _gib_at_least(need * m.expert_bytes), gpus.lookup_gpu(spec.target.gpu)
        fix = f"raise target.expert_memory_gib to at least {need_gib:.3g}"
        if gpu is not None and need_gib > gpu.memory_gib:
            fix = f"that is more than the {gpu.alias}'s {gpu.memory_gib:g} GiB: target a GPU with more memory"
        return ("target.expert_memory_gib",
                f"{budget:g} GiB holds {slots} experts of {m.expert_bytes / 2**20:.3g} MiB, but "
                f"{m.num_layers} layers x top-{m.top_k} need {need}", fix)


_CROSS_RULES = (
    (_top_k_fits,),
    (_groups_divide_experts, _topk_group_fits, _enough_eligible_experts, _bias_groups_have_two),
    (_shared_experts_sized,),
    (_int4_fields_only_for_int4,),
    (_fp8_needs_fp8_tensor_cores,),
    (_expert_memory_fits, expert_memory_shortfall),
)
