"""Our safetensors reader and writer: round trips, shards, byte ranges, the official library, corrupt files."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3serve.errors import CheckpointError
from k3serve.weights.bf16 import f32_to_bf16_bits, round_to_bf16
from k3serve.weights.safetensors_io import (
    INDEX_FILE_NAME,
    SafetensorsIndex,
    TensorNotFoundError,
    save_safetensors,
    save_sharded,
)

import safetensors  # noqa: E402  (a declared test dependency: its absence must fail, not skip)
import safetensors.numpy  # noqa: E402


def _all_dtype_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {
        "f64": rng.standard_normal((3, 5)),
        "f32": rng.standard_normal((7,)).astype(np.float32),
        "f16": rng.standard_normal((2, 3)).astype(np.float16),
        "bool": rng.random((5,)) > 0.5,
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    for dtype in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.int64):
        info = np.iinfo(dtype)
        tensors[np.dtype(dtype).name] = rng.integers(info.min, info.max, size=(3, 3), dtype=dtype, endpoint=True)
    return tensors


def _write_raw(path: Path, header: dict[str, Any], data: bytes, header_len: int | None = None) -> Path:
    header_bytes = json.dumps(header).encode()
    length = len(header_bytes) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + header_bytes + data)
    return path


# ---- round trips -----------------------------------------------------------------------------------------


def test_round_trip_every_dtype(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    path = tmp_path / "all.safetensors"
    save_safetensors(path, tensors, metadata={"format": "np", "note": "x"})
    with SafetensorsIndex.open(path) as index:
        assert sorted(index.names()) == sorted(tensors)
        assert len(index) == len(tensors) and "f32" in index and "nope" not in index
        assert index.metadata() == {"format": "np", "note": "x"}
        raw_file = path.read_bytes()
        for name, want in tensors.items():
            got = index.read(name)
            assert got.dtype == want.dtype, name
            assert got.shape == want.shape, name
            assert np.array_equal(got, want), name
            info = index.info(name)
            assert info.nbytes == want.nbytes
            assert raw_file[info.offset : info.offset + info.nbytes] == np.ascontiguousarray(want).tobytes(), name
            assert np.array_equal(index.read_raw(name), np.frombuffer(want.tobytes(), dtype=np.uint8)), name


def test_layout_is_aligned_and_deterministic(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_safetensors(first, tensors)
    save_safetensors(second, dict(reversed(list(tensors.items()))))
    assert first.read_bytes() == second.read_bytes()
    (header_len,) = struct.unpack("<Q", first.read_bytes()[:8])
    assert (8 + header_len) % 8 == 0
    with SafetensorsIndex.open(first) as index:
        for name in index.names():
            info = index.info(name)
            itemsize = tensors[name].dtype.itemsize
            assert info.offset % itemsize == 0, name
            if info.nbytes % 8 == 0:
                assert info.offset % 8 == 0, name


def test_bf16_is_rounded_on_write_and_widened_on_read(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((4, 6)).astype(np.float32)
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, {"w": weight, "b": weight[0]}, dtypes={"w": "BF16"})
    with SafetensorsIndex.open(path) as index:
        info = index.info("w")
        assert (info.dtype, info.shape, info.nbytes) == ("BF16", (4, 6), 48)
        got = index.read("w")
        assert got.dtype == np.float32
        assert np.array_equal(got, round_to_bf16(weight))
        assert not np.array_equal(got, weight)  # rounding really happened
        assert np.array_equal(index.read_raw("w").view(np.uint16).reshape(4, 6), f32_to_bf16_bits(weight))
        assert index.info("b").dtype == "F32"


def test_read_returns_fresh_writeable_arrays(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_safetensors(path, {"w": np.arange(8, dtype=np.float32)})
    with SafetensorsIndex.open(path) as index:
        first = index.read("w")
        assert first.flags.writeable
        first[:] = -1
        assert np.array_equal(index.read("w"), np.arange(8, dtype=np.float32))


def test_read_range_and_bounds(tmp_path: Path) -> None:
    matrix = np.arange(60, dtype=np.int32).reshape(6, 10)
    path = tmp_path / "m.safetensors"
    save_safetensors(path, {"m": matrix, "pad": np.ones(3, dtype=np.uint8)})
    with SafetensorsIndex.open(path) as index:
        rows_2_to_4 = index.read_range("m", 2 * 40, 2 * 40)
        assert np.array_equal(np.frombuffer(rows_2_to_4, dtype=np.int32).reshape(2, 10), matrix[2:4])
        assert index.read_range("m", 240, 0) == b""
        for start, length in ((-1, 4), (200, 41), (0, 241)):
            with pytest.raises(ValueError, match="outside tensor 'm'"):
                index.read_range("m", start, length)


def test_unknown_name_and_closed_index(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_safetensors(path, {"w": np.zeros(2, dtype=np.float32)})
    index = SafetensorsIndex.open(path)
    with pytest.raises(TensorNotFoundError, match="'missing.weight'") as caught:
        index.read("missing.weight")
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, CheckpointError)
    index.close()
    with pytest.raises(ValueError, match="closed"):
        index.read("w")


# ---- shards ----------------------------------------------------------------------------------------------


def test_sharded_folder_with_index(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = {f"layer.{i}.weight": rng.standard_normal((8, 16)).astype(np.float32) for i in range(5)}
    tensors["big"] = rng.standard_normal((64, 16)).astype(np.float32)  # bigger than one shard on its own
    dtypes = {"layer.1.weight": "BF16"}
    shards = save_sharded(tmp_path, tensors, dtypes=dtypes, max_shard_bytes=1100)
    names = [p.name for p in shards]
    assert names == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    # 512-byte f32 tensors, layer.1 is 256 bytes in bf16: [0, 1] [2, 3] [4] [big] under a 1100-byte limit
    assert len(shards) == 4
    index_doc = json.loads((tmp_path / INDEX_FILE_NAME).read_text())
    expected_total = sum(t.nbytes for t in tensors.values()) - tensors["layer.1.weight"].nbytes // 2
    assert index_doc["metadata"]["total_size"] == expected_total
    assert list(index_doc["weight_map"]) == list(tensors)  # insertion order kept
    assert index_doc["weight_map"]["big"] == names[-1]
    with SafetensorsIndex.open(tmp_path) as index:
        assert index.names() == list(tensors)
        assert len(index.files()) == len(shards)
        for name, want in tensors.items():
            expected = round_to_bf16(want) if name in dtypes else want
            assert np.array_equal(index.read(name), expected), name
            assert index.info(name).file.name == index_doc["weight_map"][name]


def test_shard_fill_order(tmp_path: Path) -> None:
    tensors = {name: np.zeros(100, dtype=np.uint8) for name in ("c", "a", "b", "d", "e")}
    shards = save_sharded(tmp_path, tensors, max_shard_bytes=250)
    weight_map = json.loads((tmp_path / INDEX_FILE_NAME).read_text())["weight_map"]
    assert len(shards) == 3
    assert [weight_map[n] for n in ("c", "a", "b", "d", "e")] == [shards[i].name for i in (0, 0, 1, 1, 2)]


def test_folder_without_index_indexes_every_file(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "one.safetensors", {"a": np.ones(3, dtype=np.float32)}, metadata={"k": "1"})
    save_safetensors(tmp_path / "two.safetensors", {"b": np.zeros(2, dtype=np.int64)}, metadata={"j": "2"})
    with SafetensorsIndex.open(tmp_path) as index:
        assert sorted(index.names()) == ["a", "b"]
        assert np.array_equal(index.read("b"), np.zeros(2, dtype=np.int64))
        assert index.metadata("two.safetensors") == {"j": "2"}
        assert index.metadata() == {"k": "1", "j": "2"}


def test_duplicate_name_across_unindexed_files(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "one.safetensors", {"a": np.ones(3, dtype=np.float32)})
    save_safetensors(tmp_path / "two.safetensors", {"a": np.ones(3, dtype=np.float32)})
    with pytest.raises(CheckpointError, match="two.safetensors.*'a'"):
        SafetensorsIndex.open(tmp_path)


# ---- the official library --------------------------------------------------------------------------------


def test_official_library_reads_our_files(tmp_path: Path) -> None:
    tensors = _all_dtype_tensors()
    path = tmp_path / "ours.safetensors"
    save_safetensors(path, tensors, metadata={"who": "k3serve"})
    loaded = safetensors.numpy.load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for name, want in tensors.items():
        assert loaded[name].dtype == want.dtype and np.array_equal(loaded[name], want), name
    with safetensors.safe_open(str(path), framework="numpy") as handle:
        assert handle.metadata() == {"who": "k3serve"}


def test_official_library_reads_our_bf16(tmp_path: Path) -> None:
    weight = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, {"w": weight, "odd": np.ones(3, dtype=np.uint8)}, dtypes={"w": "BF16"})
    with safetensors.safe_open(str(path), framework="numpy") as handle:
        tensor_slice = handle.get_slice("w")
        assert tensor_slice.get_dtype() == "BF16" and tensor_slice.get_shape() == [5, 3]
    # numpy has no bfloat16, so safe_open cannot materialize the tensor; the torch-free `deserialize`
    # validates the whole file and returns the raw bytes.
    records = dict(safetensors.deserialize(path.read_bytes()))
    assert records["w"]["dtype"] == "BF16"
    assert bytes(records["w"]["data"]) == f32_to_bf16_bits(weight).tobytes()


def test_we_read_files_of_the_official_library(tmp_path: Path) -> None:
    tensors = {"x": np.arange(6, dtype=np.int16).reshape(2, 3), "y": np.linspace(0, 1, 5, dtype=np.float64)}
    path = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata={"a": "b"})
    with SafetensorsIndex.open(path) as index:
        assert index.metadata() == {"a": "b"}
        for name, want in tensors.items():
            assert np.array_equal(index.read(name), want)


# ---- corrupt files ---------------------------------------------------------------------------------------


def _good_file(path: Path) -> Path:
    save_safetensors(path, {"a": np.arange(16, dtype=np.float32), "b": np.ones((2, 2), dtype=np.int32)})
    return path


def test_file_shorter_than_header_length(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CheckpointError, match=r"tiny\.safetensors.*shorter"):
        SafetensorsIndex.open(path)


def test_header_length_past_end_of_file(tmp_path: Path) -> None:
    path = _write_raw(tmp_path / "long.safetensors", {}, b"", header_len=10_000)
    with pytest.raises(CheckpointError, match=r"long\.safetensors.*header length 10000"):
        SafetensorsIndex.open(path)


@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe\x00{}", b"[1, 2]"])
def test_header_not_json(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "garbage.safetensors"
    path.write_bytes(struct.pack("<Q", len(garbage)) + garbage)
    with pytest.raises(CheckpointError, match=r"garbage\.safetensors"):
        SafetensorsIndex.open(path)


def test_unknown_dtype(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F8_E9", "shape": [1], "data_offsets": [0, 1]}}
    path = _write_raw(tmp_path / "dtype.safetensors", header, b"\0")
    with pytest.raises(CheckpointError, match=r"dtype\.safetensors.*'a'.*unknown dtype 'F8_E9'"):
        SafetensorsIndex.open(path)


def test_offsets_do_not_match_shape(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}
    path = _write_raw(tmp_path / "mismatch.safetensors", header, b"\0" * 24)
    with pytest.raises(CheckpointError, match=r"mismatch\.safetensors.*'a'.*needs 24"):
        SafetensorsIndex.open(path)


def test_truncated_data(tmp_path: Path) -> None:
    path = _good_file(tmp_path / "cut.safetensors")
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors.*truncated"):
        SafetensorsIndex.open(path)


def test_overlapping_tensors(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    }
    path = _write_raw(tmp_path / "overlap.safetensors", header, b"\0" * 12)
    with pytest.raises(CheckpointError, match=r"overlap\.safetensors.*'a' and 'b' overlap"):
        SafetensorsIndex.open(path)


def test_missing_shard(tmp_path: Path) -> None:
    tensors = {f"t{i}": np.full(64, i, dtype=np.float32) for i in range(4)}
    shards = save_sharded(tmp_path, tensors, max_shard_bytes=512)
    assert len(shards) == 2
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE_NAME}.*{shards[1].name}.*missing"):
        SafetensorsIndex.open(tmp_path)


def test_index_maps_tensor_to_wrong_shard(tmp_path: Path) -> None:
    tensors = {f"t{i}": np.full(64, i, dtype=np.float32) for i in range(4)}
    shards = save_sharded(tmp_path, tensors, max_shard_bytes=512)
    index_path = tmp_path / INDEX_FILE_NAME
    index_doc = json.loads(index_path.read_text())
    index_doc["weight_map"]["t0"] = shards[1].name
    index_path.write_text(json.dumps(index_doc))
    with pytest.raises(CheckpointError, match=rf"'t0'.*{shards[1].name}.*lacks it"):
        SafetensorsIndex.open(tmp_path)


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        SafetensorsIndex.open(tmp_path / "nothing-here")
    with pytest.raises(CheckpointError, match=r"\*\.safetensors"):
        SafetensorsIndex.open(tmp_path)
