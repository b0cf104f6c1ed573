"""Read a Hugging Face checkpoint directory one tensor at a time.

Supports a single ``model.safetensors`` or a sharded ``model.safetensors.index.json``. Every file's
header is validated up front (a truncated or corrupt file is named before any tensor is read),
and tensors are fetched lazily through ``safe_open`` so a 16 GB checkpoint is never held whole.
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from pathlib import Path

import numpy as np
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def read_header(path: Path) -> dict[str, dict]:
    """Parse and sanity-check a safetensors header: tensor name -> {dtype, shape, data_offsets}."""
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
    return header


class SafetensorsDir:
    """All tensors of a HF directory: names, shapes, and lazy reads. Use as a context manager."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self.files = self._shard_files()
        self.location: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in self.files:
            for name, info in read_header(path).items():
                if name in self.location:
                    raise CheckpointError(
                        f"{self.dir}: duplicated tensor '{name}' in {self.location[name].name} and {path.name}"
                    )
                self.location[name] = path
                self.shapes[name] = tuple(info["shape"])
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

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def get(self, name: str) -> np.ndarray:
        path = self.location[name]
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="numpy"))
        try:
            return self._handles[path].get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read tensor '{name}': {exc}") from exc
