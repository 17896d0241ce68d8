"""The KDA state pool: zeroed slots, copies, integrity."""

from __future__ import annotations

import numpy as np
import pytest

from k3serve.config import tiny_config
from k3serve.engine.errors import IntegrityError, PoolExhaustedError
from k3serve.engine.state_pool import StatePool
from k3serve.model.k3 import k3_cache_layout


def test_slots_are_zeroed_copied_and_accounted():
    config = tiny_config()
    pool = StatePool(k3_cache_layout(config), 2)
    layer = config.kda_layer_ids[1]
    a = pool.allocate()
    state = np.full((config.kda_num_heads, config.kda_head_dim, config.kda_head_dim), 3.0, np.float32)
    tail = np.ones((config.short_conv_kernel_size - 1, 3 * config.kda_proj_size), np.float32)
    pool.write(a, layer, state, tail)
    b = pool.allocate()
    pool.copy_slot(a, b)
    assert np.array_equal(pool.read(b, layer)[0], state) and np.array_equal(pool.read(b, layer)[1], tail)
    with pytest.raises(PoolExhaustedError):
        pool.allocate()
    pool.free(a)
    again = pool.allocate()
    assert again == a and not pool.read(again, layer)[0].any(), "a new slot must start from the zero state"
    pool.check_integrity([a, b])
    with pytest.raises(IntegrityError):
        pool.check_integrity([a])
    with pytest.raises(IntegrityError):
        pool.free(5)
