"""The command-line side of tenants: `serve --tenants FILE --scheduling ... --step-interruption`, `k3serve tenants
hash-key` and `k3serve tenants check FILE`, the warning for an open server on a non-loopback address, and reload on
SIGHUP."""

from __future__ import annotations

import argparse
import getpass
import ipaddress
import logging
import signal
import sys
import threading
from pathlib import Path

from k3serve.cli.args import float_range
from k3serve.engine.fairness import DEFAULT_OUTPUT_COST, SCHEDULING_POLICIES
from k3serve.errors import UsageError
from k3serve.serve.tenants import TenantRegistry, hash_key, load_tenants

logger = logging.getLogger(__name__)


def add_tenant_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tenants (budget isolation)")
    group.add_argument("--tenants", type=Path, default=None,
                       help="TOML file of tenants, API key hashes and quotas; reloaded on SIGHUP (default: open, "
                            "every key accepted)")
    group.add_argument("--scheduling", choices=SCHEDULING_POLICIES, default="fair",
                       help="between tenants: first come first served, fair (virtual token counter) or priority")
    group.add_argument("--output-cost", type=float_range(0.0), default=DEFAULT_OUTPUT_COST,
                       help="fair scheduling: an output token's charge relative to a prompt token")
    group.add_argument("--charge", choices=("tokens", "io"), default="tokens",
                       help="fair/priority: what advances a tenant's virtual counter: its tokens, or its tokens and "
                            "the seconds the engine waited on disk reads for its requests (each its share of a "
                            "step's tokens); under a RAM budget, a tenant whose prompts miss the expert cache then "
                            "pays for the reads it causes")
    group.add_argument("--io-cost", type=float_range(0.0), default=1000.0,
                       help="--charge io: tokens one second of waiting on the disk costs")
    group.add_argument("--tenant-cache-shares", action="store_true",
                       help="under --ram-budget: each tenant with work (or with work in the last 10 s) owns a share "
                            "of the expert cache by its weight; its misses evict its own experts once it holds its "
                            "share, so a tenant whose prompts miss never evicts another's experts within that "
                            "one's share")
    group.add_argument("--defer-io-heavy", action="store_true",
                       help="--charge io: a tenant whose recent expert misses are far above another's runs in steps "
                            "of its own (each waits at most one step in a row), kept to --io-heavy-step-tokens "
                            "positions while a light tenant is around; with --tenant-cache-shares, heavy means at "
                            "its share and still missing")
    group.add_argument("--io-heavy-step-tokens", type=int, default=32,
                       help="--defer-io-heavy: positions a step of I/O-heavy tenants only may compute while a light "
                            "tenant is around (the step a light tenant's arrival waits for)")
    group.add_argument("--step-interruption", nargs="?", const="on", choices=("auto", "on", "off"), default="auto",
                       help="fair/priority: a forward pauses after a layer's attention or MLP to run an arriving "
                            "request of a tenant ranked ahead first (shorter first-token waits for light tenants; "
                            "resident K3 weights only). auto: on under fair and priority when the model allows it")


def add_tenants_command(sub) -> dict:
    tenants = sub.add_parser("tenants", help="tenants files: hash an API key, check a file")
    actions = tenants.add_subparsers(dest="tenants_command", required=True)
    hashing = actions.add_parser("hash-key", help="print the sha256:<hex> form of an API key for a tenants file")
    hashing.add_argument("key", nargs="?", default=None,
                         help="the key (default: read from stdin, or asked for without echo on a terminal)")
    check = actions.add_parser("check", help="validate a tenants file (exit 2 with the first error)")
    check.add_argument("file", type=Path, help="the tenants file (TOML)")
    return {"tenants": cmd_tenants}


def cmd_tenants(args: argparse.Namespace) -> int:
    if args.tenants_command == "hash-key":
        key = args.key
        if key is None:
            key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
        if not key:
            raise UsageError("the API key is empty")
        print(hash_key(key))
        return 0
    config = load_tenants(args.file)
    names = ", ".join(t.name for t in config.tenants)
    print(f"{args.file}: {len(config.tenants)} tenant(s): {names}")
    return 0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def registry_for_serve(args: argparse.Namespace) -> TenantRegistry:
    """The tenants the server starts with (a bad file raises here, before the model loads)."""
    return TenantRegistry() if args.tenants is None else TenantRegistry.from_file(args.tenants)


def warn_if_open(registry: TenantRegistry, host: str, lab_mounted: bool = False) -> None:
    """An open server (no tenants file) on an address beyond loopback accepts anyone: say so, and say that the
    lab (`serve --lab`) is open too: anyone can queue its runs, which take the machine's CPU for minutes."""
    if registry.open and not is_loopback(host):
        lab = (" and the lab at /lab runs anyone's jobs (it has no authentication)" if lab_mounted else "")
        print(f"k3serve: warning: serving on {host} without --tenants: every client is accepted and no quota "
              f"applies{lab}", file=sys.stderr)


def install_reload(registry: TenantRegistry) -> None:
    """Reload the tenants file on SIGHUP (on a thread: the signal handler only starts it). In-flight requests
    carry on; a bad file is refused and logged, and the old configuration stays."""
    if registry.path is None or not hasattr(signal, "SIGHUP"):
        return

    def on_hangup(signum, frame) -> None:
        threading.Thread(target=registry.reload, name="k3serve-tenants-reload", daemon=True).start()

    signal.signal(signal.SIGHUP, on_hangup)
