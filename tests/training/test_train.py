"""The training command is reproducible: the same seed writes byte-identical checkpoints, and they load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from k3serve.config import tiny_config
from k3serve.loading import load_model
from k3serve.tokenizer import Tokenizer
from k3serve.training.corpus import COPY_REQUESTS
from k3serve.training.model import K3ForTraining, causal_attention, init_weights
from k3serve.training.train import copy_prefix_shares, main, repeat_windows

ARGS = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--eval-every", "3", "--eval-windows", "2",
        "--code-bytes", "150000", "--prose-bytes", "40000", "--threads", "1"]


def test_same_seed_same_checkpoint(tmp_path):
    cache = str(tmp_path / "cache")
    assert main(["--out", str(tmp_path / "a"), *ARGS]) == 0
    assert main(["--out", str(tmp_path / "b"), *ARGS, "--corpus-cache", cache]) == 0  # writes the cache
    assert main(["--out", str(tmp_path / "c"), *ARGS, "--corpus-cache", cache]) == 0  # reads it
    sums_a = (tmp_path / "a" / "SHA256SUMS").read_text()
    assert sums_a == (tmp_path / "b" / "SHA256SUMS").read_text() == (tmp_path / "c" / "SHA256SUMS").read_text()
    curve = json.loads((tmp_path / "a" / "train_log.json").read_text())["curve"]
    assert curve[-1]["step"] == 3 and all(curve[-1]["heldout_loss"][k] < curve[0]["heldout_loss"][k] for k in ("code", "prose"))
    loaded = load_model(tmp_path / "a")
    assert loaded.tokenizer is not None and loaded.model.config.num_experts == 64


def test_time_budget_run_is_reproduced_by_its_step_count(tmp_path):
    args = [*ARGS, "--warmup", "10", "--eval-every", "100"]
    assert main(["--out", str(tmp_path / "a"), *args, "--time-budget", "0.001"]) == 0
    log = json.loads((tmp_path / "a" / "train_log.json").read_text())
    assert log["schedule_steps"] == log["steps"] == 11  # at least one step past the timed warm-up
    assert main(["--out", str(tmp_path / "b"), *args, "--steps", "11"]) == 0
    assert (tmp_path / "a" / "SHA256SUMS").read_text() == (tmp_path / "b" / "SHA256SUMS").read_text()


def test_init_from_continues_an_exported_checkpoint(tmp_path):
    assert main(["--out", str(tmp_path / "a"), *ARGS]) == 0
    assert main(["--out", str(tmp_path / "b"), *ARGS, "--steps", "0", "--init-from", str(tmp_path / "a")]) == 0
    # zero steps from the exported weights export them again unchanged (bf16 and MXFP4 round-trip exactly)
    assert (tmp_path / "a" / "SHA256SUMS").read_text() == (tmp_path / "b" / "SHA256SUMS").read_text()
    start = json.loads((tmp_path / "b" / "train_log.json").read_text())["curve"][0]["heldout_loss"]["code"]
    fresh = json.loads((tmp_path / "a" / "train_log.json").read_text())["curve"][0]["heldout_loss"]["code"]
    assert start < fresh


def test_written_out_attention_matches_the_fused_one():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=gen) for _ in range(3))
    fused = causal_attention(q, k, v, 0.3, explicit=False)
    assert torch.allclose(fused, causal_attention(q, k, v, 0.3, explicit=True), atol=1e-5)
    assert torch.allclose(fused[:, :, 0], v[:, :, 0])  # causal: the first position sees only itself


def test_copy_probe_is_greedy_decoding_up_to_the_first_mistake():
    """copy_prefix_shares finds, in one pass, where greedy decoding first leaves the wanted continuation."""
    torch.manual_seed(0)
    config = tiny_config()
    model = K3ForTraining(config)
    init_weights(model, seed=3)
    prompt = np.asarray([1, 5, 9, 2, 7, 7, 3], dtype=np.int64)
    greedy = []
    with torch.no_grad():
        for _ in range(6):
            ids = torch.from_numpy(np.concatenate([prompt, np.asarray(greedy, dtype=np.int64)]))[None]
            greedy.append(int(model(ids)[0, -1].argmax()))
    wrong = (greedy[4] + 1) % config.vocab_size
    probe = [(prompt, np.asarray(greedy, dtype=np.int64)),  # greedy itself: copied whole
             (prompt, np.asarray(greedy[:4] + [wrong, greedy[5]], dtype=np.int64)),  # first mistake at 4 of 6
             (prompt[:3], np.asarray([(int(model(torch.from_numpy(prompt[:3])[None])[0, -1].argmax()) + 1)
                                      % config.vocab_size], dtype=np.int64))]  # wrong at once
    assert copy_prefix_shares(model, probe, batch_size=2, device=torch.device("cpu")) == [1.0, 4 / 6, 0.0]


def test_copy_share_windows_and_periodic_checkpoints(tmp_path):
    """--copy-share draws windows that begin at revision documents; a --save-every checkpoint of step k is the
    checkpoint of the same command cut with --stop-step k; the log carries the copying probe."""
    cache = str(tmp_path / "cache")
    args = [*ARGS, "--steps", "4", "--eval-every", "2", "--copy-bytes", "20000", "--copy-share", "0.5",
            "--probe-count", "3", "--corpus-cache", cache]
    assert main(["--out", str(tmp_path / "a"), *args, "--save-every", "2", "--stop-step", "2"]) == 0
    assert main(["--out", str(tmp_path / "b"), *args, "--stop-step", "2"]) == 0
    assert (tmp_path / "a" / "SHA256SUMS").read_text() == (tmp_path / "b" / "SHA256SUMS").read_text()
    assert main(["--out", str(tmp_path / "c"), *args]) == 0
    assert (tmp_path / "c" / "SHA256SUMS").read_text() != (tmp_path / "b" / "SHA256SUMS").read_text()
    curve = json.loads((tmp_path / "c" / "train_log.json").read_text())["curve"]
    assert [point["step"] for point in curve] == [0, 2, 4]
    assert all(0.0 <= point["copy_prefix_share"] <= 1.0 for point in curve)
    with np.load(tmp_path / "cache" / "extras.npz") as extras:
        starts = extras["copy_starts"]
        ids = np.load(tmp_path / "cache" / "train.npz")["ids"]
        assert len(starts) > 0 and len(extras["probe_prompt_lens"]) > 0
    tokenizer = Tokenizer.from_dir(tmp_path / "c")
    assert all(ids[s] == tokenizer.bos_id for s in starts)
    text = tokenizer.decode(ids[starts[0] + 1:starts[1]].tolist())
    assert any(request in text for request in COPY_REQUESTS)


def test_repeat_windows_repeat_one_span_to_the_window_end():
    """--repeat-share's windows: a span of the stream (32 tokens to half a window) tiled to the window's length, so
    every token after the first copy equals the token one span earlier."""
    ids = np.arange(10_000, dtype=np.int64)
    rng = np.random.default_rng(0)
    windows = repeat_windows(ids, rng, 50, 257)
    for window in windows:
        assert window.shape == (257,)
        span = int(np.argmax(window[1:] == window[0])) + 1  # ids are distinct: the first repeat of window[0]
        assert 32 <= span <= 129
        assert np.array_equal(window[:span], ids[window[0]:window[0] + span])
        assert np.array_equal(window[span:], window[:-span])
    assert len({len(set(w.tolist())) for w in windows}) > 5  # the span length varies


def test_repeat_share_is_seeded_and_checked(tmp_path):
    args = [*ARGS, "--repeat-share", "0.5"]
    assert main(["--out", str(tmp_path / "a"), *args]) == 0
    assert main(["--out", str(tmp_path / "b"), *args]) == 0
    assert (tmp_path / "a" / "SHA256SUMS").read_text() == (tmp_path / "b" / "SHA256SUMS").read_text()
    try:
        main(["--out", str(tmp_path / "c"), *ARGS, "--repeat-share", "0.8", "--copy-share", "0.5"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--repeat-share + --copy-share above 1 was accepted")


def test_eos_docs_end_every_training_document_and_keep_the_held_out_windows(tmp_path):
    """--eos-docs 1: [BOS] document [EOS] in the training stream (the model learns to stop); the held-out streams stay
    as they were, so held-out losses compare with runs without it. A corpus cache built without it is refused."""
    cache_a, cache_b = tmp_path / "cache_a", tmp_path / "cache_b"
    assert main(["--out", str(tmp_path / "a"), *ARGS, "--steps", "0", "--corpus-cache", str(cache_a)]) == 0
    assert main(["--out", str(tmp_path / "b"), *ARGS, "--steps", "0", "--eos-docs", "1",
                 "--corpus-cache", str(cache_b)]) == 0
    tokenizer = Tokenizer.from_dir(tmp_path / "b")
    plain = np.load(cache_a / "train.npz")["ids"].astype(np.int64)
    ended = np.load(cache_b / "train.npz")["ids"].astype(np.int64)
    eos = tokenizer.eos_ids[0]
    assert tokenizer.decode([eos]) == "[EOS]" and not (plain == eos).any()
    bos_at = np.flatnonzero(ended == tokenizer.bos_id)
    assert np.array_equal(np.flatnonzero(ended == eos), np.append(bos_at[1:], len(ended)) - 1)  # just before the next
    assert np.array_equal(ended[ended != eos], plain)  # nothing else changed
    for kind in ("code", "prose"):
        assert np.array_equal(np.load(cache_a / f"heldout_{kind}.npy"), np.load(cache_b / f"heldout_{kind}.npy"))
    try:
        main(["--out", str(tmp_path / "c"), *ARGS, "--steps", "0", "--corpus-cache", str(cache_b)])
    except SystemExit as exc:
        assert "--corpus-cache" in str(exc.code) and "eos_docs" in str(exc.code)
    else:
        raise AssertionError("a cache built with --eos-docs 1 was used for a run without it")


def test_copy_strip_docstrings_changes_only_the_revision_documents(tmp_path):
    """--copy-strip-docstrings: the revision documents' functions lose their docstrings; the rest of the training
    stream, the held-out splits (the copy split included) and the copying probe stay as they were. A cache built
    without the flag is refused, and a share outside [0, 1] is an argument error."""
    base = [*ARGS, "--steps", "0", "--copy-bytes", "20000", "--probe-count", "3"]
    cache_a, cache_b = tmp_path / "cache_a", tmp_path / "cache_b"
    assert main(["--out", str(tmp_path / "a"), *base, "--corpus-cache", str(cache_a)]) == 0
    assert main(["--out", str(tmp_path / "b"), *base, "--copy-strip-docstrings", "1",
                 "--corpus-cache", str(cache_b)]) == 0
    # this small corpus is all inside the BPE's training bytes, so the two tokenizers differ: compare texts
    tok_a, tok_b = Tokenizer.from_dir(tmp_path / "a"), Tokenizer.from_dir(tmp_path / "b")
    plain = np.load(cache_a / "train.npz")["ids"].astype(np.int64)
    stripped = np.load(cache_b / "train.npz")["ids"].astype(np.int64)
    with np.load(cache_a / "extras.npz") as a, np.load(cache_b / "extras.npz") as b:
        first_a, first_b = int(a["copy_starts"][0]), int(b["copy_starts"][0])
        assert len(a["copy_starts"]) <= len(b["copy_starts"])  # shorter documents: as many or more fit the bytes
        assert tok_a.decode(a["probe_ids"].tolist()) == tok_b.decode(b["probe_ids"].tolist())
    assert tok_a.decode(plain[:first_a].tolist()) == tok_b.decode(stripped[:first_b].tolist())  # code and prose
    copies_a, copies_b = tok_a.decode(plain[first_a:].tolist()), tok_b.decode(stripped[first_b:].tolist())
    assert copies_a.count('"""') > 10 * max(1, copies_b.count('"""'))
    for kind in ("code", "prose", "copy"):
        assert (tok_a.decode(np.load(cache_a / f"heldout_{kind}.npy").tolist())
                == tok_b.decode(np.load(cache_b / f"heldout_{kind}.npy").tolist()))
    with pytest.raises(SystemExit, match="copy_strip_docstrings"):  # the cache was built without the flag
        main(["--out", str(tmp_path / "c"), *base, "--copy-strip-docstrings", "1", "--corpus-cache", str(cache_a)])
    with pytest.raises(SystemExit) as refused:
        main(["--out", str(tmp_path / "d"), *base, "--copy-strip-docstrings", "1.5"])
    assert refused.value.code == 2
