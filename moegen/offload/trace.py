"""Read a moegen-trace v1 file: recorded expert choices of a real MoE model.

The format (../shared/traces/README.md): gzip'd JSON Lines; line 1 is a header

    {"format": "moegen-trace", "version": 1, "model": ..., "num_layers": L, "num_experts": E,
     "top_k": k, "source": ..., "note": ...}

and every following line one token, in order: {"seq": s, "experts": [[k ids] x L], "weights": ...}.
Weights are optional and not kept: cache policies only need the ids.
"""
from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moegen.errors import MoegenError

TRACE_FORMAT = "moegen-trace"
TRACE_VERSION = 1
_HEADER_INTS = ("num_layers", "num_experts", "top_k")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class TraceError(MoegenError):
    """A trace file moegen cannot read: FILE:LINE: what is wrong; how to fix it."""

    exit_code = 2

    def __init__(self, file, line: int, problem: str, fix: str):
        self.file, self.line, self.problem, self.fix = str(file), line, problem, fix
        where = f"{self.file}:{line}" if line else self.file
        super().__init__(f"{where}: {problem}; {fix}")


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays have no single truth value
class Trace:
    path: str
    model: str
    num_layers: int
    num_experts: int
    top_k: int
    source: str
    note: str
    experts: np.ndarray  # [tokens, num_layers, top_k] int16, read-only; order as recorded
    seq: np.ndarray  # [tokens] int64, read-only: the sequence each token belongs to

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def accesses(self) -> int:
        """Expert accesses in the whole trace: tokens x layers x top_k."""
        return int(self.experts.size)


def load_trace(path) -> Trace:
    """Read and check a trace; raises TraceError (exit code 2) naming the file, line and fix."""
    path = Path(path)
    fix = "pass the path of a moegen-trace .jsonl.gz file"
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise TraceError(path, 0, "a folder, not a file", fix)
        if not stat.S_ISREG(mode):  # a pipe would block, a device never end
            raise TraceError(path, 0, "not a regular file", fix)
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        raise TraceError(path, 0, "no such file", fix) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise TraceError(path, 0, f"not a complete gzip file ({error})",
                         "a trace is gzip'd JSON Lines: compress it with `gzip FILE.jsonl`") from None
    except UnicodeDecodeError as error:
        raise TraceError(path, 0, f"not UTF-8 text ({error.reason})", "write the trace as UTF-8 JSON Lines") from None
    except OSError as error:  # no permission, a loop of links, a name too long
        raise TraceError(path, 0, f"cannot read it ({error.strerror or error})", fix) from None
    if not lines:
        raise TraceError(path, 1, "empty file", "line 1 must be the moegen-trace header")

    header = _parse(path, 1, lines[0])
    _check_header(path, header)
    layers, num_experts, top_k = (header[key] for key in _HEADER_INTS)
    body = [(number, text) for number, text in enumerate(lines[1:], start=2) if text.strip()]
    if not body:
        raise TraceError(path, 2, "no tokens after the header", "record at least one token line")
    numbers = [number for number, _ in body]  # blank lines are harmless but shift the line numbers
    ids, seq = _fast_parse(body, layers, top_k)
    if ids is None:  # something is off: check line by line to say where
        experts, seq = [], []
        for number, text in body:
            token = _parse(path, number, text)
            experts.append(_check_token(path, number, token, layers, num_experts, top_k))
            seq.append(token["seq"])
        ids = np.asarray(experts, dtype=np.int64)

    bad = (ids < 0) | (ids >= num_experts)
    if bad.any():
        token, layer, slot = (int(i) for i in np.argwhere(bad)[0])
        raise _out_of_range(path, numbers[token], layer, int(ids[token, layer, slot]), num_experts)
    ordered = np.sort(ids, axis=2)
    repeated = (ordered[:, :, 1:] == ordered[:, :, :-1]).any(axis=2)
    if repeated.any():
        token, layer = (int(i) for i in np.argwhere(repeated)[0])
        raise TraceError(path, numbers[token], f"layer {layer}: expert ids {ids[token, layer].tolist()} repeat an id",
                         f"each layer lists top_k={top_k} distinct experts")
    expert_array = ids.astype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)
    seq_array = np.asarray(seq, dtype=np.int64)
    expert_array.setflags(write=False)
    seq_array.setflags(write=False)
    return Trace(path=str(path), model=str(header.get("model", "")), num_layers=layers,
                 num_experts=num_experts, top_k=top_k, source=str(header.get("source", "")),
                 note=str(header.get("note", "")), experts=expert_array, seq=seq_array)


def _fast_parse(body: list, layers: int, top_k: int):
    """(ids [tokens, layers, top_k], seq) in one pass when the whole body is well formed, else
    (None, None): the careful per-line checks then find the first problem."""
    try:
        tokens = json.loads("[" + ",".join(text for _, text in body) + "]")
        ids = np.asarray([token["experts"] for token in tokens])
        seq = [token["seq"] for token in tokens]
        seq_kind = np.asarray(seq).dtype.kind
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError):  # bad JSON, ragged rows, ...
        return None, None
    if ids.shape != (len(body), layers, top_k) or ids.dtype.kind != "i" or seq_kind != "i":  # uint64: >= 2^63
        return None, None
    return ids.astype(np.int64), seq


def _parse(path: Path, number: int, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise TraceError(path, number, f"bad JSON at column {error.colno}: {error.msg}",
                         "each line must be one complete JSON object") from None
    except (ValueError, RecursionError) as error:  # a number of thousands of digits, nesting too deep
        problem = "JSON nested too deeply" if isinstance(error, RecursionError) else f"bad JSON ({error})"
        raise TraceError(path, number, problem, "each line must be one JSON object of integers") from None
    if not isinstance(value, dict):
        raise TraceError(path, number, f"expected a JSON object, got {type(value).__name__}",
                         "each line must be one JSON object")
    return value


def _check_header(path: Path, header: dict) -> None:
    if header.get("format") != TRACE_FORMAT:
        raise TraceError(path, 1, f"header format is {header.get('format')!r}, not {TRACE_FORMAT!r}",
                         f'line 1 must be the header {{"format": "{TRACE_FORMAT}", "version": {TRACE_VERSION}, ...}}')
    if type(header.get("version")) is not int or header["version"] != TRACE_VERSION:
        raise TraceError(path, 1, f"trace version {header.get('version')!r} is not supported",
                         f"this moegen reads version {TRACE_VERSION}; convert the file or upgrade moegen")
    for key in _HEADER_INTS:
        value = header.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TraceError(path, 1, f"header {key} is {value!r}", f"set {key} to a positive integer")
    if header["top_k"] > header["num_experts"]:
        raise TraceError(path, 1, f"header top_k {header['top_k']} exceeds num_experts {header['num_experts']}",
                         "top_k is the number of experts each token picks per layer")


def _check_token(path: Path, number: int, token: dict, layers: int, num_experts: int, top_k: int) -> list:
    seq = token.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int) or not _INT64_MIN <= seq <= _INT64_MAX:
        raise TraceError(path, number, f"seq is {_short(seq)}",
                         "give each token an integer seq (its sequence id) of at most 18 digits")
    experts = token.get("experts")
    if not isinstance(experts, list) or len(experts) != layers:
        got = len(experts) if isinstance(experts, list) else repr(experts)
        raise TraceError(path, number, f"experts has {got} layers, the header says num_layers {layers}",
                         "list one row of expert ids per MoE layer")
    for layer, row in enumerate(experts):
        if not isinstance(row, list) or len(row) != top_k:
            got = len(row) if isinstance(row, list) else repr(row)
            raise TraceError(path, number, f"layer {layer} has {got} expert ids, the header says top_k {top_k}",
                             "list exactly top_k expert ids per layer")
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in row):
            raise TraceError(path, number, f"layer {layer}: expert ids {_short(row)} are not all integers",
                             "expert ids are integers in 0..num_experts-1")
        wrong = next((e for e in row if not 0 <= e < num_experts), None)
        if wrong is not None:
            raise _out_of_range(path, number, layer, wrong, num_experts)
    return experts


def _out_of_range(path: Path, number: int, layer: int, expert: int, num_experts: int) -> TraceError:
    return TraceError(path, number, f"layer {layer}: expert id {_short(expert)} out of range",
                      f"ids must lie in 0..{num_experts - 1} (num_experts {num_experts} in the header)")


def _short(value) -> str:
    """A value as messages quote it: at most 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def save_trace(path, experts, seq, *, model: str, num_experts: int, source: str = "", note: str = "",
               weights=None) -> Path:
    """Write a moegen-trace v1 file (gzip'd JSON Lines, as load_trace reads it): experts
    [tokens, layers, top_k] ids, seq [tokens] the sequence of each token (a sequence's tokens
    consecutive), weights optionally [tokens, layers, top_k]. Written to a temporary file first,
    so that an interrupted write leaves no partial trace at `path`."""
    path = Path(path)
    experts = np.asarray(experts)
    if experts.ndim != 3 or len(seq) != experts.shape[0] or experts.shape[0] == 0:
        raise ValueError(f"experts must be [tokens >= 1, layers, top_k] with one seq per token, got "
                         f"{list(experts.shape)} and {len(seq)} seq")
    header = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": model, "num_layers": experts.shape[1],
              "num_experts": num_experts, "top_k": experts.shape[2], "source": source, "note": note}
    partial = path.with_name(path.name + ".partial")
    with gzip.open(partial, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(header) + "\n")
        for token, ids in enumerate(experts.tolist()):
            line = {"seq": int(seq[token]), "experts": ids}
            if weights is not None:
                line["weights"] = [[round(float(w), 6) for w in layer] for layer in weights[token]]
            handle.write(json.dumps(line) + "\n")
    os.replace(partial, path)
    return path
