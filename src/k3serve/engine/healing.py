"""Token healing: a prompt that ends inside what training text would hold as one token.

A byte-level BPE whose split pattern attaches newlines to punctuation learns `"):\\n"` as one token, so the prompt
`"def f(n):"` ends in the tokens `")" ":"`, a boundary the model never saw before a line break; greedy decoding
then wanders off (the trained default model answers `"  # 2001-150-..."`). Healing backs off the prompt's last
tokens while some longer vocabulary token starts with their bytes, and constrains the first generated tokens to
spell those bytes out again (`"):\\n"` is allowed, `"x"` is not). What is printed starts after the healed bytes, so
the visible text is unchanged except for the better continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_BACKOFF = 4  # tokens


@dataclass
class Healing:
    """The prompt without its backed-off tail, and the constraint that spells the tail out again."""

    prompt_ids: list[int]
    tail: bytes  # the bytes generation must start with
    vocabulary: list[bytes]  # bytes of every ordinary token (b"" for specials, never allowed)

    def allowed(self, generated: list[int]) -> np.ndarray | None:
        """Token ids allowed next, given the tokens generated so far; None once the tail is spelled out."""
        spelled = b"".join(self.vocabulary[t] for t in generated)
        if len(spelled) >= len(self.tail):
            return None
        rest = self.tail[len(spelled):]
        ids = [i for i, b in enumerate(self.vocabulary) if b and (b.startswith(rest) or rest.startswith(b))]
        return np.asarray(ids, dtype=np.int64)

    def visible_skip(self) -> int:
        """Characters of decoded output that repeat the prompt's tail (not printed)."""
        return len(self.tail.decode("utf-8", errors="replace"))


def heal_prompt(tokenizer, prompt_ids: list[int]) -> Healing | None:
    """Back off the longest tail (at most MAX_BACKOFF tokens) that is a strict prefix of some vocabulary token.
    None when nothing would change (the last token cannot be extended, or the prompt is one token)."""
    vocabulary = [b"" if tokenizer.is_special(i) else tokenizer.id_to_bytes(i) for i in range(tokenizer.vocab_size)]
    best = 0
    for k in range(1, min(MAX_BACKOFF, len(prompt_ids) - 1) + 1):
        if tokenizer.is_special(prompt_ids[-k]):
            break
        tail = b"".join(vocabulary[t] for t in prompt_ids[-k:])
        if any(len(b) > len(tail) and b.startswith(tail) for b in vocabulary):
            best = k
    if best == 0:
        return None
    tail = b"".join(vocabulary[t] for t in prompt_ids[-best:])
    return Healing(list(prompt_ids[:-best]), tail, vocabulary)
