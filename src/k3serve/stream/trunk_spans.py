"""Where a trunk held as views reads from: the 4 KiB-aligned spans of trunk.bin that the streaming source reads
into its staging ring (stream/source.py), the budget splitter sizes (stream/budget.py) and the simulator replays
(sim/full.py), computed once here so the three agree byte for byte.

- A streamed layer is one piece (its whole blob), except a dense layer, which is three: everything before its
  MLP (norms and attention), the fused gate and up (adjacent since store format 2), the down projection. The
  model computes the MLP piece by piece (`DenseMLPPieces`), so the staging buffer holds the largest piece, not
  the largest layer (the full K3's layer 0 is 2.18 GiB; its largest piece 0.9 GiB, under an MoE layer's 1.18).
- A streamed lm_head is read in row chunks that fit the staging buffer; each chunk is multiplied as read.
- Embedding rows are read on demand, one row per token, exactly their bytes (no span).

Offsets inside a blob are those of its index (`TensorEntry`); a span's `skip` is where the wanted bytes start.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from k3serve.weights.store import ALIGNMENT, align_up

MLP_GATE, MLP_UP, MLP_DOWN = "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj."


class Span(NamedTuple):
    start: int  # file offset, 4 KiB-aligned
    length: int  # read length, a multiple of 4 KiB
    skip: int  # bytes from `start` to the first wanted byte


def span(offset: int, nbytes: int) -> Span:
    start = offset // ALIGNMENT * ALIGNMENT
    return Span(start, align_up(offset + nbytes) - start, offset - start)


class Entry(NamedTuple):
    name: str
    offset: int  # bytes into the blob
    nbytes: int


def layer_pieces(entries: Sequence[Entry], size: int) -> list[tuple[int, int]]:
    """[start, end) byte ranges of one layer blob, read one at a time: the whole blob, or for a dense layer
    (gate, up, down present, gate and up adjacent, the MLP last) the part before the MLP, gate+up, and down. The
    pieces tile the blob, so a running CRC-32 over them checks the blob's."""
    find = {key: next((e for e in entries if key in e.name), None) for key in (MLP_GATE, MLP_UP, MLP_DOWN)}
    gate, up, down = find[MLP_GATE], find[MLP_UP], find[MLP_DOWN]
    if gate is None or up is None or down is None or up.offset != gate.offset + gate.nbytes:
        return [(0, size)]
    rest = [e for e in entries if e not in (gate, up, down)]
    if any(e.offset >= gate.offset for e in rest) or down.offset < up.offset:
        return [(0, size)]  # not the version-2 order: read whole
    return [(0, gate.offset), (gate.offset, down.offset), (down.offset, size)]


def piece_spans(blob_offset: int, entries: Sequence[Entry], size: int) -> list[Span]:
    return [span(blob_offset + start, end - start) for start, end in layer_pieces(entries, size)]


def head_rows_per_chunk(row_bytes: int, staging_bytes: int) -> int:
    """lm_head rows per chunk so that any chunk's span fits `staging_bytes` (a span adds < 2 x 4 KiB)."""
    return max(0, (staging_bytes - 2 * ALIGNMENT) // row_bytes)


def head_min_staging(row_bytes: int) -> int:
    """The smallest staging buffer that reads one lm_head row per chunk."""
    return align_up(row_bytes) + 2 * ALIGNMENT


def head_chunks(head_offset: int, rows: int, row_bytes: int, staging_bytes: int) -> list[tuple[int, int, Span]]:
    """(first row, end row, span) of each lm_head chunk; `head_offset` is the tensor's file offset."""
    per = head_rows_per_chunk(row_bytes, staging_bytes)
    if per < 1:
        raise ValueError(f"a staging buffer of {staging_bytes} bytes cannot hold one lm_head row of {row_bytes}")
    return [(r, min(rows, r + per), span(head_offset + r * row_bytes, (min(rows, r + per) - r) * row_bytes))
            for r in range(0, rows, per)]
