"""The striped reader (`StripedIO`, a queue per drive): a striped store streams byte for byte as the resident model,
every read is split evenly over the drives and each drive's share is served by that drive's own workers; a bad
byte or a failing read on one drive is reported as on one file."""

from __future__ import annotations

import errno
import mmap
import os
import threading

import numpy as np
import pytest

from k3serve.engine.generate import generate
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.stream.budget import minimum_budget_bytes
from k3serve.stream.expert_cache import StoreCorruptError
from k3serve.stream.io import Extent, StoreIOError, StripedIO
from k3serve.stream.options import StreamOptions
from k3serve.weights.pack import pack_checkpoint

IDS = [1, 5, 9, 200, 17, 3, 88, 41, 2, 250, 7]


@pytest.fixture(scope="module")
def striped(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drives")
    dirs = [root / name for name in ("a", "b", "c")]
    for d in dirs:
        d.mkdir()
    return pack_checkpoint(tiny_dir, root / "store", stripe_dirs=dirs)


@pytest.mark.parametrize("io,depth,cache,extra", [("direct", 4, "lru", 0), ("pread", 1, "none", 0),
                                                   ("mmap", 2, "s3fifo", 12)])
def test_striped_store_streams_byte_identically(tiny_model, striped, io, depth, cache, extra):
    options = StreamOptions(ram_budget=minimum_budget_bytes(striped) + extra * striped.expert_stride, io=io,
                            queue_depth=depth, cache=cache, trunk_dtype="float32")  # as the float32 resident model
    model = load_model(striped.path, stream=options).model
    assert isinstance(model.source.expert_io, StripedIO) and isinstance(model.source.trunk_io, StripedIO)
    assert np.array_equal(model.logits(IDS), tiny_model.logits(IDS))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert generate(model, IDS[:4], params)[0] == generate(tiny_model, IDS[:4], params)[0]
    model.source.check_integrity()
    drives = model.source.expert_io.drive_counters()
    assert all(c.bytes_read > 0 for c in drives)
    assert sum(c.bytes_read for c in drives) == model.source.stats().stream.expert_bytes_read
    assert f"drives=3 (qd {depth} each; read " in model.source.describe()
    model.source.close()


def _read(io: StripedIO, store, keys):
    buffers = [mmap.mmap(-1, store.expert_stride) for _ in keys]
    extents = [Extent(store.expert_offset(layer, e), memoryview(b), store.expert_blob_size,
                      store.experts[layer].crc32[e]) for (layer, e), b in zip(keys, buffers)]
    futures = io.submit(extents)
    failed = [f.result() for f in {id(f): f for f in futures.values()}.values()]
    return extents, failed


def test_each_drive_reads_an_even_share_on_its_own_queue(striped):
    io = StripedIO(striped.expert_files, striped.stripe_chunk_bytes, "direct", queue_depth=2)
    served = [set() for _ in io.drives]
    for k, engine in enumerate(io.drives):
        def traced(fd, buffers, offset, k=k, read=engine.preadv):
            served[k].add(threading.current_thread().name)
            return read(fd, buffers, offset)
        engine.preadv = traced
    layer = striped.config.moe_layer_ids[0]
    keys = [(layer, e) for e in (0, 2, 4, 6)]  # not neighbours in the natural layout: no coalescing
    extents, failed = _read(io, striped, keys)
    assert failed == [[]] * len(keys)  # every checksum, taken over pieces from three drives, passes
    counters = io.drive_counters()
    chunks = striped.expert_stride // striped.stripe_chunk_bytes  # 2 chunks of an 8 KiB expert over 3 drives
    assert chunks == 2
    per_drive = [c.bytes_read // striped.stripe_chunk_bytes for c in counters]
    assert sum(per_drive) == chunks * len(keys)
    assert max(per_drive) - min(per_drive) <= 1  # within one chunk of even
    # at most one system call per piece (pieces of different experts may meet on a drive and merge)
    assert all(1 <= c.num_reads <= n for c, n in zip(counters, per_drive))
    assert all(len(s) >= 1 for s in served)
    for k, names in enumerate(served):  # a queue per drive: its own workers, named for it
        assert all(name.startswith(f"k3io-experts-drive{k}") for name in names), names
    # a run of neighbours: each drive's pieces are adjacent in its file and merge into one read per drive
    before = [c.num_reads for c in io.drive_counters()]
    _read(io, striped, [(layer, e) for e in range(6)])
    assert [c.num_reads - b for c, b in zip(io.drive_counters(), before)] == [1, 1, 1]
    io.close()


def test_a_bad_byte_on_one_drive_is_a_corrupt_blob(striped, tmp_path):
    layer, expert = striped.config.moe_layer_ids[1], 3
    offset = striped.expert_offset(layer, expert) + striped.stripe_chunk_bytes + 10  # in the blob's second chunk
    from k3serve.weights.stripes import stripe_pieces
    piece = stripe_pieces(offset, 1, striped.stripe_chunk_bytes, striped.num_stripes)[0]
    path = striped.expert_files[piece.drive]
    original = path.read_bytes()
    try:
        with open(path, "r+b") as f:
            f.seek(piece.drive_offset)
            f.write(bytes([original[piece.drive_offset] ^ 0xFF]))
        model = load_model(striped.path, stream=StreamOptions(io="pread", cache="none")).model
        with pytest.raises(StoreCorruptError, match=f"layer {layer} expert {expert} in .*experts.bin \\(striped over "
                                                    f".*{path.parent.name}/experts.bin"):
            model.source.experts(layer, [expert])[expert]
        assert model.source.counters.checksum_retries == 1
        model.source.close()
    finally:
        path.write_bytes(original)


def test_a_failing_drive_names_its_file(striped):
    from k3serve.stream.faults import FaultyReads

    io = StripedIO(striped.expert_files, striped.stripe_chunk_bytes, "pread", queue_depth=2)
    io.drives[1].preadv = FaultyReads(eio_range=(0, 1 << 40))
    with pytest.raises(StoreIOError, match=rf"{striped.expert_files[1]}: read of \d+ bytes at offset \d+ failed "
                                           rf"after 3 attempts: .*{os.strerror(errno.EIO)}"):
        _read(io, striped, [(striped.config.moe_layer_ids[0], e) for e in range(4)])  # every drive has a piece
    io.close()
