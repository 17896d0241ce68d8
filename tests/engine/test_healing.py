"""Token healing: the prompt's tail is backed off only when a longer token starts with it, generation spells it out
again, and the printed text starts right after the prompt."""

from __future__ import annotations

from k3serve.cli.main import main
from k3serve.engine.generate import generate
from k3serve.engine.healing import heal_prompt
from k3serve.engine.sampling import SamplingParams
from k3serve.loading import load_model


def test_a_split_punctuation_tail_is_backed_off_and_spelled_out_again():
    loaded = load_model(None)
    tok = loaded.tokenizer
    ids = [tok.bos_id] + tok.encode("def fibonacci(n):")
    healing = heal_prompt(tok, ids)
    assert healing is not None
    assert healing.tail.endswith(b":") and tok.decode(healing.prompt_ids[1:]) + healing.tail.decode() == \
        "def fibonacci(n):"
    first = healing.allowed([])
    assert first is not None and len(first) > 0
    for t in first:  # every allowed token agrees with the tail byte for byte
        b = tok.id_to_bytes(int(t))
        assert b.startswith(healing.tail) or healing.tail.startswith(b)
    assert tok.encode("x")[0] not in set(first.tolist())
    out, _ = generate(loaded.model, healing.prompt_ids, SamplingParams(max_tokens=6, ignore_eos=True),
                      constraint=healing.allowed)
    assert tok.decode_bytes(out).startswith(healing.tail)
    assert healing.allowed(out) is None  # spelled out: no constraint after that


def test_nothing_is_backed_off_when_no_longer_token_starts_with_the_tail():
    loaded = load_model(None)
    tok = loaded.tokenizer
    vocab = [tok.id_to_bytes(i) for i in range(tok.vocab_size) if not tok.is_special(i)]
    longest = max(vocab, key=len)  # no token is longer, so none extends it
    ids = [tok.bos_id] + tok.encode(longest.decode())
    assert len(ids) == 2
    assert heal_prompt(tok, ids) is None
    assert heal_prompt(tok, [tok.bos_id]) is None


def test_cli_prints_only_the_continuation_with_and_without_healing(capsys):
    texts = {}
    for flag in ([], ["--no-token-healing"]):
        assert main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "8", "--ignore-eos", *flag]) == 0
        texts[bool(flag)] = capsys.readouterr().out
    healed = texts[False]
    assert not healed.startswith("):"), "the healed tail is part of the prompt and is not printed again"
    assert healed.startswith("\n"), healed  # '):' + newline is what the corpus has after a def line
    assert texts[True].strip()


def test_speculation_composes_with_healing_same_greedy_tokens():
    from k3serve.engine.speculative import SpeculativeConfig

    loaded = load_model(None)
    tok = loaded.tokenizer
    ids = [tok.bos_id] + tok.encode("def fibonacci(n):\n    if n < 2:")
    healing = heal_prompt(tok, ids)
    assert healing is not None and len(healing.tail) >= 1
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, _ = generate(loaded.model, healing.prompt_ids, params, constraint=healing.allowed)
    assert tok.decode_bytes(plain).startswith(healing.tail)
    for drafter in ("ngram", "resident"):
        spec, report = generate(loaded.model, healing.prompt_ids, params, constraint=healing.allowed,
                                speculative=SpeculativeConfig(drafter=drafter))
        assert spec == plain, drafter
        assert report.speculation.windows > 0, "speculation ran after the healed tail"


def test_cli_speculative_greedy_equals_plain_greedy_in_the_default_configuration(capsys):
    outputs = {}
    for flags in ([], ["--speculative", "ngram"]):
        assert main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "16", "--ignore-eos", *flags]) == 0
        outputs[bool(flags)] = capsys.readouterr().out
    assert outputs[True] == outputs[False] and outputs[False].startswith("\n")
