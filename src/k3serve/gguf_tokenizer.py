"""The tokenizer and chat template stored in a GGUF file's metadata, as an `HFTokenizer`.

llama.cpp's converter writes a byte-level BPE vocabulary as `tokenizer.ggml.model = "gpt2"` with:
    tokenizer.ggml.tokens       [V] token strings (in the byte-level alphabet, as in tokenizer.json)
    tokenizer.ggml.token_type   [V] 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    tokenizer.ggml.merges       ["a b", ...] in rank order
    tokenizer.ggml.pre          the name of the pre-tokenizer (its split regexes live in llama.cpp's C++ code)
    tokenizer.ggml.{bos,eos,eot}_token_id, tokenizer.ggml.add_bos_token, tokenizer.chat_template
From these a tokenizer.json-shaped spec is rebuilt: normal tokens form the BPE vocabulary, control and
user-defined tokens become added tokens (control ones special), unused ones (placeholders) are left out. The
split regexes are known for the pre-tokenizer names in `PRE_TOKENIZER_REGEXES` (the patterns of those models'
tokenizer.json files, which llama.cpp applies in the same order, and Kimi's tiktoken pattern for `kimi-k2`, whose
vocabulary the converter stores with id = rank and merges derived from the ranks); another name is a
`TokenizerError` naming it.
A file that embeds its tokenizer.json (`tokenizer.huggingface.json`) is read from that instead.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from k3serve.errors import TokenizerError
from k3serve.hf_tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> the regexes of the model's tokenizer.json Split steps, applied in order
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",),
    "deepseek-v3": (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    # Kimi K2 / Kimi Linear / K3 (tiktoken vocabularies; the converter stores the ranks as ids and derives merges
    # from them): Han runs; letter words (leading upper-case letters, then lower-case ones, or the reverse), Han
    # excluded, with an optional leading non-letter and an English contraction; digit runs of 1-3; then the qwen2
    # tail. Kimi's pattern excludes Han by set intersection ([...&&[^\p{Han}]]), written here as a lookahead; a
    # bare script name in Rust's regex (tiktoken's) means its Script_Extensions, hence scx=Han.
    "kimi-k2": ("|".join([
        r"\p{scx=Han}+",
        r"[^\r\n\p{L}\p{N}]?(?:(?!\p{scx=Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*"
        r"(?:(?!\p{scx=Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?(?:(?!\p{scx=Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+"
        r"(?:(?!\p{scx=Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
    ]),),
}


def tokenizer_spec(metadata: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A tokenizer.json-shaped dict from GGUF tokenizer metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"{where}: the GGUF metadata carries no tokenizer")
    if model != "gpt2":
        raise TokenizerError(f"{where}: tokenizer model {model!r} is not supported (byte-level BPE, 'gpt2', only)")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        raise TokenizerError(f"{where}: pre-tokenizer {pre!r} is not known here (known: "
                             f"{', '.join(sorted(PRE_TOKENIZER_REGEXES))}); pass token ids instead")
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise TokenizerError(f"{where}: GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"{where}: {len(tokens)} tokens but {len(types)} token types")
    vocab: dict[str, int] = {}
    added: list[dict[str, Any]] = []
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": token_id, "content": token, "special": kind == CONTROL})
        elif kind != UNUSED and token not in vocab:
            vocab[token] = token_id
    steps: list[dict[str, Any]] = [{"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated",
                                    "invert": False} for r in regexes]
    steps.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    return {"model": {"type": "BPE", "vocab": vocab, "merges": list(merges)},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps},
            "decoder": {"type": "ByteLevel"}, "normalizer": None, "added_tokens": added}


def _tokenizer_parts(metadata: Mapping[str, Any], where: str) -> tuple[dict[str, Any], str | None, list[int],
                                                                        str | None]:
    """(tokenizer.json spec, bos token if the file asks for one, eos ids, chat template) of the file."""
    embedded = metadata.get("tokenizer.huggingface.json")
    if isinstance(embedded, str):
        try:
            spec = json.loads(embedded)
        except json.JSONDecodeError as exc:
            raise TokenizerError(f"{where}: tokenizer.huggingface.json cannot be parsed: {exc}") from exc
    else:
        spec = tokenizer_spec(metadata, where)
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def token_at(key: str) -> str | None:
        token_id = metadata.get(key)
        if token_id is None:
            return None
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
            raise TokenizerError(f"{where}: {key} {token_id!r} is not a token id")
        return tokens[token_id]

    bos = token_at("tokenizer.ggml.bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
    eos_ids = [int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if isinstance(metadata.get(k), int)]
    template = metadata.get("tokenizer.chat_template")
    return spec, bos, eos_ids, template if isinstance(template, str) else None


def tokenizer_from_gguf(metadata: Mapping[str, Any], where: str) -> HFTokenizer:
    """The file's tokenizer, its bos (if the file asks for one), eos ids and chat template."""
    spec, bos, eos_ids, template = _tokenizer_parts(metadata, where)
    return HFTokenizer(spec, bos_token=bos, extra_eos_ids=eos_ids, chat_template=template)


def write_tokenizer_files(metadata: Mapping[str, Any], out: Path, where: str) -> bool:
    """The file's tokenizer as the side files `HFTokenizer.from_dir` reads (tokenizer.json, tokenizer_config.json
    with bos and chat template, generation_config.json with the eos ids), for a store packed from a GGUF file.
    False, with a warning, when the metadata holds no tokenizer this module can rebuild (the store then runs on
    token ids, as the file does)."""
    try:
        spec, bos, eos_ids, template = _tokenizer_parts(metadata, where)
        HFTokenizer(spec, bos_token=bos, extra_eos_ids=eos_ids, chat_template=template)  # refuse what cannot load
    except TokenizerError as exc:
        logger.warning("%s: tokenizer not usable (%s); the packed store takes token ids", where, exc)
        return False
    files = {"tokenizer.json": spec, "generation_config.json": {"eos_token_id": eos_ids},
             "tokenizer_config.json": {"bos_token": bos, "add_bos_token": bos is not None, "chat_template": template}}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    return True
