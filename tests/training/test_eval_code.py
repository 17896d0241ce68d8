"""benchmarks/eval_code.py's scoring: only the function's own code counts, never its docstring, comments, strings or
what follows at column 0, and a continuation cut off by max-tokens still scores what came before the cut."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "eval_code", Path(__file__).resolve().parents[2] / "benchmarks" / "eval_code.py")
eval_code = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(eval_code)


def features(text: str) -> tuple[bool, bool, bool, bool]:
    f = eval_code.body_features(text)
    return f["code"], f["if"], f["return"], f["call"]


def test_a_body_with_if_return_and_a_call():
    text = 'def fibonacci(n):\n    """Doc."""\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + 1\n'
    assert features(text) == (True, True, True, True)


def test_the_docstring_comments_and_strings_do_not_count():
    text = ('def f(n):\n    """Return if(n) is true, if not return len(n)."""\n    # if x: return g(x)\n'
            '    x = "if return call()"\n')
    assert features(text) == (True, False, False, False)
    assert features('def f(n):\n    """Only a docstring that loops, loops, loops') == (False, False, False, False)


def test_the_function_ends_at_column_zero():
    text = 'def f(n):\n    return n\n\n# The function above\nif x:\n    g(x)\n'
    assert eval_code.function_text(text) == 'def f(n):\n    return n\n'
    assert features(text) == (True, False, True, False)


def test_keywords_before_a_parenthesis_are_not_calls():
    assert features("def f(n):\n    return (n)\n")[3] is False
    assert features("def f(n):\n    if (n):\n        print(n)\n") == (True, True, False, True)
    assert features("def f(n):\n    elif_ = 1\n") == (True, False, False, False)  # a name, not the keyword
    assert features("def f(n):\n    x = 1\n    elif n:\n")[1] is True


def test_a_cut_off_continuation_keeps_what_came_before():
    assert features('def f(n):\n    if n:\n        return g(n, "unfinished') == (True, True, True, True)
    assert features("def f(n):\n    return [n for n in (1, 2") == (True, False, True, False)
