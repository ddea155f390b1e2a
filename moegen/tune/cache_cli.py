"""`moegen cache ...`: list, show, export, import and merge tuning-database files.

Results go to stdout, progress and warnings to stderr. Each subcommand sets ``run`` (args -> exit
code) like moegen/cli.py; bad input raises TuningInputError (exit code 2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from moegen import knobs
from moegen.ir import KernelSignature
from moegen.runtime.fused import KernelConfig
from moegen.tune import db
from moegen.tune.db import DbMetadata, IncompatibleDbError, TuningInputError


def _search_dirs(args) -> list[Path]:
    if args.dir is None:
        return db.default_search_path()
    if not Path(args.dir).is_dir():
        raise TuningInputError(f"{args.dir}: no such directory; pass a folder of tuning files to --dir")
    if not knobs.readable_folder(Path(args.dir)):
        raise TuningInputError(f"--dir {args.dir}: a folder moegen may not read; fix its permissions")
    return [Path(args.dir)]


def _status(content: dict) -> str:
    stale = db.differences(DbMetadata.from_dict(content["metadata"]), db.current_versions(content["metadata"]))
    return f"stale: {'; '.join(stale)}" if stale else "ok"


def _signature_key(content: dict, path: Path) -> str:
    signature = content["metadata"].get("signature") or {}
    try:
        if None not in signature.values():
            return KernelSignature(**signature).key
    except TypeError:
        pass
    return path.name.split("__")[0]  # an incomplete (unknown) signature: the file name holds the key


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _cmd_list(args) -> int:
    records = []
    for directory in _search_dirs(args):
        for path in db.db_files(directory):
            try:
                content = db.load_file(path)
            except TuningInputError as error:
                records.append({"path": str(path), "device": None, "signature": path.name.split("__")[0],
                                "buckets": None, "failures": None, "status": "corrupt", "error": str(error)})
                continue
            records.append({"path": str(path), "device": content["metadata"].get("device"),
                            "signature": _signature_key(content, path), "buckets": len(content["buckets"]),
                            "failures": len(content["failures"]), "status": _status(content)})
    if args.json:
        print(json.dumps(records, indent=2, sort_keys=True))
    elif not records:
        print(f"no tuning files in {', '.join(map(str, _search_dirs(args)))}", file=sys.stderr)
    else:
        rows = [["location", "device", "signature", "buckets", "failures", "status"]]
        rows += [[r["path"], r["device"] or "?", r["signature"], _fmt(r["buckets"], "d"),
                  _fmt(r["failures"], "d"), r["status"]] for r in records]
        print(_table(rows))
    return 0


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a loop of links: not a file this command can show
        return False


def _find(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if _is_file(path):
        return path
    name = path.name if path.name.endswith(".json") else path.name + ".json"
    dirs = db.default_search_path()
    for directory in dirs:
        if _is_file(directory / name):
            return directory / name
    raise TuningInputError(f"{name_or_path}: no such tuning file (searched {', '.join(map(str, dirs))}); "
                           "`moegen cache list` shows the files")


def _config_text(config: dict) -> str:
    return KernelConfig(**config).key  # the compact name failures are keyed by, e.g. m16g1_n64k128w4s4_...


def _gain_pct(bucket: dict):
    """How much faster than the cost-model default: default / tuned - 1, in percent."""
    default, tuned = bucket.get("default_time_us"), bucket["time_us"]
    return None if default is None or tuned <= 0 else (default / tuned - 1) * 100


def _cmd_show(args) -> int:
    path = _find(args.name)
    content = db.load_file(path)
    status = _status(content)
    buckets = sorted(content["buckets"].items(), key=lambda item: int(item[0]))
    if args.json:
        print(json.dumps({"path": str(path), "status": status, **content}, indent=2, sort_keys=True))
        return 0
    meta = content["metadata"]
    print(f"{path}: {meta.get('device')} {_signature_key(content, path)}, triton {meta.get('triton')}, "
          f"torch {meta.get('torch')}, moegen {meta.get('moegen')}: {status}")
    rows = [["tokens", "time_us", "default_time_us", "gain %", "floor_pct", "config"]]
    rows += [[tokens, _fmt(b["time_us"]), _fmt(b.get("default_time_us")), _fmt(_gain_pct(b), "+.1f"),
              _fmt(b.get("floor_pct"), ".1f"), _config_text(b["config"])] for tokens, b in buckets]
    print(_table(rows))
    for key, error in sorted(content["failures"].items()):
        print(f"failed: {key}: {error}")
    return 0


def _export_dir(args) -> Path:
    directory = Path(args.dir) if args.dir else (knobs.tuned_config_dir() or db.shipped_dir())
    if not directory.is_dir():
        raise TuningInputError(f"{directory}: no such directory; pass the tuning folder with --dir")
    return directory


def _bundle_output(output: str, directory: Path) -> Path:
    """Where export writes: a file name in an existing folder other than the exported one (a
    link is written through), and not a file that is something other than a bundle."""
    fix = "pass the bundle's file name in an existing folder, e.g. -o bundle.json"
    path = Path(output).resolve()
    if output.endswith(("/", "\\")) or path.is_dir():
        raise TuningInputError(f"-o {output}: a folder; {fix}")
    if not path.parent.is_dir():
        raise TuningInputError(f"-o {output}: no folder {path.parent}; {fix}")
    if path.parent == directory.resolve():
        raise TuningInputError(f"-o {output}: inside the exported folder {directory}, among its tuning files; "
                               "write the bundle elsewhere")
    if path.exists() and not db.is_bundle(path):
        raise TuningInputError(f"-o {output}: an existing file that is not a tuning bundle; not "
                               "overwritten. Choose another name, or delete it first")
    return path


def _cmd_export(args) -> int:
    directory = _export_dir(args)
    output = _bundle_output(args.output, directory) if args.output else None
    bundle = db.export_bundle(directory)  # a file left out warns (one line each, cli.main)
    text = db.dumps(bundle)
    if output is not None:
        try:
            db.atomic_write(output, text)  # an earlier bundle there stays whole if this write fails
        except OSError as error:
            raise TuningInputError(f"-o {args.output}: cannot write there ({error.strerror}); write the bundle "
                                   "elsewhere") from None
        print(f"exported {len(bundle['files'])} files of {directory} to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _destination(args) -> Path:
    into = Path(args.into) if args.into else knobs.tuned_config_dir()
    if into is None:
        raise TuningInputError("no destination: pass --into DIR or set MOEGEN_TUNED_CONFIG_DIR")
    if into.exists() and not into.is_dir():
        raise TuningInputError(f"--into {into}: a file, not a folder; pass a folder (created if missing)")
    try:
        into.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise TuningInputError(f"--into {into}: cannot create it ({error.strerror}); pass a folder you can "
                               "write") from None
    return into


def _merge_all(files: dict[str, dict], into: Path) -> int:
    """Merge each file through the same lock-and-merge path as a save; mismatches are skipped."""
    skipped = 0
    for name, content in sorted(files.items()):
        try:
            changed = db.merge_file(into / name, content)
        except IncompatibleDbError as error:
            skipped += 1
            print(f"moegen: skipped {name}: {error}", file=sys.stderr)
            continue
        print(f"{into / name}: {'merged' if changed else 'unchanged'}")
    if skipped:
        print(f"moegen: {skipped} of {len(files)} files skipped", file=sys.stderr)
    return 1 if skipped else 0


def _cmd_import(args) -> int:
    files = db.read_bundle(args.bundle)  # validates everything before writing anything
    return _merge_all(files, _destination(args))


def _cmd_merge(args) -> int:
    files = db.read_dir(args.src_dir)
    return _merge_all(files, _destination(args))


def add_cache_parser(subparsers) -> None:
    """Register `cache` and its subcommands on a parser's subparsers object."""
    cache = subparsers.add_parser("cache", help="list, show, export, import and merge tuning results")
    sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")

    p = sub.add_parser("list", help="every tuning file in the search path, and whether it still applies")
    p.add_argument("--dir", help="list this folder instead of the search path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_cmd_list)

    p = sub.add_parser("show", help="one tuning file's buckets as a table")
    p.add_argument("name", metavar="NAME_OR_PATH", help="a file path or a file name in the search path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_cmd_show)

    p = sub.add_parser("export", help="bundle a folder's tuning files into one JSON file")
    p.add_argument("-o", "--output", help="bundle file (default: stdout)")
    p.add_argument("--dir", help="folder to export (default: MOEGEN_TUNED_CONFIG_DIR, else the shipped one)")
    p.set_defaults(run=_cmd_export)

    p = sub.add_parser("import", help="merge a bundle's files into a tuning folder")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--into", help="destination folder (default: MOEGEN_TUNED_CONFIG_DIR)")
    p.set_defaults(run=_cmd_import)

    p = sub.add_parser("merge", help="merge another tuning folder's files into a tuning folder")
    p.add_argument("src_dir", metavar="SRC_DIR")
    p.add_argument("--into", help="destination folder (default: MOEGEN_TUNED_CONFIG_DIR)")
    p.set_defaults(run=_cmd_merge)
