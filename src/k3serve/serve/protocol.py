"""The OpenAI-compatible request bodies, validated strictly: unknown fields, bad values and wrong JSON types
(`"stream": "yes"`, `"max_tokens": "5"`; an integer is still a number) are 400s.

Only what k3serve implements is accepted; a field we would silently ignore (penalties other than 0, echo) is
rejected with a message instead, so a client never believes it got behaviour it did not get.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
MAX_N = 16


STRICT = ConfigDict(extra="forbid", strict=True)  # no coercion: JSON types must match the schema


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer; strict pydantic does not. Strings stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(_integral)]  # an int field: 2 and 2.0, never "2" or 2.5


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = STRICT

    model: str
    # json_schema_extra: the validators' ranges, declared in /openapi.json too (validation is the validators')
    max_tokens: Integer | None = Field(default=None, json_schema_extra={"minimum": 1})
    temperature: float = Field(default=1.0, json_schema_extra={"minimum": 0, "maximum": 2})
    top_p: float = Field(default=1.0, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: Integer = Field(default=0, json_schema_extra={"minimum": -1})  # extension: 0 or -1 = no top-k filter
    n: Integer = Field(default=1, json_schema_extra={"minimum": 1, "maximum": MAX_N})
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = Field(default=None, validate_default=True)
    seed: Integer | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": 2**63 - 1})
    user: str | None = None
    cache_salt: str | None = None  # extension: isolates prefix-cache entries (vLLM's name)
    ignore_eos: bool = False  # extension
    speculative: Union[bool, Literal["ngram", "resident", "model"], None] = None  # extension: None = server
    # default, false = off, true = on with the server's settings (or n-gram), or a drafter name
    presence_penalty: float = Field(default=0.0, json_schema_extra={"enum": [0]})  # not supported: only 0
    frequency_penalty: float = Field(default=0.0, json_schema_extra={"enum": [0]})
    logit_bias: dict[str, Any] | None = Field(default=None, json_schema_extra={"maxProperties": 0})  # only {}

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0 or value > 2:
            raise ValueError("temperature must be a number in [0, 2]")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float) -> float:
        if not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError("top_p must be in (0, 1]")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError("top_k must be -1, 0 (both mean no limit) or positive")
        return max(value, 0)

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if not 1 <= value <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError("max_tokens must be a positive integer")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < 2**63:
            raise ValueError("seed must be a non-negative 64-bit integer")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [] if value is None else [value] if isinstance(value, str) else list(value)
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        for stop in stops:
            if not stop or len(stop) > MAX_STOP_LENGTH:
                raise ValueError(f"each stop sequence must have 1 to {MAX_STOP_LENGTH} characters")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("presence and frequency penalties are not supported; leave them at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("logit_bias is not supported; send {} or leave it out")
        return value


MAX_TOP_LOGPROBS = 20  # as engine/sampling.MAX_LOGPROBS


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[Integer], list[list[Integer]]] = Field(json_schema_extra={"minLength": 1,
                                                                                        "minItems": 1})
    echo: bool = False
    logprobs: Integer | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    best_of: Integer | None = Field(default=None, json_schema_extra={"enum": [1]})  # only the no-op 1
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})  # only null or ""

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("best_of is not supported beyond 1 (no extra candidates are generated); use n for "
                             "several completions")
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported (no fill-in-the-middle); send null or leave it out")
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, (str, list)) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None  # null (or absent) only for an assistant, as OpenAI allows
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (rendered back into the prompt)
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _content_needed(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id, the id of the assistant's tool call it answers")
        return self

    def text(self) -> str:
        if self.tool_calls:
            from k3serve.serve.structured import render_tool_calls

            return render_tool_calls([call.model_dump() for call in self.tool_calls])
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_needed(self):
        # NOTE: OpenAI's reference marks `schema` optional without saying what its absence means; unconstrained
        # prose would pass for success, so it is refused instead
        if self.schema_ is None:
            raise ValueError("response_format.json_schema.schema is missing: give the JSON Schema the reply must "
                             "follow (type json_object asks for any JSON object)")
        return self


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Integer | None = Field(default=None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: Integer | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": MAX_TOP_LOGPROBS})
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @field_validator("messages")
    @classmethod
    def _messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("messages must not be empty")
        return value


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: `prompt` (text) or `messages` (through the chat template)."""
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: prepend BOS
    add_generation_prompt: bool = True  # messages: end with the assistant header
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[Integer]
