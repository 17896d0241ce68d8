"""A K3 checkpoint folder: config.json, safetensors shards, and optionally the tokenizer files.

Opening one checks every tensor the config implies against the headers (present, shape, dtype) before any
weight is read, so a mismatched or truncated checkpoint is refused at load with the names that are wrong.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from k3serve.config import K3Config, load_config
from k3serve.errors import CheckpointError
from k3serve.weights import names
from k3serve.weights.gguf_file import GGUFFile, check_gguf_path
from k3serve.weights.gguf_k3 import GGUFK3Index, k3_config
from k3serve.weights.quantized import QuantizedMatrix
from k3serve.weights.safetensors_io import SafetensorsIndex

_FLOAT_DTYPES = ("BF16", "F32", "F16")
_MAX_LISTED_PROBLEMS = 8


class Checkpoint:
    def __init__(self, path: str | Path, validate: bool = True) -> None:
        self.path = Path(path)
        if self.path.suffix.lower() == ".gguf":
            check_gguf_path(self.path)
        if self.path.is_file() and self.path.suffix.lower() == ".gguf":
            # GGUF files of the families load through k3serve.loading (model/families/gguf_families.py)
            raise CheckpointError(f"{self.path} is a GGUF file: a K3 checkpoint here is a safetensors folder or a "
                                  "packed store (GGUF files of the other families load with --model)")
        if self.path.is_file():
            raise CheckpointError(f"{self.path} is a file, not a checkpoint folder")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint folder {self.path} does not exist")
        self.config: K3Config = load_config(self.path)
        self.index = SafetensorsIndex.open(self.path)
        if validate:
            self.validate()

    @classmethod
    def from_gguf(cls, file: GGUFFile, validate: bool = True) -> Checkpoint:
        """A K3 GGUF file (llama.cpp's `kimi-k3`) under the released names (weights/gguf_k3.py)."""
        config = k3_config(file)
        checkpoint = cls.__new__(cls)
        checkpoint.path = file.path
        checkpoint.config = config
        checkpoint.index = GGUFK3Index(file, config)  # type: ignore[assignment]
        if validate:
            checkpoint.validate()
        return checkpoint

    def validate(self) -> None:
        problems: list[str] = []
        for spec in names.all_specs(self.config):
            if spec.name not in self.index:
                problems.append(f"missing tensor {spec.name} {list(spec.shape)}")
            else:
                info = self.index.info(spec.name)
                if tuple(info.shape) != spec.shape:
                    problems.append(f"{spec.name} has shape {list(info.shape)}, config implies {list(spec.shape)}")
                elif spec.dtype == "U8" and info.dtype != "U8":
                    problems.append(f"{spec.name} has dtype {info.dtype}, MXFP4 bytes must be U8")
                elif spec.dtype != "U8" and info.dtype not in _FLOAT_DTYPES + ("Q8_0",):
                    problems.append(f"{spec.name} has dtype {info.dtype}, expected a float type")
            if len(problems) >= _MAX_LISTED_PROBLEMS:
                break
        if problems:
            source = "its GGUF metadata" if self.path.is_file() else "its config.json"
            raise CheckpointError(f"checkpoint {self.path} does not match {source}:\n  " + "\n  ".join(problems))

    def read(self, name: str) -> np.ndarray | QuantizedMatrix:
        """A tensor as float32 (bf16/f16/f32 on disk), as stored bytes (U8), or, for a trunk matrix a GGUF file holds
        as Q8_0, as its Q8_0 blocks (`QuantizedMatrix`)."""
        array = self.index.read(name)
        if isinstance(array, QuantizedMatrix):
            return array
        return array if array.dtype == np.uint8 else array.astype(np.float32, copy=False)

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.path if self.path.is_dir() and (self.path / "tiktoken.model").exists() else None

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
