"""A GGUF file's pages are dropped from the process once a read has copied a tensor out (`GGUFFile.release`): the
converted copy and the mapped pages no longer both count in the resident set (an MXFP4 GGUF at Qwen3-30B-A3B's
widths reached 4.4 GB for a 2.0 GB file before)."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from k3serve.weights.gguf_file import GGUFFile

ROWS, COLS = 512, 4096  # 8 MiB as F32, 2.1 MiB as Q8_0


def _mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.fixture
def gguf_path(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("f32.weight", rng.standard_normal((ROWS, COLS), dtype=np.float32))
    writer.add_tensor("q8.weight", quants.quantize(rng.standard_normal((ROWS, COLS), dtype=np.float32), Q.Q8_0),
                      raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
@pytest.mark.parametrize("name, read", [("f32.weight", lambda f, n: f.f32(n)), ("q8.weight", lambda f, n: f.q8_0(n))])
def test_a_read_drops_the_files_pages_it_copied(gguf_path, name, read):
    file = GGUFFile(gguf_path)
    data = file.tensor(name).data
    np.asarray(data).reshape(-1).view(np.uint8)[::1024].sum()  # a byte of every page: all of them resident
    before = _mapped_kib(gguf_path)
    assert before >= data.nbytes // 1024 * 0.9, before
    values = read(file, name)
    after = _mapped_kib(gguf_path)
    assert after < before - data.nbytes // 1024 * 0.9, (before, after)  # the tensor's pages left the resident set
    again = read(file, name)  # the map still reads (the pages fault back in from the page cache)
    for a, b in zip(values if isinstance(values, tuple) else (values,), again if isinstance(again, tuple) else (again,)):
        assert np.array_equal(a, b)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_a_mapped_embeddings_lookups_leave_no_pages_behind(gguf_path):
    """An untied GGUF Q8_0 embedding stays in the map (`MappedQuantizedMatrix`); each lookup drops the pages it
    faulted in (with the pages the kernel maps around each fault), also after the file object is closed."""
    from k3serve.weights.quantized import MappedQuantizedMatrix, QuantizedMatrix

    file = GGUFFile(gguf_path)
    data = np.asarray(file.tensor("q8.weight").data).reshape(ROWS, -1)
    mapped = MappedQuantizedMatrix("q8_0", data, None, COLS, after_rows=file.dropper(data))
    plain = QuantizedMatrix("q8_0", data.copy(), None, COLS)
    file.close()  # the loaders close the file after the load; the dropper holds the map
    ids = np.random.default_rng(1).integers(0, ROWS, 200)
    mapped.after_rows()  # the copy above read every page
    baseline = _mapped_kib(gguf_path)
    assert baseline < data.nbytes // 1024 // 4
    assert np.array_equal(mapped.rows(ids), plain.rows(ids))
    assert _mapped_kib(gguf_path) <= baseline + 8, (baseline, _mapped_kib(gguf_path))
    np.asarray(data).reshape(-1)[::1024].sum()  # without the drop the rows stay: the check can fail
    assert _mapped_kib(gguf_path) > baseline + data.nbytes // 1024 // 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_a_mapped_embedding_drops_its_pages_every_few_rows(gguf_path):
    """Each drop flushes every core's TLB (costly in a VM), so decode's one-row lookups drop the tensor's pages once
    DROP_EVERY_ROWS rows have been read, not after every row: the pages stay mapped until then, and no longer."""
    from k3serve.weights.gguf_file import DROP_EVERY_ROWS
    from k3serve.weights.quantized import MappedQuantizedMatrix

    file = GGUFFile(gguf_path)
    data = np.asarray(file.tensor("q8.weight").data).reshape(ROWS, -1)
    mapped = MappedQuantizedMatrix("q8_0", data, None, COLS, after_rows=file.dropper(data))
    mapped.after_rows()
    baseline = _mapped_kib(gguf_path)
    for row in range(0, DROP_EVERY_ROWS - 1):  # rows 16 KB apart: each in pages of its own
        mapped.rows(np.array([row * ROWS // DROP_EVERY_ROWS]))
    assert _mapped_kib(gguf_path) >= baseline + 4 * (DROP_EVERY_ROWS - 1), (baseline, _mapped_kib(gguf_path))
    mapped.rows(np.array([ROWS - 1]))  # the DROP_EVERY_ROWS-th row
    assert _mapped_kib(gguf_path) <= baseline + 8, (baseline, _mapped_kib(gguf_path))


def test_an_open_file_holds_its_metadata_values_not_the_parsers_parts(tmp_path):
    """The gguf package parses each metadata string into numpy views of its parts (a length and the bytes); a
    GGUFFile keeps the values and the map, not the parser: with a 152k vocabulary the parts were ~220 MiB resident
    beside the weights for the model's life (Qwen3-Next's Q8_0 file at real widths, 2026-12-08: peak RSS 2911 ->
    2690 MiB)."""
    import gc
    import tracemalloc

    vocabulary = [f"token{i}" for i in range(20_000)]
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(vocabulary)
    writer.add_tensor("w.weight", np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    gc.collect()
    tracemalloc.start()
    try:
        file = GGUFFile(path)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert file.get("tokenizer.ggml.tokens") == vocabulary and file.f32("w.weight").shape == (4, 32)
    values = sys.getsizeof(vocabulary) + sum(sys.getsizeof(token) for token in vocabulary)  # ~1.3 MB
    assert held < 2 * values, (held, values)  # holding the parser: ~20x (53 MB for 40,000 strings)
