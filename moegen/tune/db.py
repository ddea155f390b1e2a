"""The tuning database: measured kernel configs per (device, kernel signature, token bucket).

One human-readable JSON file per (device, signature), named ``{signature.key}__{device_slug}.json``,
so the name holds every input that changes the answer. Each file carries metadata; an entry is used
only where device, signature, Triton version and kernel-template hash match. A value that is
missing or null is unknown: it does not invalidate, and the next save fills it in. Writes happen
under a file lock, merge with what is on disk and replace the file atomically; a file whose
metadata definitely differs is never overwritten.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, get_type_hints

import moegen
from moegen import knobs
from moegen.errors import MoegenError
from moegen.ir import KernelSignature
from moegen.plan.configs import malformed, violation
from moegen.render import template_hashes
from moegen.runtime.fused import KernelConfig
from moegen.target import GpuTarget

BUNDLE_FORMAT = "moegen-tuning-bundle"
BUNDLE_VERSION = 1
# Metadata fields that decide whether an entry applies; torch and moegen versions are only recorded
# (the torch build differs between CPU CI and the GPU machine without changing the kernels).
CHECKED_FIELDS = ("device", "signature", "triton", "template_hash")
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelConfig))
# Fields added later with a default (e.g. split_k) may be absent from older files.
_REQUIRED_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelConfig)
                                    if f.default is dataclasses.MISSING)
_FLAG_FIELDS = frozenset(f.name for f in dataclasses.fields(KernelConfig) if isinstance(f.default, bool))
_CONFIG_TYPES = {name: bool if name in _FLAG_FIELDS else int for name in _CONFIG_FIELDS}


class TuningInputError(MoegenError):
    """A tuning file or bundle that cannot be read: bad input, exit code 2."""

    exit_code = 2


class IncompatibleDbError(MoegenError):
    """A save would overwrite a file that holds results for a different device/version/templates."""

    exit_code = 2


class MissingTunedConfigError(MoegenError):
    """Strict mode (MOEGEN_REQUIRE_TUNED=1): the tuning database has no entry for a bucket."""

    exit_code = 2

    def __init__(self, device: str, signature: KernelSignature, tokens: int, dirs: Sequence[Path],
                 spec_path, notes: Sequence[str] = ()):
        self.device, self.signature_key, self.tokens = device, signature.key, tokens
        self.dirs, self.spec_path = list(dirs), str(spec_path)
        searched = "; ".join(notes) or ", ".join(map(str, self.dirs)) or "no directories"
        super().__init__(
            f"no tuned config for {tokens} tokens of {signature.key} on {device} "
            f"(file {db_file_name(device, signature)}; searched: {searched}); run "
            f"`moegen tune {spec_path}` on a {device} to tune it, or unset MOEGEN_REQUIRE_TUNED to "
            "build with the cost-model default")


@dataclass(frozen=True)
class DbMetadata:
    device: Optional[str]
    signature: Optional[dict]  # asdict(KernelSignature)
    triton: Optional[str]
    torch: Optional[str]
    moegen: Optional[str]
    template_hash: Optional[str]

    @classmethod
    def from_dict(cls, data: dict) -> "DbMetadata":
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class TunedEntry:
    config: KernelConfig
    time_us: float
    default_time_us: Optional[float]
    floor_pct: Optional[float]
    path: Path


def device_slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]", "_", device_name.lower())


def db_file_name(device_name: str, signature: KernelSignature) -> str:
    return f"{signature.key}__{device_slug(device_name)}.json"


def template_hash(names: Iterable[str]) -> str:
    """sha256 over the hashes of the templates that shape the compiled kernels."""
    hashes = template_hashes()
    missing = sorted(set(names) - set(hashes))
    if missing:
        raise MoegenError(f"kernel templates {missing} not found in {knobs.template_dir()}; "
                          "check MOEGEN_TEMPLATE_DIR")
    text = json.dumps({name: hashes[name] for name in names}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def installed_version(package: str) -> Optional[str]:
    # Package metadata, not an import: reading a version must not pay for importing triton.
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None  # unknown: compatible with anything, healed by whoever has it installed


def current_metadata(device_name: str, signature: KernelSignature, template_names: Iterable[str]) -> DbMetadata:
    return DbMetadata(device=device_name, signature=asdict(signature), triton=installed_version("triton"),
                      torch=installed_version("torch"), moegen=moegen.__version__,
                      template_hash=template_hash(template_names))


def current_versions(metadata: dict) -> DbMetadata:
    """What a file's entries must have been made with to apply now: this Triton and the templates
    of its signature's weight format (device and signature come from the file itself, so they
    are left unknown)."""
    from moegen.render import format_templates

    quantization = (metadata.get("signature") or {}).get("quantization") or "none"
    return DbMetadata(device=None, signature=None, triton=installed_version("triton"), torch=None, moegen=None,
                      template_hash=template_hash(format_templates(quantization)))


def _show(field: str, value) -> str:
    return str(value)[:12] if field == "template_hash" else str(value)


# Fields that a new moegen or Triton changes while the kernels keep their shape: results for other
# values are stale, not about another problem.
VERSION_FIELDS = ("triton", "template_hash")


def _differing(have: DbMetadata, want: DbMetadata) -> list[tuple[str, object, object]]:
    pairs = [(field, getattr(have, field), getattr(want, field)) for field in ("device", *VERSION_FIELDS)]
    pairs += [(f"signature.{name}", (have.signature or {}).get(name), value)
              for name, value in (want.signature or {}).items()]
    return [(field, a, b) for field, a, b in pairs if a is not None and b is not None and a != b]


def differences(have: DbMetadata, want: DbMetadata) -> list[str]:
    """Checked fields that definitely differ (both present and non-null), e.g. 'triton 3.5.0 != 3.6.0'."""
    return [f"{field} {_show(field, a)} != {_show(field, b)}" for field, a, b in _differing(have, want)]


def _heal(disk: DbMetadata, new: DbMetadata) -> DbMetadata:
    """New values win where known; unknown ones keep what the disk knew."""
    merged = {f.name: getattr(new, f.name) if getattr(new, f.name) is not None else getattr(disk, f.name)
              for f in dataclasses.fields(DbMetadata)}
    if disk.signature or new.signature:
        signature = dict(disk.signature or {})
        signature.update({k: v for k, v in (new.signature or {}).items() if v is not None})
        merged["signature"] = signature
    return DbMetadata(**merged)


# ---------------------------------------------------------------------------------------------
# reading and validating one file


def _number(value, nullable: bool, positive: bool) -> bool:
    """A finite JSON number (positive, or at least 0), or null where nullable."""
    if value is None:
        return nullable
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        value = float(value)
    except OverflowError:
        return False
    return math.isfinite(value) and (value > 0 if positive else value >= 0)


_TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(DbMetadata) if f.name != "signature")
_SIGNATURE_TYPES = get_type_hints(KernelSignature)  # int or str
_BUCKET = re.compile(r"[1-9][0-9]{0,8}")  # a token count, as str(int) writes it


def _signature_problem(signature) -> str | None:
    if signature is None:
        return None
    if not isinstance(signature, dict):
        return "metadata.signature is not an object"
    for name, value in signature.items():
        kind = _SIGNATURE_TYPES.get(name)
        if kind is None:
            return f"metadata.signature has no field {name!r}"
        if value is not None and type(value) is not kind:  # the exact type: true is no hidden size
            return f"metadata.signature.{name} is not {'an integer' if kind is int else 'a string'}"
    return None


def validate(data, where) -> dict:
    """The file content if it is a well-formed tuning file, else TuningInputError naming `where`."""
    def bad(reason: str):
        return TuningInputError(f"{where}: not a moegen tuning file ({reason}); fix or delete it, "
                                "`moegen tune SPEC` writes a fresh one")

    if not isinstance(data, dict) or not isinstance(data.get("metadata"), dict):
        raise bad("no metadata object")
    if not isinstance(data.get("buckets"), dict):
        raise bad("no buckets object")
    if not isinstance(data.get("failures", {}), dict) or \
            not all(isinstance(v, str) for v in data.get("failures", {}).values()):
        raise bad("failures is not an object of texts")
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad("text that is not valid Unicode") from None
    metadata = data["metadata"]
    for name in _TEXT_FIELDS:
        if metadata.get(name) is not None and not isinstance(metadata[name], str):
            raise bad(f"metadata.{name} is not a string")
    problem = _signature_problem(metadata.get("signature"))
    if problem:
        raise bad(problem)
    for tokens, bucket in data["buckets"].items():
        if not _BUCKET.fullmatch(tokens) or not isinstance(bucket, dict):
            raise bad(f"bucket {tokens!r} is not '<tokens>': {{...}}")
        config = bucket.get("config")
        if not isinstance(config, dict) or not _REQUIRED_CONFIG_FIELDS <= set(config) <= _CONFIG_FIELDS or \
                not all(isinstance(v, _CONFIG_TYPES[k]) and (k in _FLAG_FIELDS or not isinstance(v, bool))
                        for k, v in config.items()):
            raise bad(f"bucket {tokens}: config is not integer fields {sorted(_REQUIRED_CONFIG_FIELDS)} "
                      f"(optionally {sorted(_CONFIG_FIELDS - _REQUIRED_CONFIG_FIELDS - _FLAG_FIELDS)} and "
                      f"true/false {sorted(_FLAG_FIELDS)})")
        problem = malformed(KernelConfig(**config))
        if problem:
            raise bad(f"bucket {tokens}: config {problem}")
        if not _number(bucket.get("time_us"), False, True) or not _number(bucket.get("default_time_us"), True, True) \
                or not _number(bucket.get("floor_pct"), True, False):
            raise bad(f"bucket {tokens}: time_us and default_time_us are not positive numbers, "
                      "or floor_pct is not a number of at least 0")
        candidates = bucket.get("candidates", 0)
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 0:
            raise bad(f"bucket {tokens}: candidates is not a count")
    return {"metadata": metadata, "buckets": data["buckets"], "failures": data.get("failures", {})}


def _parse(text: str):
    """JSON text; ValueError also for nesting too deep for Python's parser."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _read_json(path: Path, missing: str, malformed: str):
    """JSON from path; TuningInputError "<path>: <missing>" or "<path>: <malformed with {error}>"."""
    try:
        return _parse(path.read_text())
    except FileNotFoundError:
        raise TuningInputError(f"{path}: {missing}") from None
    except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON, too deep, a number too long
        raise TuningInputError(f"{path}: {malformed.format(error=error)}") from None


def load_file(path: Path) -> dict:
    """A tuning file's content; TuningInputError (exit code 2) if it is unreadable or malformed."""
    path = Path(path)
    data = _read_json(path, "no such file; `moegen cache list` shows the tuning files",
                      "not a moegen tuning file ({error}); fix or delete it")
    return validate(data, path)


_warned: set[str] = set()


def _warn_once(path: Path, error: Exception, key: str = "") -> None:
    key = f"{Path(path).resolve()}:{key}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"ignored {error}", stacklevel=3)  # the error names the file


def db_files(directory: Path) -> list[Path]:
    """The tuning files of a directory (lock, temporary and .corrupt files excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("*.json") if not p.name.startswith(".") and p.is_file())


def dumps(content: dict) -> str:
    return json.dumps(content, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------------
# the search path and lookups


def shipped_dir() -> Path:
    """The tuned/ folder at the repository root: results shipped with moegen."""
    return Path(moegen.__file__).resolve().parents[1] / "tuned"


def default_search_path() -> list[Path]:
    """MOEGEN_TUNED_CONFIG_DIR (if set) first, then the shipped database."""
    user = knobs.tuned_config_dir()
    return ([user] if user else []) + [shipped_dir()]


class TuningDb:
    """An ordered list of directories; the first compatible file holding a bucket answers."""

    def __init__(self, dirs: Optional[Sequence[Path]] = None):
        self.dirs = [Path(d) for d in (default_search_path() if dirs is None else dirs)]

    def _files(self, device_name, signature, template_names) -> Iterable[tuple[Path, dict, list]]:
        """(path, content, differing fields) of each readable file for (device, signature), in order."""
        want = current_metadata(device_name, signature, template_names)
        for directory in self.dirs:
            path = directory / db_file_name(device_name, signature)
            if not path.exists():
                continue
            try:
                content = load_file(path)
            except TuningInputError as error:
                _warn_once(path, error)
                continue
            yield path, content, _differing(DbMetadata.from_dict(content["metadata"]), want)

    def _compatible(self, device_name, signature, template_names) -> Iterable[tuple[Path, dict]]:
        return ((path, content) for path, content, differ in self._files(device_name, signature, template_names)
                if not differ)

    def lookup(self, target: GpuTarget, signature: KernelSignature, tokens: int,
               template_names: Iterable[str]) -> Optional[TunedEntry]:
        """The first entry for the bucket whose config can run on the target; one that cannot (a
        hand-edited file) is warned about and passed over."""
        for path, content in self._compatible(target.name, signature, list(template_names)):
            bucket = content["buckets"].get(str(tokens))
            if bucket is None:
                continue
            config = KernelConfig(**bucket["config"])
            problem = violation(config, signature, target)
            if problem:
                _warn_once(path, TuningInputError(f"{path}: bucket {tokens}: config {problem}; "
                                                  f"`moegen tune SPEC --buckets {tokens} --force` replaces it"),
                           key=f"{tokens}")
                continue
            return TunedEntry(config, bucket["time_us"], bucket.get("default_time_us"), bucket.get("floor_pct"), path)
        return None

    def previous(self, device_name: str, signature: KernelSignature, tokens: int,
                 template_names: Iterable[str]) -> Optional[KernelConfig]:
        """The bucket's config in a file that only other templates or another Triton make stale:
        never an answer, but after an upgrade the tuner's best guess, timed before it is kept."""
        for _, content, differ in self._files(device_name, signature, list(template_names)):
            bucket = content["buckets"].get(str(tokens))
            if differ and bucket is not None and all(field in VERSION_FIELDS for field, _, _ in differ):
                return KernelConfig(**bucket["config"])
        return None

    def failures(self, device_name: str, signature: KernelSignature, template_names: Iterable[str]) -> dict:
        """Configs known to fail (compile/launch/verify), from every compatible file; earlier dirs win."""
        merged: dict = {}
        for _, content in self._compatible(device_name, signature, list(template_names)):
            merged = {**content["failures"], **merged}
        return merged

    def explain(self, target: GpuTarget, signature: KernelSignature, tokens: int,
                template_names: Iterable[str]) -> list[str]:
        """Why each directory did not answer: for the strict-mode error message."""
        want = current_metadata(target.name, signature, template_names)
        notes = []
        for directory in self.dirs:
            path = directory / db_file_name(target.name, signature)
            try:
                content = load_file(path)
            except TuningInputError as error:
                notes.append(f"{directory}: " + ("no file" if not path.exists() else f"corrupt ({error})"))
                continue
            stale = differences(DbMetadata.from_dict(content["metadata"]), want)
            bucket = content["buckets"].get(str(tokens))
            problem = bucket and violation(KernelConfig(**bucket["config"]), signature, target)
            notes.append(f"{directory}: " + (f"stale ({', '.join(stale)})" if stale else
                                             f"bucket {tokens}'s config {problem}" if problem else
                                             f"no bucket {tokens}"))
        return notes


def resolve(db: TuningDb, target: GpuTarget, signature: KernelSignature, tokens: int,
            template_names: Iterable[str], spec_path, strict: Optional[bool] = None) -> Optional[TunedEntry]:
    """db.lookup, except that a miss is MissingTunedConfigError where strict (None: where
    MOEGEN_REQUIRE_TUNED is set)."""
    template_names = list(template_names)
    entry = db.lookup(target, signature, tokens, template_names)
    if entry is None and (knobs.require_tuned() if strict is None else strict):
        raise MissingTunedConfigError(target.name, signature, tokens, db.dirs, spec_path,
                                      db.explain(target, signature, tokens, template_names))
    return entry


# ---------------------------------------------------------------------------------------------
# saving: lock, re-read, merge, atomic replace


def _bucket_record(value: dict) -> dict:
    config = value["config"]
    return {
        "config": asdict(config) if isinstance(config, KernelConfig) else dict(config),
        "time_us": float(value["time_us"]),
        "default_time_us": None if value.get("default_time_us") is None else float(value["default_time_us"]),
        "floor_pct": None if value.get("floor_pct") is None else float(value["floor_pct"]),
        "candidates": int(value.get("candidates", 0)),
    }


def atomic_write(path: Path, text: str) -> None:
    """Replace path's content all at once: a reader sees the old file or the new one."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o644)  # mkstemp makes 0600; the database is meant to be shared
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def _file_for(directory: Path, metadata: DbMetadata) -> Path:
    return Path(directory) / db_file_name(metadata.device, KernelSignature(**metadata.signature))


def _refuse_other_inputs(path: Path, disk: DbMetadata, new: DbMetadata) -> None:
    differ = differences(disk, new)
    if differ:
        raise IncompatibleDbError(
            f"{path} holds results for other inputs ({', '.join(differ)}; on disk != new); "
            "not overwritten. Save elsewhere with MOEGEN_TUNED_CONFIG_DIR=<other dir>, "
            "or move the file aside to re-tune")


def check_writable(directory: Path, metadata: DbMetadata) -> None:
    """Raise IncompatibleDbError now where save() would later refuse: a tuner checks this before it
    benchmarks anything. A corrupt file is no obstacle (save moves it aside)."""
    if directory.exists() and not directory.is_dir():
        raise TuningInputError(f"{directory}: a file, not a folder; save into a folder (--save-dir DIR)")
    path = _file_for(directory, metadata)
    try:
        disk = load_file(path) if path.exists() else None
    except TuningInputError:
        return
    if disk is not None:
        _refuse_other_inputs(path, DbMetadata.from_dict(disk["metadata"]), metadata)


def _aside(path: Path) -> Path:
    """Where a corrupt file goes: <name>.corrupt, or .corrupt.N beside earlier ones."""
    aside, n = path.with_name(path.name + ".corrupt"), 0
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt.{n}")
    return aside


def merge_file(path: Path, content: dict) -> bool:
    """Merge `content` (a valid tuning file) into `path`; returns True if the file changed.

    Under an exclusive lock, so that concurrent tuners lose nothing: buckets on disk are kept unless
    `content` has the same bucket (new wins), failures are unioned, unknown metadata heals."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        new_meta = DbMetadata.from_dict(content["metadata"])
        merged = {"metadata": asdict(new_meta), "buckets": dict(content["buckets"]),
                  "failures": dict(content["failures"])}
        old_text = None
        if path.exists():
            try:
                old_text = path.read_bytes().decode("utf-8", errors="surrogateescape")
            except OSError as error:  # not a file moegen could read: nothing to judge, nothing moved
                raise TuningInputError(f"{path}: cannot read it ({error.strerror}); fix its permissions or move "
                                       "it aside, then run the command again") from None
            try:
                disk = validate(_parse(old_text), path)
            except (ValueError, TuningInputError) as error:
                aside = _aside(path)
                warnings.warn(f"tuning file {path} is corrupt ({error}); moved it to {aside.name} "
                              "and wrote the new results", stacklevel=3)
                os.replace(path, aside)
                old_text = None
            else:
                disk_meta = DbMetadata.from_dict(disk["metadata"])
                _refuse_other_inputs(path, disk_meta, new_meta)
                merged = {"metadata": asdict(_heal(disk_meta, new_meta)),
                          "buckets": {**disk["buckets"], **content["buckets"]},
                          "failures": {**disk["failures"], **content["failures"]}}
        text = dumps(merged)
        if text == old_text:
            return False  # identical content is not rewritten
        atomic_write(path, text)
        return True


def save(directory: Path, metadata: DbMetadata, buckets: dict, failures: dict) -> Path:
    """Merge results into `directory`'s file for (metadata.device, metadata.signature).

    buckets: {tokens: {"config": KernelConfig, "time_us", "default_time_us", "floor_pct", "candidates"}};
    failures: {KernelConfig or its key: short error text}. Raises IncompatibleDbError rather than overwrite a file
    whose metadata definitely differs."""
    path = _file_for(directory, metadata)
    content = {"metadata": asdict(metadata),
               "buckets": {str(int(tokens)): _bucket_record(value) for tokens, value in buckets.items()},
               "failures": {(k.key if isinstance(k, KernelConfig) else str(k)): str(v)
                            for k, v in failures.items()}}
    merge_file(path, validate(content, path))
    return path


# ---------------------------------------------------------------------------------------------
# bundles: {"format": "moegen-tuning-bundle", "version": 1, "files": {name: content}}


def export_bundle(directory: Path) -> dict:
    """Every readable tuning file of `directory`; corrupt ones are warned about and left out."""
    files = {}
    for path in db_files(directory):
        try:
            files[path.name] = load_file(path)
        except TuningInputError as error:
            warnings.warn(f"left out of the bundle: {error}", stacklevel=2)
    return {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "files": files}


def _check_name(name, content: dict, where) -> None:
    """A plain tuning-file name, and the one its content's device and signature give where known."""
    if not isinstance(name, str) or not name.endswith(".json") or name.startswith(".") or \
            Path(name).name != name or len(name.encode()) > 255:
        raise TuningInputError(f"{where}: file name {name!r} is not a plain '<key>__<device>.json' name; "
                               "create bundles with `moegen cache export`")
    metadata = content["metadata"]
    signature = metadata.get("signature") or {}
    if metadata.get("device") is None or set(signature) != set(_SIGNATURE_TYPES) or None in signature.values():
        return
    expected = db_file_name(metadata["device"], KernelSignature(**signature))
    if name != expected:
        raise TuningInputError(f"{where}: {name} holds the results of {expected} (its metadata's device and "
                               "signature); lookups would never find them. Rename it, or export it again")


def is_bundle(path: Path) -> bool:
    """Whether path holds a tuning bundle, of any version (what `cache export -o` may replace)."""
    try:
        data = _read_json(Path(path), "", "")
    except TuningInputError:
        return False
    return isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT


def read_bundle(path: Path) -> dict[str, dict]:
    """{file name: content} of a bundle, every file validated before anything is merged."""
    path = Path(path)
    fix = "create one with `moegen cache export -o FILE`"
    data = _read_json(path, f"no such bundle; {fix}", "not a JSON tuning bundle ({error}); " + fix)
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT or not isinstance(data.get("files"), dict):
        raise TuningInputError(f"{path}: not a moegen tuning bundle (expected \"format\": "
                               f"\"{BUNDLE_FORMAT}\" and a \"files\" object); {fix}")
    if type(data.get("version")) is not int or data["version"] != BUNDLE_VERSION:
        raise TuningInputError(f"{path}: bundle version {data.get('version')!r}, this moegen reads "
                               f"version {BUNDLE_VERSION}; export it again with this moegen")
    files = {}
    for name, content in data["files"].items():
        files[name] = validate(content, f"{path}: {name}")
        _check_name(name, files[name], path)
    return files


def read_dir(directory: Path) -> dict[str, dict]:
    """{file name: content} of a database directory, for merging it elsewhere; corrupt -> error."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TuningInputError(f"{directory}: no such directory; pass a folder of tuning files")
    files = {path.name: load_file(path) for path in db_files(directory)}
    for name, content in files.items():
        _check_name(name, content, directory)
    return files
