"""Read a Hugging Face checkpoint directory one tensor at a time.

Supports a single ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every file's
header is validated up front (a truncated or corrupt file is named before any tensor is read).
Each tensor is read on request with one positioned read into a fresh array, not through a memory
map: a mapped file's touched pages stay resident while it is open, so reading a 16 GB checkpoint
through ``safe_open`` shows up as gigabytes of resident memory; a fresh array is freed when the
caller drops it.
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from pathlib import Path

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_DTYPE_BYTES = {name: np.dtype(dtype).itemsize for name, dtype in _NUMPY_DTYPES.items()}


def read_header(path: Path) -> dict[str, dict]:
    """Parse and sanity-check a safetensors header: tensor name -> {dtype, shape, data_offsets,
    file_offset} (``file_offset``: where the tensor's bytes start in the file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes, file {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from exc
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    for name, info in header.items():
        start, end = info["data_offsets"]
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor '{name}' needs bytes {start}..{end} "
                f"but the data section has {data_size}"
            )
        expected = int(np.prod(info["shape"], dtype=np.int64)) * _DTYPE_BYTES.get(info["dtype"], 0)
        if _DTYPE_BYTES.get(info["dtype"]) and expected != end - start:
            raise CheckpointError(f"{path}: tensor '{name}' has {end - start} bytes, its shape needs {expected}")
        info["file_offset"] = 8 + header_len + start
    return header


class SafetensorsDir:
    """All tensors of a HF directory: names, shapes, and lazy reads. Use as a context manager."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.files = self._shard_files()
        self.location: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._info: dict[str, dict] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.location:
                    raise CheckpointError(
                        f"{self.dir}: duplicated tensor '{name}' in {self.location[name].name} and {path.name}"
                    )
                self.location[name] = path
                self.shapes[name] = tuple(info["shape"])
                self._info[name] = info
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}

    def _shard_files(self) -> list[Path]:
        single, index = self.dir / SINGLE_FILE, self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(missing)}")
            return [self.dir / f for f in files]
        if single.is_file():
            return [single]
        raise CheckpointError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE} found")

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of tensor ``name`` as a new array, reading only the pages it covers
        (through a map of the tensor's bytes, dropped before returning: only the block stays)."""
        path, info = self.location[name], self._info[name]
        if info["dtype"] not in _NUMPY_DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        shape = self.shapes[name]
        if not shape:
            return self.get(name)
        mapped = np.memmap(path, _NUMPY_DTYPES[info["dtype"]], mode="r", offset=info["file_offset"], shape=shape)
        try:
            return np.array(mapped[index])
        finally:
            del mapped

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a new numpy array (bf16 as ``ml_dtypes.bfloat16``)."""
        path, info = self.location[name], self._info[name]
        if info["dtype"] not in _NUMPY_DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(open(path, "rb"))  # noqa: SIM115 (closed by the ExitStack)
        f = self._handles[path]
        out = np.empty(self.shapes[name], _NUMPY_DTYPES[info["dtype"]])
        f.seek(info["file_offset"])
        if f.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
            raise CheckpointError(f"{path}: cannot read tensor '{name}': file ended early")
        return out
