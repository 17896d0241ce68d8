"""Byte sizes as people write them ('8G', '512MiB', '1.5GB') and as reports print them: a leaf module that the
command line, the streaming budget, the simulator and the benchmarks share."""

from __future__ import annotations

import re

from k3serve.errors import K3Error

# K/M/G/T alone are binary units (as `--ram-budget 8G` means 8 GiB); KB/MB/GB/TB are decimal.
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


class SizeError(K3Error):
    """A size that could not be read."""


def parse_size(text: str | int) -> int:
    """'8G', '512MiB', '1.5GB', '1048576' -> bytes (K/M/G/T alone are binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise SizeError(f"cannot read size {text!r}; write e.g. 8G, 512M, 1.5GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Bytes in the largest binary unit that leaves at least 1 (two decimals), e.g. '7.45 GiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"
