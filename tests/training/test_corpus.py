"""The training corpus: book paragraphs are cleaned and reflowed, the held-out split is deterministic, and revision
documents repeat a function of the given code (unchanged or with one comment line added), with or without its
docstring."""

from __future__ import annotations

from k3serve.training.corpus import (COPY_NOTES, COPY_REQUESTS, EXTRA_CODE_SKIP_DIRS, HOLDOUT_EVERY, book_paragraphs,
                                     book_prose, copy_documents, extra_code, extra_code_files, split,
                                     without_docstring)

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
    # the left-out paragraphs (training-only extra prose) are exactly the rest: disjoint from the thinned set
    rest = book_prose(sum(len(p) for p in full) // 4, path, left_out=True)
    assert len(rest) + len(thin) == 100 and not set(rest) & set(thin)
    assert book_prose(1 << 30, path, left_out=True) == []


def test_split_is_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(95)]
    train, held = split(docs)
    assert held == [docs[i] for i in range(HOLDOUT_EVERY - 1, 95, HOLDOUT_EVERY)]
    assert sorted(train + held, key=lambda d: int(d.split()[1])) == docs
    assert split(["a", "b"]) == (["a"], ["b"])
    assert split(["only"]) == (["only"], [])


MODULE = """import os


class Thing:
    def size(self):
        total = 0
        for part in self.parts:
            total += len(part)
        return total

    def name(self):
        return self._name


def helper(x, y):
    if x > y:
        return x - y
    return y - x


def too_long():
""" + "".join(f"    v{i} = {i}\n" for i in range(40))


def test_revision_documents_repeat_a_function_exactly_or_with_one_note():
    docs = copy_documents([MODULE], 1 << 20)
    assert len(docs) == 2  # size and helper: name is under 3 lines, too_long over 16
    for n, doc in enumerate(docs):
        first, rest = doc.split("\n\n", 1)
        request, again = rest.split("\n", 1)
        assert request == COPY_REQUESTS[n % len(COPY_REQUESTS)]
        assert first.startswith("def ") and "\n    " in first  # dedented to column 0, body indented
        a, b = first.splitlines(), again.rstrip("\n").splitlines()
        if n % 2 == 0:
            assert b == a
        else:
            extra = [line for line in b if line.strip() in COPY_NOTES]
            assert len(extra) == 1 and [line for line in b if line not in extra] == a
            assert extra[0].startswith("    ")  # indented like the body
        assert first in MODULE.replace("\n    ", "\n") or all(line in MODULE for line in a[1:])
    assert copy_documents([MODULE], 1) == docs[:1]  # the byte cap stops after the first
    assert copy_documents(["not python ("], 1 << 20) == []


def test_revision_documents_per_module_cap():
    module = "\n\n".join(f"def f{i}(x):\n    y = x + {i}\n    return y * 2\n" for i in range(10))
    assert len(copy_documents([module], 1 << 20)) == 4  # the default cap
    assert len(copy_documents([module], 1 << 20, per_module=16)) == 10


def test_extra_code_leaves_out_tests_and_vendored_code():
    files = extra_code_files()  # the torch package is installed wherever training runs
    assert files and files == sorted(files)
    assert not any(EXTRA_CODE_SKIP_DIRS.intersection(f.parts[len(files[0].parts) - 1:-1]) for f in files)
    texts = extra_code(200_000)
    assert 200_000 <= sum(len(t.encode()) for t in texts) < 200_000 + max(len(t.encode()) for t in texts) + 1
    assert extra_code(0) == []


def test_without_docstring_drops_only_the_docstring():
    body = ['def f(a,', '      b):', '    """Two lines', '    of docstring."""', '', '    if a:', '        return b',
            '    return a']
    assert without_docstring(body) == ['def f(a,', '      b):', '    if a:', '        return b', '    return a']
    kept = [
        ['def f():', '    """Only a docstring."""'],  # the docstring is the whole body
        ['def f(): """x"""; return 1', ''],  # on the def line
        ['def f():', '    """x"""; return 1'],  # shares its line with the next statement
        ['def f():', '    """Two', '    lines."""; return 1'],  # its last line holds the next statement
        ['def f():', '    x = "not a docstring"', '    return x'],
        ['def f():', '    return (', 'oops'],  # does not parse
    ]
    for lines in kept:
        assert without_docstring(lines) == lines


def test_revision_documents_strip_docstrings_by_share():
    module = "\n\n".join(f'def f{i}(x):\n    """Doc {i}."""\n    y = x + {i}\n    return y * 2\n' for i in range(8))
    plain = copy_documents([module], 1 << 20, per_module=16)
    assert copy_documents([module], 1 << 20, per_module=16, strip_docstrings=0.0) == plain
    assert all('"""' in doc for doc in plain)
    stripped = copy_documents([module], 1 << 20, per_module=16, strip_docstrings=1.0)
    assert len(stripped) == len(plain) and not any('"""' in doc for doc in stripped)
    for n, doc in enumerate(stripped):  # both copies lose it; the rest is unchanged (the note may move)
        def drop(text):
            return [line for line in text.splitlines() if line.strip() not in COPY_NOTES]
        assert drop(doc) == drop(plain[n].replace(f'    """Doc {n}."""\n', ""))
        assert len(doc.splitlines()) == len(plain[n].splitlines()) - 2
    half = copy_documents([module], 1 << 20, per_module=16, strip_docstrings=0.5)
    assert ['"""' not in doc for doc in half] == [False, False, True, True] * 2  # in pairs: n // 2 = 1, 3
