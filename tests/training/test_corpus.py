"""The training corpus: book paragraphs are cleaned and reflowed, and the held-out split is deterministic."""

from __future__ import annotations

from k3serve.training.corpus import HOLDOUT_EVERY, book_paragraphs, book_prose, split

RUNNING = ("It was a dark and stormy night; the rain fell in torrents, except at occasional intervals, when it\n"
           "was checked by a violent gust of wind which swept up the streets, rattling along the housetops, and\n"
           "fiercely agitating the scanty flame of the lamps that struggled against the darkness.")


def test_book_paragraphs_keep_running_text_and_drop_headers():
    text = "\n\n".join([
        "The Project Gutenberg EBook of Something, a very long header line that goes on and on about copyright "
        "and redistribution and the rest of the legal small print that nobody reads at all, ever, honestly.",
        "CONTENTS\n\nI.\tA Scandal\nII.\tA League",
        RUNNING,
        "1 2 3 4 5 6 7 8 9 " * 20,
    ])
    paras = book_paragraphs(text)
    assert paras == [" ".join(RUNNING.split())]
    assert "\n" not in paras[0]


def test_book_prose_thins_evenly(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("\n\n".join(f"Chapter {i}. " + RUNNING for i in range(100)))
    full = book_prose(1 << 30, path)
    assert len(full) == 100
    thin = book_prose(sum(len(p) for p in full) // 4, path)
    assert 20 <= len(thin) <= 30
    # spread across the whole book, not just its start
    assert int(thin[-1].split()[1].rstrip(".")) >= 90


def test_split_is_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(95)]
    train, held = split(docs)
    assert held == [docs[i] for i in range(HOLDOUT_EVERY - 1, 95, HOLDOUT_EVERY)]
    assert sorted(train + held, key=lambda d: int(d.split()[1])) == docs
    assert split(["a", "b"]) == (["a"], ["b"])
    assert split(["only"]) == (["only"], [])
