"""The `k3serve` command line: generate, logits, make-tiny, info."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from k3serve.cli import args as cli_args
from k3serve.cli import interrupts
from k3serve.cli.args import Parser, output_file, positive_int
from k3serve.cli.cluster import add_cluster_args, run_cluster
from k3serve.engine.config import PREFIX_CACHE_POLICIES
from k3serve.errors import K3Error, UsageError, exit_code, user_message
from k3serve.units import parse_size
from k3serve.cli.lab import add_lab_command
from k3serve.cli.ram_control import add_ram_controller_args, attach_from_args, check_ram_controller_args
from k3serve.cli.tenants import add_tenant_args, add_tenants_command
from k3serve.cli.stream import add_routing_args, add_stream_args, add_subcommands, load_for_run


def _add_model_arg(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--model", type=cli_args.model_path, required=required,
                        help="checkpoint folder (config.json + safetensors); default: the embedded model")


def _add_precision_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-precision", choices=("native", "bf16", "mxfp4", "int8"), default="native",
                        help="routed-expert precision for non-K3 families (K3 experts are MXFP4 already)")
    parser.add_argument("--trunk-precision", choices=("native", "bf16", "q8_0", "mxfp4"), default="native",
                        help="a checkpoint folder's or GGUF file's trunk matrices, embedding and lm_head: as stored "
                             "(native, alias bf16) or quantized at load to Q8_0 (8.5 bits a weight, as llama.cpp's "
                             "Q8_0 and MXFP4_MOE files hold them) or MXFP4 (4.25), multiplied from those bytes "
                             "(lossy; a packed store's trunk is set by `pack --trunk-precision`; default native)")


def _add_speculative_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (docs/SPECULATIVE.md)")
    group.add_argument("--speculative", choices=("off", "ngram", "resident", "model"), default="off",
                       help="drafter: n-gram prompt lookup, the model on its resident experts, or --draft-model")
    group.add_argument("--rollback", choices=("snapshot", "projection"), default="projection",
                       help="how KDA state goes back after rejected drafts")
    group.add_argument("--num-draft-tokens", type=cli_args.int_range(1, 32), default=None,
                       help="the most drafts per verify window (default: 8 for ngram, 4 for resident and model)")
    group.add_argument("--no-adaptive-draft", action="store_true", help="always draft --num-draft-tokens")
    group.add_argument("--speculative-io-aware", action="store_true",
                       help="choose the draft length from the bytes a streamed model's windows read (the measured "
                            "growth of the drafts' expert union) against the measured acceptance (docs/SPECULATIVE.md)")
    group.add_argument("--draft-model", type=cli_args.model_path, default=None,
                       help="checkpoint of a small draft model, for --speculative model (default: none)")


def _speculative_config(args: argparse.Namespace):
    """The SpeculativeConfig of the speculative flags (None for off), checked before any model loads."""
    if args.draft_model is not None and args.speculative != "model":
        raise UsageError("--draft-model needs --speculative model")
    if args.speculative == "model" and args.draft_model is None:
        raise UsageError("--speculative model needs --draft-model DIR")
    if args.speculative == "off":
        return None
    from k3serve.engine.speculative import SpeculativeConfig

    return SpeculativeConfig(drafter=args.speculative, rollback=args.rollback,
                             num_draft_tokens=args.num_draft_tokens, adaptive=not args.no_adaptive_draft,
                             io_aware=args.speculative_io_aware)


def _drafters(args: argparse.Namespace, config, target):
    """The DrafterFactory for `config` (None when speculation is off); loads --draft-model."""
    if config is None:
        return None
    from k3serve.engine.speculative import DrafterFactory
    from k3serve.loading import load_model

    draft_model = load_model(args.draft_model).model if args.draft_model is not None else None
    return DrafterFactory(target, draft_model)


def _add_wait_policy_arg(parser: argparse.ArgumentParser) -> None:
    from k3serve.threads import WAIT_POLICIES

    parser.add_argument("--wait-policy", choices=WAIT_POLICIES, default=None,
                        help="how the kernels' threads wait between parallel regions: adaptive (the default: workers "
                             "sleep, idle-class core keepers spin while forwards run, yielding to any other job), "
                             "passive (workers sleep; no keepers), active (workers spin); overrides "
                             "K3SERVE_WAIT_POLICY, OMP_WAIT_POLICY and GOMP_SPINCOUNT (k3serve/threads.py)")
    parser.add_argument("--mxfp4-activations", choices=("f32", "q8"), default=None,
                        help="K3's routed MXFP4 experts multiply float32 activations (f32, the default, the reference "
                             "bits) or Q8_0-quantized ones with int8 dot products (q8: llama.cpp's arithmetic; "
                             "1.4-1.9x faster expert kernels, logits within ~4e-3 relative RMS of f32; needs AVX2 or "
                             "AVX-512 VNNI; docs/BENCHMARKS.md)")
    parser.add_argument("--int8-activations", choices=("auto", "f32", "q8"), default=None,
                        help="the families' int8 experts multiply float32 activations (f32) or Q8_0-quantized ones "
                             "with int8 dot products (q8: llama.cpp's Q8_0 x Q8_0 arithmetic; needs AVX2 or AVX-512 "
                             "VNNI). auto, the default: a GGUF's Q8_0 experts on Q8_0 activations (as its Q8_0 trunk "
                             "matrices and llama.cpp), experts packed at --expert-precision int8 on float32 ones "
                             "(docs/BENCHMARKS.md)")
    parser.add_argument("--bf16-activations", choices=("f32", "bf16"), default=None,
                        help="bf16 weights (a bf16 checkpoint's trunk and experts) multiply float32 activations (f32, "
                             "the default, the reference bits) or activations rounded to bf16 with AVX512_BF16 dot "
                             "products (bf16: llama.cpp's arithmetic for BF16 matrices; "
                             "needs AVX512_BF16, else f32 with a warning; docs/BENCHMARKS.md)")


def apply_wait_policy(args: argparse.Namespace) -> None:
    """--wait-policy and the --*-activations flags into the environment, before the kernels are
    imported (they read it once, at import)."""
    import os

    from k3serve.threads import OPENMP_WAIT_VARIABLES, WAIT_POLICY_ENV

    policy, activations = getattr(args, "wait_policy", None), getattr(args, "mxfp4_activations", None)
    int8_activations = getattr(args, "int8_activations", None)
    bf16_activations = getattr(args, "bf16_activations", None)
    if policy is None and activations is None and int8_activations is None and bf16_activations is None:
        return
    if "k3serve.model.kernels" in sys.modules:
        logging.getLogger(__name__).warning("--wait-policy / --mxfp4-activations / --int8-activations / "
                                            "--bf16-activations: the kernels "
                                            "were already imported; not applied")
        return
    if policy is not None:
        for name in OPENMP_WAIT_VARIABLES:
            os.environ.pop(name, None)
        os.environ[WAIT_POLICY_ENV] = policy
    if activations is not None:
        os.environ["K3SERVE_MXFP4_ACTIVATIONS"] = activations
    if int8_activations is not None:
        os.environ["K3SERVE_INT8_ACTIVATIONS"] = int8_activations
    if bf16_activations is not None:
        os.environ["K3SERVE_BF16_ACTIVATIONS"] = bf16_activations


def _add_context_arg(parser: argparse.ArgumentParser) -> None:
    from k3serve.config import DEFAULT_MAX_MODEL_LEN

    parser.add_argument("--max-model-len", type=cli_args.positive_int, default=DEFAULT_MAX_MODEL_LEN,
                        help="prompt + generated tokens allowed, as for serve (longer prompts are refused)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="k3serve", description="CPU inference for Kimi K3-family MoE models")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    _add_model_arg(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=cli_args.token_ids, help="prompt as comma-separated token ids")
    prompt.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="prompt text read from FILE as it is (UTF-8), or from stdin with '-': contexts too long "
                             "for a command line")
    _add_precision_arg(gen)
    gen.add_argument("--max-tokens", type=positive_int, default=64, help="the most tokens to generate")
    gen.add_argument("--temperature", type=cli_args.float_range(0.0), default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=cli_args.float_range(0.0, 1.0, low_open=True), default=1.0,
                     help="nucleus sampling: keep the smallest set of tokens with this much probability")
    gen.add_argument("--top-k", type=cli_args.non_negative_int, default=0,
                     help="keep the k most likely tokens (0 = no limit)")
    gen.add_argument("--seed", type=cli_args.seed, default=None, help="sampling seed (default: unseeded)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence ids")
    gen.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token")
    gen.add_argument("--no-token-healing", action="store_true",
                     help="keep the prompt's last tokens as encoded (default: back off a tail that a longer token "
                          "starts with and let generation spell it out, e.g. '):' -> '):\\n'; composes with "
                          "--speculative: heal first, then speculate)")
    _add_speculative_args(gen)
    _add_context_arg(gen)
    _add_wait_policy_arg(gen)

    add_stream_args(gen)
    add_ram_controller_args(gen)
    add_routing_args(gen)

    logits = sub.add_parser("logits", help="write float32 logits for every position to a .npy file")
    _add_model_arg(logits)
    logits.add_argument("--ids", type=cli_args.token_ids, required=True, help="comma-separated token ids")
    logits.add_argument("--out", type=output_file, required=True, help="the .npy file to write")
    logits.add_argument("--mode", choices=("full", "incremental"), default="full",
                        help="one forward over all ids, or one forward per id")
    _add_context_arg(logits)
    _add_precision_arg(logits)
    add_stream_args(logits)
    add_routing_args(logits)

    tiny = sub.add_parser("make-tiny", help="write the tiny oracle checkpoint (K3_SPEC tiny shapes)")
    tiny.add_argument("out", type=cli_args.output_dir, help="folder to write (must not exist or be empty)")
    tiny.add_argument("--seed", type=cli_args.seed, default=0, help="random seed of the weights")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    _add_serve_args(serve)
    _add_precision_arg(serve)
    _add_wait_policy_arg(serve)
    lab_choice = serve.add_mutually_exclusive_group()
    lab_choice.add_argument("--lab", action="store_true",
                            help="mount the lab page at /lab on any address (default: only on a loopback --host; "
                                 "the lab has no authentication)")
    lab_choice.add_argument("--no-lab", action="store_true", help="do not mount the lab page at /lab")

    cluster = sub.add_parser("cluster", help="the server over N engine replicas on Ray, behind a router "
                                             "(docs/CLUSTER.md; needs the cluster extra)")
    _add_serve_args(cluster)
    add_cluster_args(cluster)

    STREAM_COMMANDS.update(add_subcommands(sub))  # pack, sim cache, coactivation
    LAB_COMMANDS.update(add_lab_command(sub))  # lab, lab run, lab list
    COMMANDS.update(add_tenants_command(sub))  # tenants hash-key, tenants check

    storage = sub.add_parser("spec-storage", help="rollback storage per sequence: snapshots vs projection cache")
    storage.add_argument("--max-window", type=cli_args.int_range(1, 64), default=8,
                         help="window sizes 1..N (positions per verify)")
    storage.add_argument("--json", action="store_true", help="print the JSON record instead of the table")

    info = sub.add_parser("info", help="describe a model: shapes, layer map, parameter counts, sizes")
    _add_model_arg(info)
    info.add_argument("--full-k3", action="store_true", help="describe the full Kimi K3 shapes instead")
    cli_args.add_verbose_everywhere(parser)
    return parser


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    """The options `serve` and `cluster` share: the model, the listener, the engine, speculation, streaming and
    tenants."""
    _add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--shutdown-timeout", type=positive_int, default=30,
                       help="seconds SIGTERM waits for in-flight requests before closing them; then exit 0")
    serve.add_argument("--port", type=cli_args.port, default=8000, help="TCP port to listen on")
    serve.add_argument("--served-model-name", type=cli_args.non_empty, default=None,
                       help="the model id clients send (default: folder name)")
    serve.add_argument("--max-batch-tokens", type=positive_int, default=2048, help="tokens per forward step")
    serve.add_argument("--max-seqs", type=positive_int, default=64, help="sequences running at once")
    serve.add_argument("--max-decode-seqs", type=positive_int, default=None,
                       help="decodes per forward (default: every running one the token budget allows); running "
                            "sequences beyond it hold their memory and wait a step")
    serve.add_argument("--batch-by-experts", action="store_true",
                       help="among more ready decodes than --max-decode-seqs (which it needs), run those whose previous step's experts overlap most (fewer expert reads when "
                            "streaming; a decode the default order would run waits at most "
                            "--batch-by-experts-max-wait steps in a row)")
    serve.add_argument("--batch-by-experts-max-wait", type=cli_args.non_negative_int, default=4,
                       help="steps in a row --batch-by-experts may pass over a decode the default order would run")
    serve.add_argument("--max-model-len", type=positive_int, default=4096,
                       help="prompt + generated tokens per sequence")
    serve.add_argument("--block-size", type=positive_int, default=16, help="positions per paged MLA cache block")
    serve.add_argument("--kv-cache-mib", type=positive_int, default=256, help="memory for the paged MLA cache")
    serve.add_argument("--no-prefix-cache", action="store_true", help="disable the hybrid prefix cache")
    serve.add_argument("--prefix-cache-policy", choices=PREFIX_CACHE_POLICIES, default="slru",
                       help="which KDA state checkpoints the prefix cache evicts first: slru keeps those that "
                            "recur (a shared system prompt) from being displaced by one-shot prompt and reply ends; "
                            "lru is plain least recently used")
    serve.add_argument("--state-checkpoints", type=cli_args.non_negative_int, default=64,
                       help="recurrent-state checkpoints the prefix cache may hold (each is one copy of every "
                            "recurrent layer's state; 0 keeps attention blocks only, so hybrid prompts never hit)")
    serve.add_argument("--checkpoint-every-blocks", type=cli_args.non_negative_int, default=0,
                       help="also checkpoint the recurrent state every N full cache blocks of a prefill, so a "
                            "later prompt that shares only part of it can still hit (0: only at a prompt's and a "
                            "reply's end)")
    serve.add_argument("--prefix-cache-dir", type=Path, default=None, metavar="DIR",
                       help="the prefix cache's disk tier: checkpoints that leave RAM are written to this folder "
                            "(on NVMe) and restored by a later hit instead of recomputed; a restart on the same "
                            "folder and model hits them (needs --prefix-cache-disk; default: none, RAM only)")
    serve.add_argument("--prefix-cache-disk", type=cli_args.size, default=None, metavar="SIZE",
                       help="the disk tier's size, e.g. 64G (binary units; default: none, no disk tier)")
    serve.add_argument("--prefix-wait-tokens", type=cli_args.non_negative_int, default=32,
                       help="a queued request whose prompt shares at least this many more tokens with a running "
                            "request of the same tenant than the prefix cache holds waits until that one has "
                            "computed them, then hits there (in-flight prefix sharing; 0: never wait)")
    serve.add_argument("--default-max-tokens", type=positive_int, default=1024,
                       help="tokens a chat request without max_tokens may generate at most")
    _add_speculative_args(serve)
    add_stream_args(serve)
    add_ram_controller_args(serve)
    add_routing_args(serve)
    add_tenant_args(serve)


def cmd_generate(args: argparse.Namespace) -> int:
    from k3serve.engine.generate import generate
    from k3serve.engine.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    speculative = _speculative_config(args)  # every argument is checked before the model loads
    check_ram_controller_args(args)
    prompt_text = args.prompt if args.prompt_file is None else _read_prompt_file(args.prompt_file)
    loaded = load_for_run(args, expert_precision=args.expert_precision, trunk_precision=args.trunk_precision)
    try:
        return _generate_loaded(args, loaded, params, speculative, prompt_text)
    finally:
        if loaded.model.experts is not None:
            loaded.model.experts.close()  # a --trace-out trace is whole under its name from here (stream/trace.py)


def _generate_loaded(args: argparse.Namespace, loaded, params, speculative, prompt_text: str) -> int:
    from k3serve.engine.generate import generate

    drafters = _drafters(args, speculative, loaded.model)
    if args.prompt_ids is not None:
        _check_ids(args.prompt_ids, loaded.model.config.vocab_size, "--prompt-ids")
        tokens, report = generate(loaded.model, args.prompt_ids, params, stop_ids=loaded.stop_ids,
                                  speculative=speculative, drafters=drafters, max_context=args.max_model_len,
                                  prepare=lambda engine: attach_from_args(engine, args))
        print(",".join(str(t) for t in tokens))
        _print_report(loaded, report)
        return 0
    if loaded.tokenizer is None:
        raise K3Error(f"{loaded.path} has no tokenizer (tiktoken.model or tokenizer.json); pass --prompt-ids instead")
    tokenizer = loaded.tokenizer
    prompt_ids = tokenizer.encode(prompt_text)
    if not args.no_bos and tokenizer.bos_id is not None:
        prompt_ids = [tokenizer.bos_id] + prompt_ids
    healing = None
    if not args.no_token_healing:  # speculation composes: the healed tail is spelled out, then drafts start
        from k3serve.engine.healing import heal_prompt

        healing = heal_prompt(tokenizer, prompt_ids)
    decoder = tokenizer.stream_decoder()
    stops = set(loaded.stop_ids)
    skip = [healing.visible_skip() if healing else 0]  # the healed tail is part of the prompt: not printed again

    def emit(token: int) -> None:
        if token in stops:
            return
        text = decoder.add(token)
        if skip[0] and text:
            cut = min(skip[0], len(text))
            text, skip[0] = text[cut:], skip[0] - cut
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    _, report = generate(loaded.model, healing.prompt_ids if healing else prompt_ids, params,
                         stop_ids=loaded.stop_ids, on_token=emit, speculative=speculative, drafters=drafters,
                         constraint=healing.allowed if healing else None, max_context=args.max_model_len,
                         prepare=lambda engine: attach_from_args(engine, args))
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()
    _print_report(loaded, report)
    return 0


def _read_prompt_file(path: Path) -> str:
    """--prompt-file: the file's text as it is, or stdin for '-'; an unreadable or non-UTF-8 file names itself."""
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as exc:
        raise UsageError(f"--prompt-file {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = "stdin" if str(path) == "-" else str(path)
        raise UsageError(f"--prompt-file {where} is not UTF-8 text (byte {exc.start})") from None


def _check_ids(ids: list[int], vocab_size: int, flag: str) -> None:
    """Refuse the first id outside the model's vocabulary, naming it, its place and the flag."""
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise UsageError(f"{flag}: token id {token} (number {position + 1} in the list) is out of range: this "
                             f"model's vocabulary is 0..{vocab_size - 1}")


def _print_report(loaded, report) -> None:
    print(f"--- run report ({loaded.name})", file=sys.stderr)
    for line in report.lines():
        print(line, file=sys.stderr)


def cmd_logits(args: argparse.Namespace) -> int:
    loaded = load_for_run(args, expert_precision=args.expert_precision, trunk_precision=args.trunk_precision)
    _check_ids(args.ids, loaded.model.config.vocab_size, "--ids")
    logits = loaded.model.logits(args.ids, mode=args.mode, max_context=args.max_model_len)  # [T, V]
    from k3serve.atomic_file import atomic_output

    with atomic_output(args.out) as staging, open(staging, "wb") as file:  # whole or absent, never 0 bytes
        np.save(file, logits.astype(np.float32))
    print(f"wrote {args.out}: float32 {list(logits.shape)} ({args.mode})", file=sys.stderr)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from k3serve.config import tiny_config
    from k3serve.weights.synthetic import write_random_checkpoint

    if args.out.exists() and any(args.out.iterdir()):
        raise UsageError(f"{args.out} is not empty; make-tiny writes a new checkpoint into an empty or new folder")
    config = tiny_config()
    write_random_checkpoint(config, args.out, seed=args.seed, max_shard_bytes=1 << 20)
    print(f"wrote the tiny oracle ({config.layer_map}, {config.num_experts} experts, top-"
          f"{config.num_experts_per_token}) to {args.out}", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from k3serve.config import full_k3_config, load_config
    from k3serve.loading import default_model_dir

    from k3serve.loading.registry import K3, of_folder
    from k3serve.model.families import read_family_config

    if args.full_k3 and args.model is not None:
        raise UsageError("--full-k3 describes the built-in full Kimi K3 shapes: leave out --model (or leave out "
                         "--full-k3 to describe that checkpoint)")
    if args.model is not None and of_folder(args.model) is not K3:
        print(json.dumps(read_family_config(args.model).summary(), indent=2))
        return 0
    config = full_k3_config() if args.full_k3 else load_config(args.model or default_model_dir())
    counts = config.num_parameters()
    num_moe = len(config.moe_layer_ids)
    summary = {
        "layer_map": config.layer_map,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "experts_per_layer": config.num_experts,
        "active_experts": config.num_experts_per_token,
        "parameters": counts,
        "expert_bytes": config.expert_bytes,
        "expert_store_bytes": config.expert_bytes * config.num_experts * num_moe,
        "expert_bytes_per_token": config.expert_bytes * config.num_experts_per_token * num_moe,
        "mla_cache_values_per_position_per_layer": config.mla_cache_width,
    }
    print(json.dumps(summary, indent=2))
    return 0


def _engine_config(args: argparse.Namespace):
    from k3serve.engine.config import EngineConfig

    if args.step_interruption == "on" and args.scheduling == "fcfs":
        raise UsageError("--step-interruption pauses a forward for a tenant ranked ahead, and --scheduling fcfs "
                         "ranks no tenant ahead: use --scheduling fair or priority, or leave out --step-interruption")
    if args.charge == "io" and args.scheduling == "fcfs":
        raise UsageError("--charge io advances the tenants' virtual counters, which --scheduling fcfs does not rank "
                         "by: use --scheduling fair or priority")
    if args.defer_io_heavy and args.charge != "io":
        raise UsageError("--defer-io-heavy separates tenants by the disk reads --charge io measures: add --charge io")
    if (args.prefix_cache_dir is None) != (args.prefix_cache_disk is None):
        raise UsageError("--prefix-cache-dir and --prefix-cache-disk go together: the folder of the prefix cache's "
                         "disk tier and its size")
    if args.prefix_cache_dir is not None and args.no_prefix_cache:
        raise UsageError("--prefix-cache-dir is the prefix cache's disk tier: drop it or --no-prefix-cache")
    return EngineConfig(block_size=args.block_size, kv_cache_bytes=args.kv_cache_mib << 20,
                        max_batch_tokens=args.max_batch_tokens, max_seqs=args.max_seqs,
                        max_decode_seqs=args.max_decode_seqs, batch_by_experts=args.batch_by_experts,
                        batch_by_experts_max_wait=args.batch_by_experts_max_wait,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_cache,
                        prefix_cache_policy=args.prefix_cache_policy, num_state_checkpoints=args.state_checkpoints,
                        checkpoint_every_blocks=args.checkpoint_every_blocks,
                        prefix_wait_tokens=args.prefix_wait_tokens, scheduling=args.scheduling,
                        output_cost=args.output_cost, charge=args.charge, io_cost=args.io_cost,
                        tenant_cache_shares=args.tenant_cache_shares, defer_io_heavy=args.defer_io_heavy,
                        io_heavy_step_tokens=args.io_heavy_step_tokens,
                        prefix_cache_dir=None if args.prefix_cache_dir is None else str(args.prefix_cache_dir),
                        prefix_cache_disk_bytes=0 if args.prefix_cache_disk is None else parse_size(
                            args.prefix_cache_disk),
                        step_interruption={"on": True, "off": False}.get(args.step_interruption, "auto"))


def cmd_cluster(args: argparse.Namespace) -> int:
    """`serve` over replicas on Ray (k3serve.cluster): every argument is checked before Ray or a model starts."""
    from k3serve.cli.tenants import install_reload, registry_for_serve, warn_if_open

    config = _engine_config(args)
    check_ram_controller_args(args)
    if config.prefix_cache_dir is not None:
        raise UsageError("--prefix-cache-dir is not offered by `cluster` yet (replicas would share one folder): "
                         "use it with `serve`")
    speculative = _speculative_config(args)
    tenants = registry_for_serve(args)
    listener = cli_args.bind_listener(args.host, args.port)
    warn_if_open(tenants, args.host)
    return run_cluster(args, config, speculative, tenants, listener, install_reload,
                       serve=lambda app: _serve_until_sigterm(_uvicorn_server(app, args), listener))


def cmd_serve(args: argparse.Namespace) -> int:

    from k3serve.engine.engine import LLMEngine
    from k3serve.serve.api import create_app
    from k3serve.cli.tenants import install_reload, is_loopback, registry_for_serve, warn_if_open

    config = _engine_config(args)
    speculative = _speculative_config(args)
    check_ram_controller_args(args)
    tenants = registry_for_serve(args)  # a bad tenants file fails here, before the model loads
    listener = cli_args.bind_listener(args.host, args.port)  # a busy port fails here: before loading, before "serving"
    # the lab has no keys: never beside an API that requires them, and beyond loopback only when asked for
    mount_lab_page = not args.no_lab and tenants.open and (args.lab or is_loopback(args.host))
    warn_if_open(tenants, args.host, lab_mounted=mount_lab_page)
    # resident, or streamed from a packed store under --ram-budget; beside the lab, a resident K3 checkpoint's
    # weights go to read-only shared pages, which the lab's worker maps instead of loading a second copy
    # (a trunk quantized at load is not shared: `load_model` leaves it private and the lab's worker loads its own)
    loaded = load_for_run(args, share_weights=mount_lab_page, expert_precision=args.expert_precision,
                          trunk_precision=args.trunk_precision)
    if loaded.tokenizer is None:
        raise K3Error(f"{loaded.path} has no usable tokenizer (tiktoken.model or tokenizer.json): the server needs "
                      "one")
    if config.step_interruption is True and not loaded.model.supports_nested_forward:
        raise UsageError("--step-interruption needs a model whose weights allow a forward inside another: resident "
                         "K3 weights (no --ram-budget or other streaming flag, no --trace-out, not a family model)")
    engine = LLMEngine(loaded.model, config, stop_ids=loaded.stop_ids, speculative=speculative,
                       drafters=_drafters(args, speculative, loaded.model),
                       model_identity=loaded.identity if config.prefix_cache_dir is not None else None)
    if speculative is not None:
        engine.drafters.check(speculative)  # e.g. the resident drafter on a family model: refuse at start
    controller = attach_from_args(engine, args)
    if controller is not None:
        print(f"k3serve: {controller.lines()[0].strip()}", file=sys.stderr)
    name = args.served_model_name or loaded.name
    print(f"k3serve: serving '{name}' on http://{args.host}:{args.port}/v1", file=sys.stderr)
    tenants.on_reload = lambda config: engine.set_tenant_shares(config.shares())
    install_reload(tenants)
    app = create_app(engine, loaded.tokenizer, name, default_max_tokens=args.default_max_tokens, tenants=tenants)
    if not args.no_lab and not tenants.open:
        print("k3serve: the lab is not mounted on a server with --tenants (it has no authentication); run "
              "`k3serve lab` on loopback instead", file=sys.stderr)
    elif not args.no_lab and not mount_lab_page:
        print(f"k3serve: the lab is not mounted on {args.host} (it has no authentication; pass --lab to mount it "
              "there, or run `k3serve lab` on loopback)", file=sys.stderr)
    elif mount_lab_page:  # the lab page beside the API, on its own run queue (k3serve.lab)
        from k3serve.lab.api import mount_lab
        from k3serve.lab.fixtures import LabFixtures

        lab_model = _lab_model(args.model, loaded)
        # shared weights exist only for a resident K3 folder, which is then the lab's model too; a streamed,
        # GGUF or family model is not the lab's, whose worker loads its own (small) copy as before
        mount_lab(app, LabFixtures(lab_model, shared_weights=loaded.shared_weights))
        print(f"k3serve: the lab is on http://{args.host}:{args.port}/lab/", file=sys.stderr)
    _serve_until_sigterm(_uvicorn_server(app, args), listener)
    return 0


def _lab_model(model: str | Path | None, loaded) -> str | Path | None:
    """The lab's model beside `serve`: the served one when it is a K3 checkpoint folder (the lab's fixtures are K3
    folders: routing traces, packed and widened stores); anything else (a family, a packed store, a GGUF file): the
    embedded default (None)."""
    from k3serve.weights.store import is_packed_store

    if model is None or not loaded.architecture.routing_traces or not Path(model).is_dir() or is_packed_store(model):
        return None
    return model


def _uvicorn_server(app, args: argparse.Namespace):
    import uvicorn

    from k3serve.serve.shutdown import DrainingServer

    return DrainingServer(uvicorn.Config(app, log_level="warning"), args.shutdown_timeout,
                          app.state.k3.cut_open_requests)


def _serve_until_sigterm(server, listener) -> None:
    """Run uvicorn. On SIGTERM or Ctrl-C it closes the listener (no new requests), lets in-flight requests
    finish for up to --shutdown-timeout seconds, then stops the engine, and the command exits 0; a second signal
    exits at once with one line (cli/interrupts.py)."""
    from k3serve.cli.interrupts import serve_until_signal

    serve_until_signal(server, [listener])
    cut = server.num_cut
    outcome = f"cut {cut} stream(s) at --shutdown-timeout" if cut else "in-flight requests drained"
    print(f"k3serve: shut down ({outcome})", file=sys.stderr)



def cmd_spec_storage(args: argparse.Namespace) -> int:
    from k3serve.cli.spec_storage import storage_report

    lines, record = storage_report(args.max_window)
    print(json.dumps(record, indent=2) if args.json else "\n".join(lines))
    return 0


STREAM_COMMANDS: dict = {}  # pack, sim, coactivation (k3serve.cli.stream)
LAB_COMMANDS: dict = {}  # lab (k3serve.cli.lab)
COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "cluster": cmd_cluster, "logits": cmd_logits, "make-tiny": cmd_make_tiny,
            "info": cmd_info, "spec-storage": cmd_spec_storage}


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every error the user can cause ends as one `k3serve: error:` line and the exit code of
    `errors.exit_code` (2; 130 for Ctrl-C, 143 for SIGTERM, 0 for a server that drained); an unexpected one (a
    bug) keeps its traceback."""
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        apply_wait_policy(args)
        with interrupts.policy():  # the first SIGINT/SIGTERM stops or drains, the second exits at once
            return {**COMMANDS, **STREAM_COMMANDS, **LAB_COMMANDS}[args.command](args)
    except BrokenPipeError:
        return 0
    except (K3Error, OSError, KeyboardInterrupt) as exc:
        code = exit_code(exc)
        assert code is not None
        sys.stdout.flush()
        print(f"k3serve: error: {user_message(exc, cli=True)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
