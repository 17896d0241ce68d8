"""`k3serve lab` (serve the page) and `k3serve lab run MODULE --param k=v [--json FILE]` (one module from a shell,
the command every figure on the page names), `k3serve lab run --all [--json FILE]` (every module at its defaults,
written as the stored runs the page's overview shows), `k3serve lab list` (the modules and their parameters)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from k3serve.atomic_file import write_text
from k3serve.cli import args as cli_args
from k3serve.errors import K3Error, UsageError


def add_lab_command(sub) -> dict:
    lab = sub.add_parser("lab", help="the lab: every mechanism as a module with parameters and a measured "
                                     "before/after, in the browser (docs/LAB.md)")
    lab.add_argument("--host", default="127.0.0.1", help="address to listen on")
    lab.add_argument("--port", type=cli_args.port, default=8100, help="TCP port to listen on")
    lab.add_argument("--model", type=cli_args.model_path, default=None,
                     help="K3 checkpoint folder (default: the embedded model)")
    lab_sub = lab.add_subparsers(dest="lab_command")
    run = lab_sub.add_parser("run", help="run one module from the shell and print its figures")
    run.add_argument("module", nargs="?", default=None, help="module id (see `k3serve lab list`)")
    run.add_argument("--all", action="store_true", dest="run_all",
                     help="run every module at its defaults and write the stored runs the page's overview shows "
                          "(to --json FILE, default: the package's lab/web/stored_runs.json)")
    run.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a parameter (repeatable)")
    run.add_argument("--model", type=cli_args.model_path, default=None, dest="run_model",
                     help="K3 checkpoint folder (default: the embedded model)")
    run.add_argument("--json", type=cli_args.output_file, default=None,
                     help="also write the full result record as JSON (default: none; with --all, the stored runs)")
    lab_sub.add_parser("list", help="the modules, their parameters and defaults")
    return {"lab": cmd_lab}


def _parse_params(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise K3Error(f"--param takes NAME=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _number(value: float) -> str:
    """A bound as a person reads it: integers whole (131072, 2147483647), other numbers short (0.15)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _range(p) -> str:
    """`min..max`, an open end as `>= min` / `<= max`, or the type when neither is set."""
    if p.min is not None and p.max is not None:
        return f"{_number(p.min)}..{_number(p.max)}"
    if p.min is not None:
        return f">= {_number(p.min)}"
    if p.max is not None:
        return f"<= {_number(p.max)}"
    return p.type


def _format(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
        return f"{value:.4g}"
    return f"{value:,.4g}"


def _run_all(args: argparse.Namespace) -> int:
    """Every module at its defaults, one after another in this process; the records go to the stored-runs file."""
    from k3serve.lab.fixtures import LabFixtures
    from k3serve.lab.overview import RUN_ALL_COMMAND, STORED_RUNS_PATH, clean, stored_runs_json
    from k3serve.lab.registry import CancelToken, modules, result_json

    if args.module is not None or args.param:
        raise UsageError("lab run --all runs every module at its defaults: give no module and no --param")
    fixtures = LabFixtures(args.run_model)
    records = {}
    started_all = time.perf_counter()
    for module in modules().values():
        params = module.validate({}, fixtures)

        def progress(fraction: float, message: str, module_id: str = module.id) -> None:
            print(f"[{module_id} {100 * fraction:5.1f}%] {message}", file=sys.stderr)

        started = time.perf_counter()
        result = module.run(params, progress, CancelToken(), fixtures)
        record = result_json(module, params, result, time.perf_counter() - started, fixtures.model_arg)
        records[module.id] = record
        sentence = record["verdict"]["sentence"] if record["verdict"] else "(no verdict)"
        print(f"{module.number:>2}. {module.id:<16} {record['seconds']:6.1f} s  {sentence}")
    command = RUN_ALL_COMMAND + (f" --model {args.run_model}" if args.run_model else "")
    target = args.json or STORED_RUNS_PATH
    stored = stored_runs_json(records, command, fixtures.model_arg)
    write_text(target, json.dumps(clean(stored), indent=1, allow_nan=False) + "\n")
    print(f"{len(records)} modules in {time.perf_counter() - started_all:.1f} s; stored runs written to {target}")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from k3serve.lab.fixtures import LabFixtures
    from k3serve.lab.registry import get_module, modules

    if args.lab_command == "list":
        lab = LabFixtures(args.model)  # the ranges its model sets (module.limits): reads config.json only
        for module in modules().values():
            print(f"{module.number:>2}. {module.id:<18} {module.title} [{module.kind}]")
            for p in module.params_for(lab):
                extra = f"one of {', '.join(p.choices)}" if p.choices else _range(p)
                print(f"      {p.name}={p.default}  ({extra}{' ' + p.unit if p.unit else ''}) {p.help}")
        return 0
    if args.lab_command == "run" and args.run_all:
        return _run_all(args)
    if args.lab_command == "run":
        from k3serve.lab.registry import CancelToken, result_json

        if args.module is None:
            raise UsageError("lab run needs a module id (see `k3serve lab list`), or --all")
        module = get_module(args.module)
        params = module.validate(_parse_params(args.param))
        fixtures = LabFixtures(args.run_model)

        def progress(fraction: float, message: str) -> None:
            print(f"[{100 * fraction:5.1f}%] {message}", file=sys.stderr)

        started = time.perf_counter()
        result = module.run(params, progress, CancelToken(), fixtures)
        record = result_json(module, params, result, time.perf_counter() - started, fixtures.model_arg)
        print(f"{module.number}. {module.title}  ({record['seconds']:.1f} s)")
        print(f"{'metric':<48} {record['metrics_name'][:24]:>24} {record['baseline_name'][:24]:>24}")
        for key, value in record["metrics"].items():
            label = record["labels"].get(key, key)
            print(f"{label[:48]:<48} {_format(value):>24} {_format(record['baseline'].get(key)):>24}")
        for figure in record["series"]:
            print(f"figure: {figure['title']} [{figure['mark']}: {figure['source']}]")
        for note in record["notes"]:
            print(f"note: {note}")
        if record["verdict"]:
            print(f"verdict: {record['verdict']['sentence']}")
        print(f"command: {record['command']}")
        if args.json:
            write_text(args.json, json.dumps(record, indent=1) + "\n")
        return 0

    import uvicorn

    from k3serve.cli.interrupts import serve_until_signal
    from k3serve.lab.api import create_lab_app

    if args.model is not None:  # every module needs the tokenizer: refuse a checkpoint without one at start
        from k3serve.loading import load_model

        if load_model(args.model).tokenizer is None:
            raise UsageError(f"--model {args.model} has no tokenizer (tiktoken.model or tokenizer.json): every lab "
                             "module encodes text, so the lab needs a checkpoint with one")
    listener = cli_args.bind_listener(args.host, args.port)  # a busy port fails before the announcement
    fixtures = LabFixtures(args.model)
    print(f"k3serve: the lab is on http://{args.host}:{args.port}/lab/ ({len(modules())} modules)", file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(create_lab_app(fixtures), log_level="warning"))
    serve_until_signal(server, [listener])  # SIGTERM or Ctrl-C: drain and exit 0; a second: exit at once
    print("k3serve: the lab shut down", file=sys.stderr)
    return 0
