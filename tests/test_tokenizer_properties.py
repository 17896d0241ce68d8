"""Property tests (hypothesis) of the shipped tokenizer: the byte round trip on any bytes, the text round trip on
any Unicode text, the stream decoder on any bytes cut at any token boundary, and lone surrogates refused with
their position."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3serve.errors import TokenizerError
from k3serve.tokenizer import Tokenizer

# the stdlib-trained BPE (a test fixture; the shipped model carries its own tokenizer)
STDLIB_TOKENIZER = Path(__file__).resolve().parents[0] / "fixtures" / "stdlib_tokenizer"

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(STDLIB_TOKENIZER)


@SETTINGS
@given(data=st.binary(max_size=300))
def test_any_bytes_round_trip(tokenizer, data):
    ids = tokenizer.encode_bytes(data)
    assert tokenizer.decode_bytes(ids) == data
    assert not any(tokenizer.is_special(i) for i in ids)


@SETTINGS
@given(text=st.text(max_size=200))  # any code points but surrogates, special-token strings included
def test_any_text_round_trips_and_matches_its_bytes(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids == tokenizer.encode_bytes(text.encode("utf-8"))


@SETTINGS
@given(data=st.binary(max_size=300))
def test_the_stream_decoder_equals_decoding_everything_at_once(tokenizer, data):
    ids = tokenizer.encode_bytes(data)
    decoder = tokenizer.stream_decoder()
    streamed = "".join(decoder.add(i) for i in ids) + decoder.flush()
    assert streamed == data.decode("utf-8", errors="replace") == tokenizer.decode(ids)


@SETTINGS
@given(before=st.text(max_size=40), after=st.text(max_size=40),
       surrogate=st.integers(min_value=0xD800, max_value=0xDFFF))
def test_a_lone_surrogate_is_refused_at_its_position(tokenizer, before, after, surrogate):
    with pytest.raises(TokenizerError, match=f"at character {len(before)} "):
        tokenizer.encode(before + chr(surrogate) + after)
