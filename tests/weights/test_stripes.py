"""Striped stores: the RAID 0 address map, `pack --stripe` round trip (each drive's folder holds its share, the
bytes read back equal the unstriped store's), and the clear errors for a missing or foreign stripe."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from k3serve.weights.pack import pack_checkpoint
from k3serve.weights.shard import ShardSpec, pack_shard
from k3serve.weights.store import (EXPERT_FILE, STRIPE_INDEX, TRUNK_FILE, PackedStore, StoreError, stripe_chunk_bytes,
                                   trunk_stripe_chunk_bytes)
from k3serve.weights.stripes import StripedWriter, read_striped, stripe_pieces, striped_file_sizes


@pytest.mark.parametrize("num_drives,chunk", [(1, 4096), (2, 4096), (3, 8192), (4, 4096)])
def test_striped_writer_and_reader_round_trip_at_odd_offsets(tmp_path, num_drives, chunk):
    rng = np.random.default_rng(num_drives)
    data = rng.integers(0, 256, 5 * chunk * num_drives + 1234, dtype=np.uint8).tobytes()
    paths = [tmp_path / f"drive{k}" for k in range(num_drives)]
    handles = [open(p, "wb") for p in paths]
    writer = StripedWriter(handles, chunk)
    for start in range(0, len(data), 3001):  # writes that straddle chunk edges
        writer.write(data[start:start + 3001])
    for h in handles:
        h.close()
    assert writer.tell() == len(data)
    assert [p.stat().st_size for p in paths] == striped_file_sizes(len(data), chunk, num_drives)
    for offset, length in [(0, len(data)), (1, 1), (chunk - 7, 15), (chunk * num_drives, 2 * chunk + 5), (999, 4097)]:
        assert read_striped(paths, chunk, offset, length) == data[offset:offset + length]
    # one drive's pieces of one range are adjacent in its file: one read per drive
    pieces = stripe_pieces(chunk // 2, 3 * chunk * num_drives, chunk, num_drives)
    for drive in range(num_drives):
        mine = [p for p in pieces if p.drive == drive]
        assert all(a.drive_offset + a.length == b.drive_offset for a, b in zip(mine, mine[1:]))


def test_default_chunk_splits_an_expert_over_every_drive():
    assert stripe_chunk_bytes(8192, 2) == 4096
    assert stripe_chunk_bytes(17_547_264, 4) == 256 << 10  # a full K3 expert: 67 chunks, 17 or 16 per drive
    assert stripe_chunk_bytes(4096, 3) == 4096  # never below the O_DIRECT granularity
    assert trunk_stripe_chunk_bytes(1_100_000_000, 4) == 4 << 20  # a full K3 layer: 275 chunks
    assert trunk_stripe_chunk_bytes(300_000, 2) == 4096


@pytest.fixture(scope="module")
def striped(tiny_dir, tiny_store, tmp_path_factory):
    root = tmp_path_factory.mktemp("drives")
    dirs = [root / "a", root / "b"]
    for d in dirs:
        d.mkdir()
    return pack_checkpoint(tiny_dir, root / "store", stripe_dirs=dirs)


def test_pack_stripe_lands_in_each_drive_and_reads_back_as_the_unstriped_store(striped, tiny_store):
    assert striped.num_stripes == 2 and striped.stripe_chunk_bytes == 4096
    assert not striped.expert_path.exists() and not striped.trunk_path.exists()  # nothing left in the store folder
    assert striped.trunk_stripe_chunk_bytes == 4096  # the tiny layers are small: 1/64 of a share is under 4 KiB
    for name, plain, files, chunk in (
            (EXPERT_FILE, tiny_store.expert_path, striped.expert_files, striped.stripe_chunk_bytes),
            (TRUNK_FILE, tiny_store.trunk_path, striped.trunk_files, striped.trunk_stripe_chunk_bytes)):
        whole = plain.read_bytes()
        assert [f.name for f in files] == [name, name]
        assert [f.stat().st_size for f in files] == striped_file_sizes(len(whole), chunk, 2)
        assert all(f.stat().st_size > 0 for f in files)
        assert read_striped(files, chunk, 0, len(whole)) == whole
    plain_index = json.loads((tiny_store.path / "store.json").read_text())
    striped_index = json.loads((striped.path / "store.json").read_text())
    assert striped_index.pop("stripes")["dirs"] == [str(f.parent) for f in striped.stripe_folders]
    assert striped_index.pop("store_id") == striped.store_id
    assert striped_index == plain_index  # the same blobs at the same (virtual) offsets


def test_a_shard_of_a_striped_store_equals_the_shard_of_the_plain_one(striped, tiny_store, tmp_path):
    a = pack_shard(tiny_store.path, tmp_path / "plain", ShardSpec(1, 2))
    b = pack_shard(striped.path, tmp_path / "striped", ShardSpec(1, 2))
    assert a.expert_path.read_bytes() == b.expert_path.read_bytes()


def _copy_store(striped, tmp_path):
    """The striped store's index folder and drive folders copied (tests that break a stripe break the copy)."""
    drives = []
    for k, folder in enumerate(striped.stripe_folders):
        drive = tmp_path / f"drive{k}"
        shutil.copytree(folder, drive / folder.name)
        drives.append(drive)
    shutil.copytree(striped.path, tmp_path / "store")
    index_file = tmp_path / "store" / "store.json"
    index = json.loads(index_file.read_text())
    index["stripes"]["dirs"] = [str(d) for d in drives]
    index_file.write_text(json.dumps(index))
    return tmp_path / "store", drives


def test_missing_stripe_directory_is_a_clear_error(striped, tmp_path):
    store, drives = _copy_store(striped, tmp_path)
    PackedStore(store)  # the copy opens
    shutil.rmtree(drives[1])
    with pytest.raises(StoreError, match=r"stripe 2 of 2 .*drive1\): the directory is missing \(is the drive mounted"):
        PackedStore(store)


def test_stripe_of_another_store_is_a_clear_error(striped, tiny_dir, tmp_path):
    store, drives = _copy_store(striped, tmp_path)
    # the drive now holds a stripe folder of the same name whose stripe.json names another store
    marker_file = next(drives[0].glob("k3stripe-*")) / STRIPE_INDEX
    marker = json.loads(marker_file.read_text())
    marker["store_id"] = "0123456789abcdef"
    marker_file.write_text(json.dumps(marker))
    with pytest.raises(StoreError, match=r"stripe 1 of 2 .*belongs to another store .*store 0123456789abcdef"):
        PackedStore(store)
    # a drive that holds only another store's stripes
    other = tmp_path / "other"
    other.mkdir()
    pack_checkpoint(tiny_dir, tmp_path / "other-store", stripe_dirs=[other, tmp_path / "drive0"])
    shutil.rmtree(next(drives[1].glob("k3stripe-*")))
    shutil.copytree(next(other.glob("k3stripe-*")), drives[1] / next(other.glob("k3stripe-*")).name)
    with pytest.raises(StoreError, match=r"stripe 2 of 2 .*no k3stripe-.* there, so this drive holds no part of "
                                         r"this store; it holds k3stripe-"):
        PackedStore(store)


def test_truncated_stripe_file_is_named(striped, tmp_path):
    store, drives = _copy_store(striped, tmp_path)
    experts = next(drives[1].glob("k3stripe-*")) / EXPERT_FILE
    with open(experts, "r+b") as f:
        f.truncate(experts.stat().st_size - 4096)
    with pytest.raises(StoreError, match=r"drive1/k3stripe-[0-9a-f]+-2of2/experts.bin is \d+ bytes, the index "
                                         r"needs \d+ \(truncated\?\)"):
        PackedStore(store)


def test_pack_refuses_bad_stripe_lists_and_leaves_no_folder_behind(tiny_dir, tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(StoreError, match="stripe directory .*nowhere does not exist"):
        pack_checkpoint(tiny_dir, tmp_path / "s1", stripe_dirs=[tmp_path / "a", tmp_path / "nowhere"])
    with pytest.raises(StoreError, match="lists a directory twice"):
        pack_checkpoint(tiny_dir, tmp_path / "s2", stripe_dirs=[tmp_path / "a", tmp_path / "a" / "."])
    with pytest.raises(StoreError, match="not a positive multiple of 4096"):
        pack_checkpoint(tiny_dir, tmp_path / "s3", stripe_dirs=[tmp_path / "a"], stripe_chunk=1000)
    assert list((tmp_path / "a").iterdir()) == []


def test_cli_pack_stripe_and_its_errors(tiny_dir, tmp_path, capsys, monkeypatch):
    import errno

    import k3serve.weights.pack
    from k3serve.cli.main import main

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert main(["pack", str(tiny_dir), str(tmp_path / "s"), "--stripe", f"{a},{b}"]) == 0
    assert "striped over 2 drives in chunks of 4.00 KiB (experts) and 4.00 KiB (trunk)" in capsys.readouterr().err
    store = PackedStore(tmp_path / "s")
    assert [f.parent for f in store.stripe_folders] == [a, b]
    assert main(["pack", str(tiny_dir), str(tmp_path / "t"), "--stripe", f"{a},{tmp_path / 'c'}"]) == 2
    assert f"stripe directory {tmp_path / 'c'} does not exist" in capsys.readouterr().err
    assert main(["pack", str(tiny_dir), str(tmp_path / "t"), "--stripe", f"{a}", "--shard", "0/2"]) == 2
    assert "--stripe lays out a whole store" in capsys.readouterr().err

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(k3serve.weights.pack, "expert_blob", full_disk)
    assert main(["pack", str(tiny_dir), str(tmp_path / "u"), "--stripe", f"{a},{b}"]) == 2
    capsys.readouterr()
    assert [p.name for p in a.iterdir()] == [store.stripe_folders[0].name]  # the failed pack's folders are gone
    assert not (tmp_path / "u").exists()


def test_drive_shares_are_the_pieces_summed_by_drive():
    rng = np.random.default_rng(5)
    for _ in range(300):
        drives = int(rng.integers(1, 6))
        chunk = 4096 * int(rng.integers(1, 4))
        offset, length = int(rng.integers(0, 20 * chunk)), int(rng.integers(0, 30 * chunk))
        from k3serve.weights.stripes import drive_shares

        expected = [0] * drives
        for p in stripe_pieces(offset, length, chunk, drives):
            expected[p.drive] += p.length
        assert drive_shares(offset, length, chunk, drives) == expected
