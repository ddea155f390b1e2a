"""The tuning database as a feature: round trips, search order, metadata checks (a definite mismatch
is ignored and never overwritten, an unknown value heals), corrupt files, concurrent saves, strict
mode, key completeness, bundles and the `moegen cache` commands. No GPU, no compilation."""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import shutil
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from moegen import knobs
from moegen.errors import MoegenError
from moegen.ir import KernelSignature
from moegen.render import kernel_templates
from moegen.runtime.fused import KernelConfig
from moegen.target import lookup_gpu
from moegen.tune import db
from moegen.tune.cache_cli import add_cache_parser

DEVICE = "NVIDIA H200"
GPU = lookup_gpu(DEVICE)
SIG = KernelSignature(hidden_size=64, intermediate_size=128, num_experts=4, top_k=2, activation="silu",
                      dtype="float32")
TEMPLATES = list(kernel_templates(SIG))  # what the build (and `moegen cache list`) hashes
_TILES = dict(block_m=16, block_n=32, block_k=32, group_m=1, num_stages=2, down_block_n=32, down_block_k=32)
# Every field without a default (warps and any added later get 4): robust to KernelConfig growing.
CONFIG = KernelConfig(**{f.name: _TILES.get(f.name, 4) for f in dataclasses.fields(KernelConfig)
                         if f.default is dataclasses.MISSING})


def current(signature: KernelSignature = SIG, device: str = DEVICE) -> db.DbMetadata:
    return db.current_metadata(device, signature, TEMPLATES)


def result(time_us: float = 10.0, config: KernelConfig = CONFIG) -> dict:
    return {"config": config, "time_us": time_us, "default_time_us": 15.0, "floor_pct": 40.0, "candidates": 12}


def db_path(directory: Path, signature: KernelSignature = SIG) -> Path:
    return directory / db.db_file_name(DEVICE, signature)


def write_with(directory: Path, buckets=None, **metadata_changes) -> Path:
    """A file under the current key whose metadata differs as given (as an older moegen, another
    machine or a hand edit would leave it)."""
    meta = asdict(current())
    meta.update(metadata_changes)
    content = {"metadata": meta, "failures": {},
               "buckets": {str(t): db._bucket_record(r) for t, r in (buckets or {1: result()}).items()}}
    path = db_path(directory)
    db.merge_file(path, content)
    return path


# ---------------------------------------------------------------------------------------------
# round trip and search order


def test_save_lookup_round_trip(tmp_path):
    path = db.save(tmp_path, current(), {1: result(10.0), 64: result(30.0)}, {"m16_n64": "out of resources"})
    assert path.name == "h64_i128_e4_k2_silu_float32__nvidia_h200.json"
    text = path.read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"  # human-readable, stable
    assert json.loads(text)["metadata"] == asdict(current())

    tuning = db.TuningDb([tmp_path])
    entry = tuning.lookup(GPU, SIG, 64, TEMPLATES)
    assert entry == db.TunedEntry(CONFIG, 30.0, 15.0, 40.0, path)
    assert tuning.lookup(GPU, SIG, 8, TEMPLATES) is None  # buckets match exactly
    assert tuning.failures(DEVICE, SIG, TEMPLATES) == {"m16_n64": "out of resources"}
    assert not db.merge_file(path, db.load_file(path))  # identical content is not rewritten


def test_default_search_path_puts_env_dir_first(tmp_path):
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(tmp_path)):
        assert db.default_search_path() == [tmp_path, db.shipped_dir()]
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=None):
        assert db.default_search_path() == [db.shipped_dir()]
    assert db.shipped_dir() == Path(db.moegen.__file__).resolve().parents[1] / "tuned"


@pytest.mark.parametrize("in_env, in_shipped, expect", [
    ({64: 1.0}, {64: 2.0}, 1.0),   # both have the bucket: the env dir wins
    ({1: 1.0}, {64: 2.0}, 2.0),    # env file lacks the bucket: fall through to the shipped one
    ({}, {64: 2.0}, 2.0),          # no env file at all
    ({1: 1.0}, {1: 2.0}, None),    # nobody has it
])
def test_lookup_order(tmp_path, in_env, in_shipped, expect):
    env, shipped = tmp_path / "env", tmp_path / "shipped"
    for directory, buckets in ((env, in_env), (shipped, in_shipped)):
        if buckets:
            db.save(directory, current(), {t: result(v) for t, v in buckets.items()}, {})
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(env)):
        tuning = db.TuningDb([env, shipped])
        entry = tuning.lookup(GPU, SIG, 64, TEMPLATES)
    assert (entry and entry.time_us) == expect


# ---------------------------------------------------------------------------------------------
# metadata: definite mismatches are ignored and never overwritten; unknown values heal


@dataclass(frozen=True)
class MetaCase:
    field: str
    value: Any
    used: bool  # is a file with this metadata used for the current inputs?


_OTHER_SIG = {**asdict(SIG), "top_k": 3}
_PARTIAL_SIG = {**asdict(SIG), "top_k": None}

META_CASES = [
    MetaCase("triton", "3.5.0", used=False),
    MetaCase("template_hash", "0" * 64, used=False),
    MetaCase("device", "NVIDIA-H200", used=False),     # same file-name slug, different device
    MetaCase("signature", _OTHER_SIG, used=False),     # hand-edited file under the wrong name
    MetaCase("torch", "2.5.0+cu124", used=True),       # informational: CPU CI vs GPU torch builds
    MetaCase("moegen", "0.0.1", used=True),
    MetaCase("triton", None, used=True),               # unknown values: compatible, healed on save
    MetaCase("template_hash", None, used=True),
    MetaCase("device", None, used=True),
    MetaCase("signature", _PARTIAL_SIG, used=True),
    MetaCase("signature", None, used=True),
]


@pytest.mark.parametrize("case", META_CASES, ids=lambda c: f"{c.field}={str(c.value)[:12]}")
def test_metadata_compatibility(tmp_path, case):
    path = write_with(tmp_path, buckets={1: result(5.0)}, **{case.field: case.value})
    before = path.read_bytes()
    tuning = db.TuningDb([tmp_path])
    entry = tuning.lookup(GPU, SIG, 1, TEMPLATES)
    assert (entry is not None) == case.used

    if case.used:
        db.save(tmp_path, current(), {64: result(7.0)}, {})
        on_disk = db.load_file(path)
        assert on_disk["metadata"] == asdict(current())  # healed / updated to the saver's versions
        assert set(on_disk["buckets"]) == {"1", "64"}   # merged, nothing lost
    else:
        with pytest.raises(db.IncompatibleDbError, match=f"{case.field}.*MOEGEN_TUNED_CONFIG_DIR"):
            db.save(tmp_path, current(), {64: result(7.0)}, {})
        assert path.read_bytes() == before  # never overwritten
        with knobs.scope(MOEGEN_REQUIRE_TUNED="1"), pytest.raises(db.MissingTunedConfigError, match="stale"):
            db.resolve(tuning, GPU, SIG, 1, TEMPLATES, "specs/tiny.yaml")


def test_new_bucket_result_wins_and_failures_union(tmp_path):
    db.save(tmp_path, current(), {1: result(9.0), 8: result(20.0)}, {"a": "compile error"})
    db.save(tmp_path, current(), {1: result(8.0)}, {"b": "wrong result"})
    content = db.load_file(db_path(tmp_path))
    assert {t: b["time_us"] for t, b in content["buckets"].items()} == {"1": 8.0, "8": 20.0}
    assert content["failures"] == {"a": "compile error", "b": "wrong result"}


def test_config_fields_with_defaults_may_be_absent(tmp_path):
    """A file written before a defaulted KernelConfig field existed still loads, with the default."""
    optional = [f for f in dataclasses.fields(KernelConfig) if f.default is not dataclasses.MISSING]
    path = db.save(tmp_path, current(), {1: result()}, {})
    content = json.loads(path.read_text())
    for f in optional:
        del content["buckets"]["1"]["config"][f.name]
    path.write_text(db.dumps(content))
    assert db.TuningDb([tmp_path]).lookup(GPU, SIG, 1, TEMPLATES).config == CONFIG


# ---------------------------------------------------------------------------------------------
# corrupt files: warn, never crash; a save moves them aside


CORRUPT = {
    "not_json": b"{ truncated",
    "not_utf8": b"\xff\xfe\x00",
    "no_metadata": b'{"buckets": {}}',
    "bad_config": json.dumps({"metadata": {}, "buckets": {"1": {"config": {"block_m": 16}, "time_us": 1.0}}}).encode(),
    "unknown_config_field": json.dumps({"metadata": {}, "buckets": {"1": {
        "config": {**asdict(CONFIG), "block_q": 1}, "time_us": 1.0}}}).encode(),
    "bad_time": json.dumps({"metadata": {}, "buckets": {"1": {"config": asdict(CONFIG), "time_us": "fast"}}}).encode(),
}
# Well-typed configs no kernel can launch (a hand edit, another tool's file).
for _field, _value in [("block_m", 0), ("block_n", 48), ("num_warps", 3), ("down_num_warps", 0),
                       ("num_stages", 0), ("split_k", -2), ("down_max_registers", 300), ("group_m", 3),
                       ("streams", 7), ("tail_m", 256), ("block_m", 2 ** 70), ("num_stages", 10 ** 9),
                       ("split_k", 10 ** 6)]:
    CORRUPT[f"{_field}_{_value}"] = json.dumps({"metadata": {}, "buckets": {"1": {
        "config": {**asdict(CONFIG), _field: _value}, "time_us": 1.0}}}).encode()


def _file_with(bucket_changes=None, key="1", **top_changes) -> bytes:
    content = {"metadata": {}, "buckets": {key: {"config": asdict(CONFIG), "time_us": 1.0, **(bucket_changes or {})}}}
    return json.dumps({**content, **top_changes}).encode()


# JSON that Python's parser cannot take, numbers that are no times, bucket keys no lookup
# matches, metadata of the wrong types, text that is not Unicode.
CORRUPT.update({
    "nested_too_deep": b"[" * 100_000 + b"]" * 100_000,
    "number_too_long": b'{"metadata": {}, "buckets": {}, "x": 1' + b"0" * 5000 + b"}",
    "time_huge": _file_with({"time_us": 10 ** 400}),
    "time_nan": _file_with({"time_us": float("nan")}),
    "time_zero": _file_with({"time_us": 0}),
    "default_time_negative": _file_with({"default_time_us": -1.0}),
    "floor_infinite": _file_with({"floor_pct": float("inf")}),
    "candidates_negative": _file_with({"candidates": -1}),
    "bucket_superscript_digit": _file_with(key="\u00b2"),
    "bucket_leading_zero": _file_with(key="016"),
    "bucket_zero": _file_with(key="0"),
    "device_a_number": _file_with(metadata={"device": 123}),
    "triton_a_list": _file_with(metadata={"triton": ["3.6.0"]}),
    "signature_size_a_string": _file_with(metadata={"signature": {"hidden_size": "64"}}),
    "signature_size_a_bool": _file_with(metadata={"signature": {"top_k": True}}),
    "signature_unknown_field": _file_with(metadata={"signature": {"experts": 4}}),
    "failure_not_text": _file_with(failures={"m16": 1}),
    "lone_surrogate": _file_with(failures={"\ud800": "x"}),
})


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_corrupt_file_warns_once_and_is_skipped(tmp_path, name):
    bad, good = tmp_path / "bad", tmp_path / "good"
    bad.mkdir()
    db_path(bad).write_bytes(CORRUPT[name])
    db.save(good, current(), {1: result(3.0)}, {})
    tuning = db.TuningDb([bad, good])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tuning.lookup(GPU, SIG, 1, TEMPLATES).time_us == 3.0  # falls through to `good`
    assert len(caught) == 1 and db_path(bad).name in str(caught[0].message)
    assert "ignored" in str(caught[0].message)


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_save_moves_corrupt_file_aside(tmp_path, name):
    path = db_path(tmp_path)
    path.write_bytes(CORRUPT[name])
    with pytest.warns(UserWarning, match="corrupt"):
        db.save(tmp_path, current(), {1: result(3.0)}, {})
    assert path.with_name(path.name + ".corrupt").read_bytes() == CORRUPT[name]
    assert db.TuningDb([tmp_path]).lookup(GPU, SIG, 1, TEMPLATES).time_us == 3.0


def test_corrupt_files_moved_aside_keep_their_own_copies(tmp_path):
    path = db_path(tmp_path)
    for n, name in enumerate(["not_json", "no_metadata"]):
        path.write_bytes(CORRUPT[name])
        with pytest.warns(UserWarning, match="corrupt"):
            db.save(tmp_path, current(), {1 + n: result(3.0)}, {})
    assert path.with_name(path.name + ".corrupt").read_bytes() == CORRUPT["not_json"]
    assert path.with_name(path.name + ".corrupt.1").read_bytes() == CORRUPT["no_metadata"]


def test_a_file_that_cannot_be_read_is_left_alone(tmp_path):
    path = db_path(tmp_path)
    path.mkdir()  # unreadable as a file, as one without read permission would be for its user
    with pytest.raises(db.TuningInputError, match="cannot read it"):
        db.save(tmp_path, current(), {1: result(3.0)}, {})
    assert path.is_dir() and not path.with_name(path.name + ".corrupt").exists()


def test_config_the_target_cannot_run_is_passed_over(tmp_path, capsys):
    """A well-formed config that needs more shared memory than the target has (a hand edit) is
    never built: the lookup warns and goes on to the next folder, strict mode names it."""
    wide = replace(CONFIG, block_k=1024, block_n=128, num_stages=8)
    bad, good = tmp_path / "bad", tmp_path / "good"
    db.save(bad, current(), {1: result(3.0, wide)}, {})
    db.save(good, current(), {1: result(5.0)}, {})
    with pytest.warns(UserWarning, match="bucket 1: config GEMM1 shared memory"):
        assert db.TuningDb([bad, good]).lookup(GPU, SIG, 1, TEMPLATES).time_us == 5.0
    with knobs.scope(MOEGEN_REQUIRE_TUNED="1"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(db.MissingTunedConfigError, match="bucket 1's config GEMM1 shared memory"):
            db.resolve(db.TuningDb([bad]), GPU, SIG, 1, TEMPLATES, "specs/tiny.yaml")


def test_build_reports_an_ignored_file_in_one_line(tmp_path, capsys):
    from moegen import cli as moegen_cli

    spec = Path(__file__).resolve().parent.parent / "specs" / "tiny.yaml"
    signature = KernelSignature(hidden_size=40, intermediate_size=24, num_experts=6, top_k=2, activation="silu",
                                dtype="float32")
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / db.db_file_name(DEVICE, signature)).write_bytes(CORRUPT["block_m_0"])
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(tmp_path / "db"), MOEGEN_PRECOMPILE="0"):
        assert moegen_cli.main(["build", str(spec), "-o", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"moegen: warning: ignored {tmp_path / 'db'}"), err
    assert "block_m 0 is not a power of two" in err[0]


# ---------------------------------------------------------------------------------------------
# concurrency


def _save_many(directory: str, worker: int, count: int) -> None:
    for i in range(count):
        db.save(Path(directory), current(), {1000 * worker + i + 1: result(float(i + 1))}, {f"w{worker}_{i}": "x"})


def test_concurrent_saves_lose_nothing(tmp_path):
    workers, count = 4, 10
    context = multiprocessing.get_context("fork")  # no re-import of torch per worker: fast
    processes = [context.Process(target=_save_many, args=(str(tmp_path), w, count)) for w in range(workers)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
        assert p.exitcode == 0
    content = db.load_file(db_path(tmp_path))
    assert len(content["buckets"]) == workers * count
    assert len(content["failures"]) == workers * count
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temp files left


def test_tuner_refuses_a_file_as_its_folder_before_benchmarking(tmp_path):
    not_a_folder = tmp_path / "tuned"
    not_a_folder.write_text("notes")
    with pytest.raises(db.TuningInputError, match=f"{not_a_folder}: a file, not a folder"):
        db.check_writable(not_a_folder, current())
    assert not_a_folder.read_text() == "notes"


# ---------------------------------------------------------------------------------------------
# strict mode


@pytest.mark.parametrize("require, saved, outcome", [
    (None, True, "entry"),
    (None, False, "none"),
    ("1", True, "entry"),
    ("1", False, "error"),
])
def test_strict_mode(tmp_path, require, saved, outcome):
    if saved:
        db.save(tmp_path, current(), {64: result()}, {})
    tuning = db.TuningDb([tmp_path, tmp_path / "absent"])
    with knobs.scope(MOEGEN_REQUIRE_TUNED=require):
        if outcome == "error":
            with pytest.raises(db.MissingTunedConfigError) as info:
                db.resolve(tuning, GPU, SIG, 64, TEMPLATES, "specs/tiny.yaml")
            message = str(info.value)
            for part in (SIG.key, DEVICE, "64 tokens", str(tmp_path / "absent"), "moegen tune specs/tiny.yaml"):
                assert part in message
            assert info.value.exit_code == 2
        else:
            entry = db.resolve(tuning, GPU, SIG, 64, TEMPLATES, "specs/tiny.yaml")
            assert (entry is not None) == (outcome == "entry")


# ---------------------------------------------------------------------------------------------
# every input that changes the answer changes the file name or a checked field


def _other_value(value):
    return value + 1 if isinstance(value, int) else value + "x"


INT4 = replace(SIG, quantization="int4_group", group_size=128)
# The weight format's fields, each changed from a signature where it applies (lower() leaves them
# at their defaults where the format has no such field).
FORMAT_CHANGES = {"quantization": (SIG, replace(SIG, quantization="fp8_block")),
                  "group_size": (INT4, replace(INT4, group_size=64)),
                  "zero_point": (INT4, replace(INT4, zero_point=True))}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(KernelSignature)])
def test_every_signature_field_changes_the_file_name(field):
    base, other = FORMAT_CHANGES.get(field) or (SIG, replace(SIG, **{field: _other_value(getattr(SIG, field))}))
    assert db.db_file_name(DEVICE, other) != db.db_file_name(DEVICE, base)
    assert db.differences(current(other), current(base))  # and a checked field


@pytest.mark.parametrize("device", ["NVIDIA H100 80GB HBM3", "NVIDIA H20", "NVIDIA-H200"])
def test_device_changes_the_file_name_or_a_checked_field(device):
    named_apart = db.db_file_name(device, SIG) != db.db_file_name(DEVICE, SIG)
    assert named_apart or db.differences(current(device=device), current())
    assert db.differences(current(device=device), current())


@pytest.mark.parametrize("template, changes_hash", [
    *[(name, True) for name in kernel_templates(SIG)],  # the kernels' and the unquantized weights' macros
    ("configs.py.jinja", False),  # not a kernel template: tuning results stay valid
    ("weights_int4_group.jinja", False),  # another weight format's: results for bf16 weights stay valid
])
def test_kernel_template_edit_changes_template_hash(tmp_path, template, changes_hash):
    before = db.template_hash(TEMPLATES)
    shutil.copytree(knobs.template_dir(), tmp_path / "templates")
    with (tmp_path / "templates" / template).open("a") as handle:
        handle.write("\n{# edited #}\n")
    with knobs.scope(MOEGEN_TEMPLATE_DIR=str(tmp_path / "templates")):
        assert (db.template_hash(TEMPLATES) != before) == changes_hash


def test_a_template_a_weight_format_imports_is_part_of_its_hash(tmp_path):
    fp8 = list(kernel_templates(dataclasses.replace(SIG, quantization="fp8_block")))
    before = db.template_hash(TEMPLATES), db.template_hash(fp8)
    shutil.copytree(knobs.template_dir(), tmp_path / "templates")
    with (tmp_path / "templates" / "fp8_cast.jinja").open("a") as handle:
        handle.write("\n{# edited #}\n")
    with knobs.scope(MOEGEN_TEMPLATE_DIR=str(tmp_path / "templates")):
        assert db.template_hash(TEMPLATES) == before[0] and db.template_hash(fp8) != before[1]


def test_metadata_records_installed_versions():
    meta = current()
    assert meta.triton == db.installed_version("triton") and meta.torch == db.installed_version("torch")
    assert meta.moegen == db.moegen.__version__ and len(meta.template_hash) == 64
    assert meta.signature == asdict(SIG)


# ---------------------------------------------------------------------------------------------
# the cache commands


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="moegen")
    add_cache_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv])
    try:
        return args.run(args)
    except MoegenError as error:  # as moegen/cli.py reports them
        print(str(error))
        return error.exit_code


@pytest.fixture
def two_files(tmp_path):
    folder = tmp_path / "db"
    db.save(folder, current(), {1: result(10.0), 64: result(30.0)}, {"k": "compile error"})
    db.save(folder, current(replace(SIG, top_k=1)), {8: result(4.0)}, {})
    return folder


def test_export_import_round_trip_gives_identical_files(tmp_path, two_files):
    bundle = tmp_path / "bundle.json"
    assert cli("export", "--dir", str(two_files), "-o", str(bundle)) == 0
    assert cli("import", str(bundle), "--into", str(tmp_path / "empty")) == 0
    assert sorted(p.name for p in db.db_files(tmp_path / "empty")) == sorted(p.name for p in db.db_files(two_files))
    for path in db.db_files(two_files):
        assert (tmp_path / "empty" / path.name).read_bytes() == path.read_bytes()


def test_export_to_stdout_and_merge_dir(tmp_path, two_files, capsys):
    assert cli("export", "--dir", str(two_files)) == 0
    bundle = json.loads(capsys.readouterr().out)
    assert bundle["format"] == "moegen-tuning-bundle" and bundle["version"] == 1 and len(bundle["files"]) == 2
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(tmp_path / "env")):
        assert cli("merge", str(two_files)) == 0  # --into defaults to MOEGEN_TUNED_CONFIG_DIR
    for path in db.db_files(two_files):
        assert (tmp_path / "env" / path.name).read_bytes() == path.read_bytes()


def test_import_of_a_file_without_failures(tmp_path, two_files):
    """`failures` is optional in a tuning file, so in a bundle too."""
    bundle = tmp_path / "bundle.json"
    cli("export", "--dir", str(two_files), "-o", str(bundle))
    data = json.loads(bundle.read_text())
    for content in data["files"].values():
        del content["failures"]
    bundle.write_text(json.dumps(data))
    assert cli("import", str(bundle), "--into", str(tmp_path / "into")) == 0
    assert db.TuningDb([tmp_path / "into"]).lookup(GPU, SIG, 64, TEMPLATES).time_us == 30.0


def test_import_skips_mismatching_file_and_imports_the_rest(tmp_path, two_files, capsys):
    bundle = tmp_path / "bundle.json"
    cli("export", "--dir", str(two_files), "-o", str(bundle))
    into = tmp_path / "into"
    stale = write_with(into, triton="3.5.0")
    before = stale.read_bytes()
    assert cli("import", str(bundle), "--into", str(into)) == 1
    captured = capsys.readouterr()
    assert f"skipped {stale.name}" in captured.err and "triton 3.5.0" in captured.err
    assert stale.read_bytes() == before
    other = db.db_file_name(DEVICE, replace(SIG, top_k=1))
    assert (into / other).read_bytes() == (two_files / other).read_bytes()


def test_cache_list_and_show(tmp_path, two_files, capsys):
    stale_dir = tmp_path / "stale"
    write_with(stale_dir, triton="3.5.0")
    (stale_dir / "broken__nvidia_h200.json").write_text("{")
    triton = db.installed_version("triton")

    assert cli("list", "--dir", str(two_files)) == 0
    out = capsys.readouterr().out
    assert SIG.key in out and "ok" in out and "stale" not in out

    assert cli("list", "--dir", str(stale_dir), "--json") == 0
    records = {Path(r["path"]).name: r for r in json.loads(capsys.readouterr().out)}
    assert records[db_path(stale_dir).name]["status"] == f"stale: triton 3.5.0 != {triton}"
    assert records["broken__nvidia_h200.json"]["status"] == "corrupt"

    assert cli("show", str(db_path(two_files))) == 0
    out = capsys.readouterr().out
    assert "gain %" in out and "+50.0" in out and CONFIG.key in out and "failed: k: compile error" in out

    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=str(two_files)):  # by name, found in the search path
        assert cli("show", db_path(two_files).stem, "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "ok" and set(shown["buckets"]) == {"1", "64"}


@pytest.mark.parametrize("argv, content, env, code", [
    (["list", "--dir", "{tmp}/absent"], None, None, 2),
    (["show", "{tmp}/absent.json"], None, None, 2),
    (["show", "{tmp}/input"], b"[1, 2]", None, 2),
    (["export", "--dir", "{tmp}/absent"], None, None, 2),
    (["export", "--dir", "{tmp}", "-o", "{tmp}"], None, None, 2),  # -o a folder
    (["export", "--dir", "{tmp}", "-o", "{tmp}/absent/bundle.json"], None, None, 2),
    (["import", "{tmp}/absent.json", "--into", "{tmp}/into"], None, None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"], b"not json", None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"], b'{"format": "other", "files": {}}', None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"],
     b'{"format": "moegen-tuning-bundle", "version": 2, "files": {}}', None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"],
     b'{"format": "moegen-tuning-bundle", "version": 1, "files": {"../x.json": {}}}', None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"],
     b'{"format": "moegen-tuning-bundle", "version": 1, "files": {"x.json": {"buckets": 1}}}', None, 2),
    (["import", "{tmp}/input"], b'{"format": "moegen-tuning-bundle", "version": 1, "files": {}}', None, 2),
    (["import", "{tmp}/input"], b'{"format": "moegen-tuning-bundle", "version": 1, "files": {}}', "{tmp}/env", 0),
    (["merge", "{tmp}/absent", "--into", "{tmp}/into"], None, None, 2),
    # a destination that is a file, by flag or by MOEGEN_TUNED_CONFIG_DIR: left as it is
    (["import", "{tmp}/input", "--into", "{tmp}/input"],
     b'{"format": "moegen-tuning-bundle", "version": 1, "files": {}}', None, 2),
    (["import", "{tmp}/input"], b'{"format": "moegen-tuning-bundle", "version": 1, "files": {}}', "{tmp}/input", 2),
    (["import", "{tmp}/input", "--into", "{tmp}/input/into"],
     b'{"format": "moegen-tuning-bundle", "version": 1, "files": {}}', None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"],
     b'{"format": "moegen-tuning-bundle", "version": true, "files": {}}', None, 2),
    # a name no file system takes, a name that is not the one its content gives
    (["import", "{tmp}/input", "--into", "{tmp}/into"], json.dumps({
        "format": "moegen-tuning-bundle", "version": 1, "files": {"a" * 300 + ".json": json.loads(_file_with())}
    }).encode(), None, 2),
    (["import", "{tmp}/input", "--into", "{tmp}/into"], json.dumps({
        "format": "moegen-tuning-bundle", "version": 1, "files": {"x.json": json.loads(_file_with(
            metadata=asdict(current())))}}).encode(), None, 2),
    (["show", "{tmp}/" + "a" * 300], None, None, 2),
    # export: not into the exported folder, not over a file that is no bundle, not to a folder
    (["export", "--dir", "{tmp}", "-o", "{tmp}/bundle.json"], None, None, 2),
    (["export", "-o", "{tmp}/input"], b"my notes", None, 2),
    (["export", "-o", "{tmp}/absent/"], None, None, 2),
])
def test_cache_cli_exit_codes(tmp_path, capsys, argv, content, env, code):
    if content is not None:
        (tmp_path / "input").write_bytes(content)
    argv = [a.format(tmp=tmp_path) for a in argv]
    with knobs.scope(MOEGEN_TUNED_CONFIG_DIR=env and env.format(tmp=tmp_path)):
        assert cli(*argv) == code
    out = capsys.readouterr().out
    if code == 2:
        assert str(tmp_path) in out or "--into" in out  # names the file (or the missing flag)
    assert not (tmp_path / "into").exists()  # bad input writes nothing
    if content is not None:
        assert (tmp_path / "input").read_bytes() == content
