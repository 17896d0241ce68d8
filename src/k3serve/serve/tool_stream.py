"""Tool calls streamed as they are generated, in OpenAI's chunk shapes (issue 32, item 16).

A call's first delta carries `index`, `id`, `type: "function"`, `function.name` and `function.arguments: ""`;
later deltas carry `function.arguments` fragments; the final chunk's finish_reason is "tool_calls". The
accumulated deltas equal the non-streamed reply's `tool_calls` (serve/structured.py `parse_tool_calls`), whose
arguments are `json.dumps` of the parsed value: the arguments are therefore streamed re-serialised the same way,
one finished JSON token at a time (a string, number or literal is sent once it is complete).

The reply text is scanned again from its start at every step (a reply is at most a few thousand characters):
- forced calls (a grammar): the text is one call object, or an array of them;
- auto (`<tool_call>` blocks): leading whitespace and a partial marker are held; text that cannot begin a block
  makes the reply plain content from then on (the non-streamed reply of prose with calls is content too).
A reply that turns out not to be a call (cut short by max_tokens, bad JSON, prose after a block) is answered as
the non-streamed reply answers it: every character not yet sent as content is sent as content in the last chunk,
with finish_reason "stop" or "length"; deltas of a call already sent cannot be withdrawn, and a client tells
them apart by that finish_reason.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field

from k3serve.serve.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, OutputPlan, parse_tool_calls

logger = logging.getLogger(__name__)

_WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, as json.loads skips it
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")


class _Incomplete(Exception):
    """The text ends before the value does."""


class _Invalid(Exception):
    """The text cannot be the JSON the reply needs."""


@dataclass
class _ScannedCall:
    name: str | None = None
    arguments: str = ""  # canonical (json.dumps) text of the arguments' finished tokens


@dataclass
class _Scan:
    calls: list[_ScannedCall] = field(default_factory=list)
    content: bool = False  # the reply is plain content
    invalid: bool = False  # the reply cannot be calls; nothing more is streamed as a call


def _skip_whitespace(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def _string_end(text: str, i: int) -> int:
    """Index after the JSON string starting at text[i] == '"'."""
    string = _STRING.match(text, i)
    if string is None:  # its closing quote is still to come
        raise _Incomplete
    return string.end()


def _scalar(text: str, i: int) -> tuple[str, int, object]:
    """(canonical text, end, value) of the string, number or literal at text[i]."""
    if text[i] == '"':
        end = _string_end(text, i)
    else:
        literal = next((lit for lit in _LITERALS if text.startswith(lit, i)), None)
        if literal is not None:
            end = i + len(literal)
        elif any(lit.startswith(text[i:]) for lit in _LITERALS):
            raise _Incomplete
        else:
            run = _NUMBER_CHARS.match(text, i)
            if run is None:
                raise _Invalid
            if run.end() == len(text):  # more digits may follow
                raise _Incomplete
            end = run.end()
    try:
        value = json.loads(text[i:end])
    except json.JSONDecodeError:
        raise _Invalid from None
    return json.dumps(value), end, value


def _value(text: str, i: int, out: list[str]) -> int:
    """Scan the JSON value at text[i:], appending its canonical tokens to `out` as they finish; its end."""
    stack: list[str] = []  # open containers, '{' or '['
    expect = "value"  # value | value_or_close | key | key_or_close | colon | comma_or_close
    while True:
        i = _skip_whitespace(text, i)
        if i == len(text):
            raise _Incomplete
        char = text[i]
        if expect == "colon":
            if char != ":":
                raise _Invalid
            out.append(": ")
            i, expect = i + 1, "value"
            continue
        if expect == "comma_or_close":
            if char == ",":
                out.append(", ")
                i, expect = i + 1, ("key" if stack[-1] == "{" else "value")
                continue
            if char != {"{": "}", "[": "]"}[stack[-1]]:
                raise _Invalid
        elif expect in ("key", "key_or_close"):
            if char == "}" and expect == "key_or_close":
                pass
            elif char == '"':
                token, i, _ = _scalar(text, i)
                out.append(token)
                expect = "colon"
                continue
            else:
                raise _Invalid
        elif char in "{[":
            out.append(char)
            stack.append(char)
            i, expect = i + 1, ("key_or_close" if char == "{" else "value_or_close")
            continue
        elif not (char == "]" and expect == "value_or_close"):
            token, i, _ = _scalar(text, i)
            out.append(token)
            if not stack:
                return i
            expect = "comma_or_close"
            continue
        out.append(char)  # a closing bracket
        stack.pop()
        i += 1
        if not stack:
            return i
        expect = "comma_or_close"


def _call(text: str, i: int, call: _ScannedCall) -> int:
    """Scan one call object {"name": ..., "arguments": ...} at text[i:] into `call`; its end."""
    i = _skip_whitespace(text, i)
    if i == len(text):
        raise _Incomplete
    if text[i] != "{":
        raise _Invalid
    i, first = i + 1, True
    while True:
        i = _skip_whitespace(text, i)
        if i == len(text):
            raise _Incomplete
        if text[i] == "}":
            if call.name is None:
                raise _Invalid
            return i + 1
        if not first:
            if text[i] != ",":
                raise _Invalid
            i = _skip_whitespace(text, i + 1)
            if i == len(text):
                raise _Incomplete
        if text[i] != '"':
            raise _Invalid
        _, i, key = _scalar(text, i)
        i = _skip_whitespace(text, i)
        if i == len(text):
            raise _Incomplete
        if text[i] != ":":
            raise _Invalid
        i = _skip_whitespace(text, i + 1)
        if i == len(text):
            raise _Incomplete
        if key == "name":
            _, i, name = _scalar(text, i)
            if not isinstance(name, str):
                raise _Invalid
            call.name = name
        elif key == "arguments" and text[i] == '"':  # arguments given as a string are passed on as they are
            _, i, value = _scalar(text, i)
            call.arguments = value
        else:
            # TODO: a repeated key keeps its last value in the non-streamed reply; here the first was streamed
            out: list[str] = []
            try:
                i = _value(text, i, out)
            finally:
                if key == "arguments":
                    call.arguments = "".join(out)
        first = False


def _scan_forced(text: str, scan: _Scan) -> None:
    i = _skip_whitespace(text, 0)
    if i == len(text):
        raise _Incomplete
    if text[i] != "[":
        scan.calls.append(_ScannedCall())
        _call(text, i, scan.calls[-1])
        return
    i += 1
    while True:
        scan.calls.append(_ScannedCall())
        i = _skip_whitespace(text, _call(text, i, scan.calls[-1]))
        if i == len(text):
            raise _Incomplete
        if text[i] == "]":
            return
        if text[i] != ",":
            raise _Invalid
        i += 1


def _scan_blocks(text: str, scan: _Scan) -> None:
    i = 0
    while True:
        i = _skip_whitespace(text, i)
        rest = text[i:]
        if TOOL_CALL_OPEN.startswith(rest):
            raise _Incomplete  # empty, or a marker still arriving
        if not rest.startswith(TOOL_CALL_OPEN):
            if not scan.calls:
                scan.content = True
                return
            raise _Invalid  # prose after a call: the non-streamed reply is content
        scan.calls.append(_ScannedCall())
        i = _skip_whitespace(text, _call(text, i + len(TOOL_CALL_OPEN), scan.calls[-1]))
        rest = text[i:]
        if TOOL_CALL_CLOSE.startswith(rest):
            raise _Incomplete
        if not rest.startswith(TOOL_CALL_CLOSE):
            raise _Invalid
        i += len(TOOL_CALL_CLOSE)


def _scan(text: str, plan: OutputPlan) -> _Scan:
    scan = _Scan()
    try:
        (_scan_forced if plan.forced_tools else _scan_blocks)(text, scan)
    except _Incomplete:
        pass
    except _Invalid:
        scan.invalid = True
    return scan


@dataclass
class ToolDelta:
    """What one step adds to a chat choice's delta."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallStreamer:
    """The reply of one chat choice with tools, as deltas: `add(text)` with the newly released text at each step,
    `finish(reason)` once at its end, which also returns the finish_reason to send."""

    def __init__(self, plan: OutputPlan) -> None:
        assert plan.uses_tools
        self._plan = plan
        self.text = ""
        self._content_sent = 0
        self._sent: list[tuple[str, str]] = []  # (name, arguments sent) per call started
        self._frozen = False  # the reply cannot be calls: send nothing more as a call

    def add(self, text: str) -> list[ToolDelta]:
        """The deltas (one chunk each) that `text`, the newly released text, makes sendable."""
        self.text += text
        if self._frozen:
            return []
        scan = _scan(self.text, self._plan)
        if scan.content:
            return self._rest_as_content()
        self._frozen = scan.invalid
        return self._call_deltas([(c.name, c.arguments) for c in scan.calls if c.name is not None])

    def finish(self, reason: str | None) -> tuple[list[ToolDelta], str | None]:
        """The last deltas and the finish_reason: the reply's calls when it is one (as the non-streamed reply
        parses it), else its content."""
        calls = parse_tool_calls(self.text, self._plan) if reason == "stop" else None
        if not calls:
            return self._rest_as_content(), reason
        final = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        for (name, sent), (final_name, arguments) in zip(self._sent, final):
            if name != final_name or not arguments.startswith(sent):
                logger.warning("a streamed tool call differs from the parsed reply: %r sent, %r parsed",
                               (name, sent), (final_name, arguments))
        return self._call_deltas(final), "tool_calls"

    def _rest_as_content(self) -> list[ToolDelta]:
        rest = self.text[self._content_sent:]
        self._content_sent = len(self.text)
        return [ToolDelta(content=rest)] if rest else []

    def _call_deltas(self, calls: list[tuple[str, str]]) -> list[ToolDelta]:
        """New arguments of calls already started, then each new call's first delta and its arguments so far,
        each call at most once per delta (one chunk each)."""
        fragments: list[dict] = []
        starts: list[ToolDelta] = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._sent):
                starts.append(ToolDelta(tool_calls=[{"index": index, "id": "call_" + uuid.uuid4().hex[:24],
                                                     "type": "function",
                                                     "function": {"name": name, "arguments": ""}}]))
                self._sent.append((name, ""))
            sent = self._sent[index][1]
            if len(arguments) > len(sent) and arguments.startswith(sent):
                self._sent[index] = (name, arguments)
                fragment = {"index": index, "function": {"arguments": arguments[len(sent):]}}
                if starts and starts[-1].tool_calls[0]["index"] == index:
                    starts.append(ToolDelta(tool_calls=[fragment]))
                else:
                    fragments.append(fragment)
        return ([ToolDelta(tool_calls=fragments)] if fragments else []) + starts
