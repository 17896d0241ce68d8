"""Property test (hypothesis) of serve/text.py: a completion's text released chunk by chunk, for any bytes cut
into any chunks, equals the whole text cut at the first stop string, and never shows part of a stop string."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3serve.serve.text import TextTracker, find_stop
from k3serve.tokenizer import Tokenizer

# the stdlib-trained BPE (a test fixture; the shipped model carries its own tokenizer)
STDLIB_TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "stdlib_tokenizer"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(STDLIB_TOKENIZER)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(1, 7), max_size=60),
       stops=st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_released_text_is_the_whole_text_cut_at_the_first_stop(tokenizer, data, cuts, stops):
    ids = tokenizer.encode_bytes(data)
    tracker = TextTracker(tokenizer, stops)
    released, start = [], 0
    for size in cuts + [len(ids)]:
        released.append(tracker.add(ids[start:start + size]))
        start += size
        partial = "".join(released)
        assert find_stop(partial, stops) is None, "a stop string was released"
    released.append(tracker.finish())
    whole = data.decode("utf-8", errors="replace")
    cut = find_stop(whole, stops)
    assert "".join(released) == (whole if cut is None else whole[:cut])
    assert tracker.stopped == (cut is not None)
