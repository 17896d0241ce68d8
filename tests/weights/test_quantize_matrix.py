"""`quantize_matrix`: a trunk matrix quantized at load (`--trunk-precision`), a bounded number of rows widened at a
time, gives the bytes of quantizing the whole float32 matrix at once."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.weights.quantized import QuantizedMatrix, check_load_trunk_precision, quantize_matrix


def _matrix(rows: int = 37, cols: int = 96) -> np.ndarray:
    values = np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32)
    values[5, :32] = 0.0  # an all-zero block
    values[9, 40] = 300.0  # an outlier that sets its block's scale
    return values


@pytest.mark.parametrize("precision", ["q8_0", "mxfp4"])
@pytest.mark.parametrize("block_rows", [1, 8, 4096])
def test_quantized_by_blocks_of_rows_equals_quantized_whole(precision, block_rows):
    values = _matrix()
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits, as a checkpoint stores them
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    for source, whole in ((values, values), (bits, widened)):
        got = quantize_matrix(source, precision, block_rows=block_rows)
        want = QuantizedMatrix.quantize(whole, precision)
        assert got.precision == precision and got.shape == values.shape
        assert got.to_bytes() == want.to_bytes()


def test_other_quantized_bytes_are_requantized_and_the_same_precision_kept():
    q8 = QuantizedMatrix.quantize(_matrix(), "q8_0")
    assert quantize_matrix(q8, "q8_0") is q8
    mx = quantize_matrix(q8, "mxfp4", block_rows=5)
    assert mx.to_bytes() == QuantizedMatrix.quantize(q8.dequantize(), "mxfp4").to_bytes()


def test_bad_shapes_and_names_are_refused():
    with pytest.raises(ValueError, match="C % 32"):
        quantize_matrix(np.zeros((4, 40), np.float32), "q8_0")
    with pytest.raises(ValueError, match="unknown quantized precision"):
        quantize_matrix(np.zeros((4, 32), np.float32), "q4_k")
    assert check_load_trunk_precision("bf16") == "native" and check_load_trunk_precision("q8_0") == "q8_0"
    with pytest.raises(ValueError, match="native, bf16, q8_0, mxfp4"):
        check_load_trunk_precision("int8")
