"""``python -m convert`` run in-process: every bad input is one ``error:`` line before any work, and a
failed run leaves neither ``--out`` nor its temporary sibling, so the rerun succeeds.

Logits of a converted checkpoint against the Hugging Face directory are checked in
tests/modeling/test_models.py (test_orbax_round_trip_gives_identical_logits)."""

from __future__ import annotations

import errno
import os
import pathlib
import shutil

import orbax.checkpoint as ocp
import pytest
from paths import GOLDENS

import convert.__main__ as cli
from convert.orbax_io import PARAMS_DIR, load_checkpoint
from models import load_config, param_shapes

TINY = GOLDENS / "llada-tiny"
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
# What TensorStore (under Orbax) raised on a full tmpfs, with its spec shortened.
TENSORSTORE_ENOSPC = ValueError(
    'RESOURCE_EXHAUSTED: Error opening "zarr" driver: Error writing "value/.zarray" in OCDBT database at local '
    'file "/x/params/wk.orbax-checkpoint-tmp/ocdbt.process_0/": Failed to write 113 bytes to file 12: No space '
    "left on device [os_error_code='28'] [tensorstore_spec='{\"driver\":\"zarr\"}']"
)


def run(capsys, *args: str | pathlib.Path) -> tuple[int, str]:
    """(exit status, stderr) of the converter; a usage error's ``SystemExit`` is its status."""
    try:
        code = cli.main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def tree(path: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "the following arguments are required: --hf-dir, --out"),
        (("--hf-dir", TINY, "--out", "o", "--dtype", "int8"), "argument --dtype: invalid choice: 'int8' (choose from"),
        (("--hf-dir", TINY, "--out", "o", "--bogus"), "unrecognized arguments: --bogus"),
    ],
)
def test_usage_error_is_one_line(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, err = run(capsys, *args)
    assert code == 2
    assert err.startswith(f"error: {message}") and err.endswith(" (see python -m convert --help)\n")
    assert err.count("\n") == 1 and tree(tmp_path) == []


def _refusals(tmp: pathlib.Path) -> dict[str, tuple[list, str]]:
    """name -> (arguments, the one error line) for bad --hf-dir / --out pairs under ``tmp``."""
    hf, busy = tmp / "hf", tmp / "busy"
    return {
        "out is hf-dir": (
            ["--hf-dir", hf, "--out", hf],
            f"--out {hf} is the --hf-dir; choose a separate output directory",
        ),
        "out contains hf-dir": (
            ["--hf-dir", hf, "--out", tmp],
            f"--out {tmp} contains the --hf-dir {hf}; choose a separate output directory",
        ),
        "out not empty": (
            ["--hf-dir", hf, "--out", busy],
            f"--out {busy}: already exists and is not empty; choose a new or empty directory",
        ),
        "out is a file": (["--hf-dir", hf, "--out", busy / "x"], f"--out {busy / 'x'}: exists and is not a directory"),
        "no hf-dir": (["--hf-dir", tmp / "nope", "--out", tmp / "o"], f"--hf-dir {tmp / 'nope'}: no such directory"),
        "hf-dir is a file": (
            ["--hf-dir", hf / "config.json", "--out", tmp / "o"],
            f"--hf-dir {hf / 'config.json'}: not a directory",
        ),
        "not a model directory": (
            ["--hf-dir", busy, "--out", tmp / "o"],
            f"{busy / 'config.json'}: no config.json in model directory {busy}",
        ),
    }


@pytest.mark.parametrize("case", list(_refusals(pathlib.Path("/t"))))
def test_bad_paths_are_one_line_and_write_nothing(capsys, tmp_path, monkeypatch, case):
    tmp = tmp_path.resolve()
    shutil.copytree(TINY, tmp / "hf")
    (tmp / "busy").mkdir()
    (tmp / "busy" / "x").write_text("an earlier file")
    before = tree(tmp)
    if case != "not a model directory":  # refused before the source is read
        monkeypatch.setattr(cli, "load_config", lambda path: pytest.fail(f"read {path} before refusing"))
    args, message = _refusals(tmp)[case]
    assert run(capsys, *args) == (2, f"error: {message}\n")
    assert tree(tmp) == before


def test_unwritable_out_parent_is_one_line(capsys, tmp_path, monkeypatch):
    parent = tmp_path.resolve() / "ro"
    parent.mkdir()
    if os.geteuid() != 0:
        parent.chmod(0o500)
    else:  # root writes through any mode: refuse the converter's mkdir as the kernel would
        mkdir = pathlib.Path.mkdir

        def refuse(self, *args, **kwargs):
            if self.parent == parent:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    try:
        code, err = run(capsys, "--hf-dir", TINY, "--out", parent / "out")
    finally:
        parent.chmod(0o700)
    assert (code, err) == (2, f"error: --out {parent / 'out'}: cannot write in {parent} (Permission denied)\n")
    assert tree(parent) == []


def _save_failing_after_first(monkeypatch, exc: BaseException) -> None:
    """``StandardCheckpointer.save`` writes the first parameter, then raises ``exc``."""
    save, calls = ocp.StandardCheckpointer.save, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise exc
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", failing)


def _replace_failing_onto(monkeypatch, out: pathlib.Path) -> None:
    """The final rename onto ``out`` is refused (everything before it succeeded)."""
    replace = os.replace

    def failing(src, dst, *args, **kwargs):
        if pathlib.Path(dst) == out:
            raise PermissionError(errno.EACCES, "Permission denied", str(src), str(dst))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        ("os error", "No space left on device"),
        ("tensorstore error", "No space left on device"),
        ("final rename", "Permission denied"),
    ],
)
def test_failed_write_leaves_nothing_and_the_rerun_succeeds(capsys, tmp_path, monkeypatch, failure, reason):
    parent = tmp_path.resolve() / "parent"
    out = parent / "sub" / "out"  # "sub" is made by the converter, and removed with the rest
    if failure == "final rename":
        _replace_failing_onto(monkeypatch, out)
    else:
        _save_failing_after_first(monkeypatch, ENOSPC if failure == "os error" else TENSORSTORE_ENOSPC)
    parent.mkdir()
    code, err = run(capsys, "--hf-dir", TINY, "--out", out, "--dtype", "float32")
    assert (code, err) == (1, f"error: writing {out} failed: {reason}; nothing was kept\n")
    assert tree(parent) == []
    monkeypatch.undo()
    out.mkdir(parents=True)  # an existing empty --out is replaced
    assert run(capsys, "--hf-dir", TINY, "--out", out, "--dtype", "float32") == (0, "")
    assert os.listdir(parent) == ["sub"] and os.listdir(parent / "sub") == ["out"]  # no temporary left
    load_checkpoint(out)  # every parameter present with its shape
    assert sorted(p.name for p in (out / PARAMS_DIR).iterdir()) == sorted(param_shapes(load_config(out)))
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # a plain directory, not a private temporary


def test_interrupted_write_leaves_nothing(capsys, tmp_path, monkeypatch):
    _save_failing_after_first(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--hf-dir", str(TINY), "--out", str(tmp_path / "out")])
    assert tree(tmp_path) == []
