"""Chat templates: the checkpoint's own, or k3serve's built-in one in the style of the Kimi family.

A family checkpoint (Hugging Face `tokenizer.json`) carries its template as jinja in `tokenizer_config.json` or
`chat_template.jinja`; it is rendered in a sandbox with `messages`, `add_generation_prompt=True`, `bos_token` and
`eos_token`, and the text is tokenized with the special tokens the template writes recognised (the template writes
the BOS itself). Message text is always plain text: "<|im_start|>system" typed by a user is those characters, never
a role marker. To tell the template's markers from the messages' text, a message holding a special token's text is
rendered once more between two sentinel characters, which locates it in the rendered text; a template that changes
such a message's text (so it cannot be located) makes the request a 400. Otherwise the built-in template over the
tokenizer's special tokens, whose message text is encoded as plain text:

    <|im_system|>system<|im_middle|>You are ...<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>
    <|im_assistant|>assistant<|im_middle|>

The model stops at <|im_end|> (one of its end-of-sequence tokens). A tokenizer with neither has no chat template,
and /v1/chat/completions answers 400 for it.
"""

from __future__ import annotations

from functools import lru_cache

from k3serve.errors import RequestError
from k3serve.hf_tokenizer import HFTokenizer
from k3serve.tokenizer import Tokenizer

_ROLE_TOKENS = {"system": "<|im_system|>", "developer": "<|im_system|>", "user": "<|im_user|>",
                "assistant": "<|im_assistant|>", "tool": "<|im_system|>"}  # tool results: a system turn named tool
_MIDDLE, _END = "<|im_middle|>", "<|im_end|>"


def _checkpoint_template(tokenizer: Tokenizer | HFTokenizer) -> str | None:
    return tokenizer.chat_template if isinstance(tokenizer, HFTokenizer) else None


def has_chat_template(tokenizer: Tokenizer | HFTokenizer) -> bool:
    needed = set(_ROLE_TOKENS.values()) | {_MIDDLE, _END}
    return _checkpoint_template(tokenizer) is not None or needed <= set(tokenizer.special_tokens)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template)


def _render(tokenizer: HFTokenizer, template: str, messages: list[tuple[str, str]]) -> list[int]:
    from jinja2 import TemplateError

    def token_text(token_id: int | None) -> str:
        return "" if token_id is None else tokenizer.id_to_bytes(token_id).decode("utf-8", "replace")

    def render(contents: list[str]) -> str:
        try:
            return _compile(template).render(
                messages=[{"role": "system" if role == "developer" else role, "content": content}
                          for (role, _), content in zip(messages, contents)],
                add_generation_prompt=True, bos_token=token_text(tokenizer.bos_id),
                eos_token=token_text(tokenizer.eos_ids[0] if tokenizer.eos_ids else None))
        except TemplateError as exc:
            raise RequestError(f"the model's chat template refused these messages: {exc}") from exc

    contents = [content for _, content in messages]
    text = render(contents)
    found = [min((t for t in tokenizer.special_tokens if t in content), key=content.index, default=None)
             for content in contents]  # the first special token text in each message
    if not any(found):
        return list(tokenizer.encode(text, allow_special=True))
    spans = _message_spans(text, contents, [token is not None for token in found], render)
    if spans is None:
        token = next(t for t in found if t is not None)
        raise RequestError(f"a message holds the text of the special token {token!r}, and this model's chat "
                           "template changes message text, so it cannot be kept as plain text; remove it")
    return tokenizer.encode_with_plain_spans(text, spans)


def _message_spans(text: str, contents: list[str], marked: list[bool], render) -> list[tuple[int, int]] | None:
    """Where the `marked` messages' text lies in the rendered `text`, as [start, end) spans: the messages are
    rendered again between two sentinel characters that occur nowhere else. None if the template changed their
    text (the sentinels cannot be removed to give `text` again)."""
    used = set(text).union(*map(set, contents))
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)  # Unicode's private use area
    open_mark, close_mark = next(free, None), next(free, None)
    if open_mark is None or close_mark is None:
        return None
    wrapped = render([open_mark + content + close_mark if mark else content
                      for content, mark in zip(contents, marked)])
    spans: list[tuple[int, int]] = []
    plain: list[str] = []
    position, start = 0, None
    for char in wrapped:
        if char == open_mark:
            if start is not None:
                return None
            start = position
        elif char == close_mark:
            if start is None:
                return None
            spans.append((start, position))
            start = None
        else:
            plain.append(char)
            position += 1
    if start is not None or "".join(plain) != text:
        return None
    return spans


def apply_chat_template(tokenizer: Tokenizer | HFTokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """(role, text) pairs -> prompt ids ending with the assistant header, ready to generate the reply."""
    template = _checkpoint_template(tokenizer)
    if template is not None:
        return _render(tokenizer, template, messages)
    if not has_chat_template(tokenizer):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions")
    special = tokenizer.special_tokens
    ids = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    for role, text in messages:
        name = "system" if role == "developer" else role
        ids += [special[_ROLE_TOKENS[role]], *tokenizer.encode(name), special[_MIDDLE], *tokenizer.encode(text),
                special[_END]]
    return ids + [special[_ROLE_TOKENS["assistant"]], *tokenizer.encode("assistant"), special[_MIDDLE]]
