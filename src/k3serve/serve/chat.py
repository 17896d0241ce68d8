"""The chat template of k3serve's models, in the style of the Kimi family:

    <|im_system|>system<|im_middle|>You are ...<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>
    <|im_assistant|>assistant<|im_middle|>

The model stops at <|im_end|> (one of its end-of-sequence tokens). A checkpoint whose tokenizer lacks these
special tokens has no chat template, and /v1/chat/completions answers 400 for it.
"""

from __future__ import annotations

from k3serve.errors import RequestError
from k3serve.tokenizer import Tokenizer

_ROLE_TOKENS = {"system": "<|im_system|>", "developer": "<|im_system|>", "user": "<|im_user|>",
                "assistant": "<|im_assistant|>"}
_MIDDLE, _END = "<|im_middle|>", "<|im_end|>"


def has_chat_template(tokenizer: Tokenizer) -> bool:
    needed = set(_ROLE_TOKENS.values()) | {_MIDDLE, _END}
    return needed <= set(tokenizer.special_tokens)


def apply_chat_template(tokenizer: Tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """(role, text) pairs -> prompt ids ending with the assistant header, ready to generate the reply."""
    if not has_chat_template(tokenizer):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions")
    special = tokenizer.special_tokens
    ids = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    for role, text in messages:
        name = "system" if role == "developer" else role
        ids += [special[_ROLE_TOKENS[role]], *tokenizer.encode(name), special[_MIDDLE], *tokenizer.encode(text),
                special[_END]]
    return ids + [special[_ROLE_TOKENS["assistant"]], *tokenizer.encode("assistant"), special[_MIDDLE]]
