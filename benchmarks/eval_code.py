"""Does a model write function bodies? Greedy continuations of 24 common function signatures, the way
`k3serve generate` makes them (BOS, token healing, up to 64 tokens, stop at [EOS]).

Each continuation is cut where the function ends (the first non-blank line at column 0). The docstring, comments
and strings are left out, and Python's tokenizer finds what the body's code holds: an `if` (or `elif`), a `return`,
and a call (a name followed by `(`, keywords excepted). Issue #20's fibonacci target asks for all three; this
counts how many of the 24 signatures meet it, so that a model is judged on more than the one prompt.

    .venv/bin/python benchmarks/eval_code.py [--model DIR] [--max-tokens 64] [--json OUT] [--expert-top-p P]
"""

from __future__ import annotations

import argparse
import io
import json
import keyword
import tokenize

from k3serve.engine.generate import generate
from k3serve.engine.healing import heal_prompt
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model
from k3serve.model.routing import ExpertTopP

SIGNATURES = (
    "def fibonacci(n):", "def factorial(n):", "def is_prime(n):", "def gcd(a, b):", "def reverse(s):",
    "def mean(values):", "def flatten(items):", "def clamp(x, lo, hi):", "def read_lines(path):",
    "def count_words(text):", "def find(items, target):", "def maximum(values):", "def is_palindrome(s):",
    "def merge(a, b):", "def parse_int(s):", "def unique(items):", "def power(x, n):",
    "def binary_search(items, x):", "def sum_digits(n):", "def normalize(name):", "def chunks(items, size):",
    "def is_even(n):", "def last(items):", "def swap(pair):",
)


def function_text(text: str) -> str:
    """The first function of `text`: its first line and every following line until one starts at column 0."""
    lines = text.split("\n")
    out = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break
        out.append(line)
    return "\n".join(out)


def body_features(text: str) -> dict:
    """What the body's code holds: `if`/`elif`, `return`, a call, and whether any code follows the docstring.
    Strings (so the docstring) and comments never count. A continuation cut off mid-token keeps what came before."""
    body = function_text(text).split("\n", 1)[1] if "\n" in text else ""
    code: list[tuple[int, str]] = []  # (token type, string) of the body, strings and comments dropped
    try:
        for tok in tokenize.generate_tokens(io.StringIO(body).readline):
            if tok.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER):
                code.append((tok.type, tok.string))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # cut off by max-tokens: keep the tokens before the break
    words = [s for t, s in code if t == tokenize.NAME]
    call = any(t == tokenize.NAME and not keyword.iskeyword(s) and nxt == "("
               for (t, s), (_, nxt) in zip(code, code[1:]))
    return {"code": bool(code), "if": "if" in words or "elif" in words, "return": "return" in words, "call": call}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--expert-top-p", type=float, default=1.0, help="keep experts up to this routing weight")
    parser.add_argument("--expert-top-p-min", type=int, default=ExpertTopP().min_kept)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the record (with every continuation) here")
    args = parser.parse_args()
    loaded = load_model(args.model, expert_top_p=ExpertTopP(args.expert_top_p, args.expert_top_p_min))
    tokenizer = loaded.tokenizer
    stops = set(loaded.stop_ids)
    rows = []
    for signature in SIGNATURES:
        ids = [tokenizer.bos_id] + tokenizer.encode(signature)
        healing = heal_prompt(tokenizer, ids)
        prompt = healing.prompt_ids if healing else ids
        tokens, _ = generate(loaded.model, prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                             stop_ids=loaded.stop_ids, constraint=healing.allowed if healing else None)
        tokens = [t for t in tokens if t not in stops]
        text = tokenizer.decode(list(prompt) + tokens)
        text = text[text.index(signature):]  # from the signature on (BOS and the healed tail spelled out)
        rows.append({"signature": signature, "text": text, **body_features(text)})
    met = [r for r in rows if r["if"] and r["return"] and r["call"]]
    record = {"signatures": len(rows), "with_code_body": sum(r["code"] for r in rows),
              "with_if": sum(r["if"] for r in rows), "with_return": sum(r["return"] for r in rows),
              "with_call": sum(r["call"] for r in rows), "if_return_and_call": len(met),
              "fibonacci": next(r for r in rows if r["signature"].startswith("def fibonacci"))}
    for r in rows:
        flags = " ".join(k for k in ("code", "if", "return", "call") if r[k])
        first = function_text(r["text"]).split("\n")[1:4]
        print(f"{r['signature']:<30} [{flags}]  " + " | ".join(line.strip() for line in first))
    print(f"{record['with_code_body']} of {len(rows)} write code after the docstring; {record['with_if']} an if, "
          f"{record['with_return']} a return, {record['with_call']} a call; {len(met)} all three "
          f"(fibonacci: {'yes' if record['fibonacci'] in met else 'no'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**record, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
