"""Turning a completion's token ids into text as they stream: special tokens hidden, stop strings honoured.

Text is released only when it can no longer turn into a stop string: the last (longest stop - 1) characters are
held back until more text arrives or the completion ends, so a client never sees the start of a stop string
that is then cut. Incomplete UTF-8 is held back by the tokenizer's stream decoder.
"""

from __future__ import annotations

from k3serve.tokenizer import Tokenizer


class TextTracker:
    """The text of one completion. `add(new_ids)` returns the newly releasable text."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self._tokenizer = tokenizer
        self._decoder = tokenizer.stream_decoder()
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything decoded so far (cut at a stop string once one is found)
        self._released = 0
        self.stopped = False  # a stop string was found

    def add(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        for token in new_ids:
            if not self._tokenizer.is_special(token):
                self.text += self._decoder.add(token)
        cut = find_stop(self.text, self._stops)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(len(self.text))
        return self._release(max(self._released, len(self.text) - self._hold))

    def finish(self) -> str:
        if not self.stopped:
            self.text += self._decoder.flush()
            cut = find_stop(self.text, self._stops)
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        chunk = self.text[self._released:upto]
        self._released = max(self._released, upto)
        return chunk


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stop_hook_for(tokenizer: Tokenizer, stops: list[str]):
    """An engine stop hook: finishes a completion once its text contains a stop string."""
    if not stops:
        return None
    window = 4 * max(len(s) for s in stops) + 8  # tokens: a character takes at most 4 byte-level tokens

    def hook(generated_ids: list[int]) -> bool:
        tail = [t for t in generated_ids[-window:] if not tokenizer.is_special(t)]
        return find_stop(tokenizer.decode(tail), stops) is not None

    return hook
