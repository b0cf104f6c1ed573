"""Converted checkpoints: ``config.json`` + tokenizer files + one Orbax item per parameter.

Layout: ``params/<name>/`` is an Orbax ``StandardCheckpointer`` checkpoint of ``{"value": array}``
for each parameter of ``models.param_shapes``. One item per parameter is what lets the converter
write each parameter as soon as it is assembled and drop it, so converting never holds the model
on the host (an Orbax pytree save needs every array in memory at once). A converted directory
loads without the Hugging Face source; restoring goes through an abstract target
(``jax.ShapeDtypeStruct`` per parameter, optionally with a sharding), so Orbax casts to the
requested dtype and each device reads only its shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding
from qwix import QArray

from models import DiffusionLM, LLaDA2MoE, check_family, load_config, param_dtype, param_shapes
from models.quantize import (
    QTYPES,
    check_quantize,
    host_device,
    is_projection,
    is_quantized,
    place_quantized,
    quantized_on_host,
)

from .hf import model_from_params
from .safetensors_dir import CheckpointError

PARAMS_DIR = "params"
MARKER = "psd_jax.json"
FORMAT = "orbax-per-parameter"
# Files copied next to the parameters so the converted directory is self-contained.
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "decode_defaults.json",
    "decode.json",  # LLaDA2.0's special ids, when its config.json has none
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def is_orbax_dir(path: str | Path) -> bool:
    return (Path(path) / PARAMS_DIR).is_dir() and (Path(path) / MARKER).is_file()


class OutputDirError(ValueError):
    """An output directory the converter will not write, found before anything is written; the
    message starts with the directory."""


def check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` resolved, if a conversion may produce it: absent, or an empty directory (which
    the finished output replaces). Anything else is refused, so a conversion never mixes its
    output with other files or overwrites an earlier one."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out}: exists and is not a directory")
    try:
        entries = any(out.iterdir()) if out.is_dir() else False
    except OSError as exc:
        raise OutputDirError(f"{out}: cannot list it ({exc.strerror})") from exc
    if entries:
        raise OutputDirError(f"{out}: already exists and is not empty; choose a new or empty directory")
    return out


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """A fresh hidden sibling of ``out`` to write into, renamed to ``out`` when the block completes.

    On any exception (disk full, a bad tensor, Ctrl-C) the sibling and any parent directories
    made for it are removed, so a failed conversion leaves nothing behind and never a half-written
    ``out`` that a rerun would refuse. The sibling is in ``out``'s own directory, so the final
    rename stays on one file system (atomic, no copy). A failure to create it (an unwritable or
    missing parent) is an ``OutputDirError``; a failure after that propagates as it is.
    """
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()][::-1]  # outermost first
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        for parent in made:
            parent.mkdir()
        tmp.mkdir()  # not tempfile.mkdtemp: its 0o700 would become the output's mode
    except OSError as exc:
        _remove_empty(made)
        where = Path(exc.filename).parent if exc.filename else out.parent
        raise OutputDirError(f"{out}: cannot write in {where} ({exc.strerror})") from exc
    try:
        yield tmp
        os.replace(tmp, out)  # also replaces an empty directory at ``out``
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        raise


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):  # innermost first
        try:
            d.rmdir()
        except OSError:
            return


_OS_ERROR_CODE = re.compile(r"\[os_error_code='(\d+)'\]")


def _os_error(exc: ValueError, path: Path) -> OSError | None:
    """TensorStore (under Orbax) reports a failed write as a ``ValueError`` kilobytes long that
    carries the OS error code (``... No space left on device [os_error_code='28'] [tensorstore_spec=...]``).
    As an ``OSError`` naming ``path`` it is reported like any other failed write; ``None`` when the
    error is not the OS's."""
    match = _OS_ERROR_CODE.search(str(exc))
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def save_params(
    params: Iterable[tuple[str, object]],
    dtype,
    source_dir: str | Path,
    out_dir: str | Path,
    quantize: str | None = None,
) -> Path:
    """Write ``(name, array)`` pairs (host numpy or JAX arrays), one Orbax item each, plus the side files.

    With ``quantize`` the projections arrive quantized (``qwix.QArray``) and their items hold the
    integers and scales (``{"qvalue", "scale"}``); the marker records the setting, and loading
    restores them as they are (``load_checkpoint``).

    Each item is finished before the next pair is requested, so with a generator (the converter's
    ``iter_params``) only one parameter is alive at a time. Everything is written into a hidden
    sibling of ``out_dir`` that becomes ``out_dir`` only once complete (``staged_dir``): a failure
    leaves no ``out_dir``. ``out_dir`` must be absent or empty (``check_out_dir``). A write failure
    is an ``OSError`` naming the file (TensorStore's included).
    """
    out = check_out_dir(out_dir)
    with staged_dir(out) as tmp:
        for name in SIDE_FILES:
            src = Path(source_dir) / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
        with ocp.StandardCheckpointer() as ckpt:
            for name, array in params:
                item = tmp / PARAMS_DIR / name
                tree = {"qvalue": array.qvalue, "scale": array.scale} if is_quantized(array) else {"value": array}
                try:
                    ckpt.save(item, tree)
                    ckpt.wait_until_finished()
                except ValueError as exc:
                    if (os_error := _os_error(exc, item)) is None:
                        raise
                    raise os_error from exc
                del array, tree
        marker = {"format": FORMAT, "dtype": str(jnp.dtype(dtype))} | ({"quantize": quantize} if quantize else {})
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def stored_quantize(path: str | Path) -> str | None:
    """The ``--quantize`` a converted directory was written with (None: float weights)."""
    return json.loads((Path(path) / MARKER).read_text()).get("quantize")


def load_checkpoint(
    path: str | Path,
    dtype: str | jnp.dtype = jnp.float32,
    shardings: dict[str, jax.sharding.Sharding] | None = None,
    unroll_layers: bool = False,
    quantize: str | None = None,
) -> DiffusionLM | LLaDA2MoE:
    """Restore a converted directory into the family's module of ``dtype``, parameter by parameter
    (with ``quantize``, each projection quantized as it is restored: ``models.quantize``). A
    checkpoint converted with ``--quantize`` restores its integers and scales as they are (scales
    cast to ``dtype``), with ``quantize`` None or the same."""
    path = Path(path).resolve()
    cfg = load_config(path)
    fmt = json.loads((path / MARKER).read_text()).get("format")
    if fmt != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {fmt!r}, this version reads {FORMAT!r}; convert it again with python -m convert"
        )
    stored_as = stored_quantize(path)
    if stored_as is not None and quantize not in (None, stored_as):
        raise CheckpointError(
            f"{path}: converted with --quantize {stored_as}; load it with quantize={stored_as!r} (or none), "
            "or convert the Hugging Face directory again"
        )
    check_quantize(stored_as, on_mesh=shardings is not None)
    if quantize is not None:
        check_family(cfg.family)
    dtype = jnp.dtype(dtype)
    shapes = param_shapes(cfg)
    stored = {p.name for p in (path / PARAMS_DIR).iterdir() if p.is_dir()}
    if stored != set(shapes):
        missing, extra = sorted(set(shapes) - stored), sorted(stored - set(shapes))
        raise CheckpointError(f"{path}: parameters do not match config.json (missing {missing}, unexpected {extra})")
    params = {}
    with ocp.StandardCheckpointer() as ckpt:
        for name, shape in shapes.items():
            item = path / PARAMS_DIR / name
            tree = ckpt.metadata(item).item_metadata.tree
            as_stored = stored_as is not None and is_projection(name)
            meta = tree["qvalue" if as_stored else "value"]
            if tuple(meta.shape) != shape:
                raise CheckpointError(f"{path}: parameter '{name}' has shape {tuple(meta.shape)}, expected {shape}")
            sharding = (shardings or {}).get(name)
            if as_stored:  # integers and scales, restored on the host and placed
                host = SingleDeviceSharding(host_device())
                target = {
                    "qvalue": jax.ShapeDtypeStruct(shape, QTYPES[stored_as], sharding=host),
                    "scale": jax.ShapeDtypeStruct(tree["scale"].shape, param_dtype(cfg, name, dtype), sharding=host),
                }
                restored = ckpt.restore(item, target)
                params[name] = place_quantized(
                    QArray(restored["qvalue"], restored["scale"], qtype=QTYPES[stored_as]), sharding
                )
                continue
            on_host = quantize is not None and is_projection(name)  # quantized there, then placed
            restore_to = SingleDeviceSharding(host_device()) if on_host else sharding
            target = jax.ShapeDtypeStruct(shape, param_dtype(cfg, name, dtype), sharding=restore_to)
            value = ckpt.restore(item, {"value": target})["value"]
            params[name] = place_quantized(quantized_on_host(value, quantize), sharding) if on_host else value
    return model_from_params(cfg, params, dtype, unroll_layers)
