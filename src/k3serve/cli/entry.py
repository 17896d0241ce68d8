"""The `k3serve` script's entry point: the interrupt policy's first handler goes in before the heavy imports
(numpy, the model code), so a Ctrl-C in the first instants is one line too, never an import traceback."""

from __future__ import annotations


def main() -> int:
    from k3serve.cli.interrupts import install_early

    install_early()
    from k3serve.cli.main import main as run

    return run()
