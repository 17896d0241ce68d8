"""The routers without Ray: round-robin order, least-load, power-of-two, and the cache-aware radix tree."""

from __future__ import annotations

import pytest

from k3serve.cluster.router import PrefixTree, Router, RouterConfig
from k3serve.errors import ConfigError

SYSTEM = list(range(100, 164))  # 64 tokens = 4 blocks of 16


def test_round_robin_skips_replicas_that_are_down():
    router = Router(RouterConfig(policy="round-robin"), 3)
    assert [router.choose([1], "t", None).replica for _ in range(4)] == [0, 1, 2, 0]
    router.mark_down(1)
    assert [router.choose([1], "t", None).replica for _ in range(3)] == [2, 0, 2]
    router.mark_down(0)
    router.mark_down(2)
    assert router.choose([1], "t", None) is None


def test_least_load_and_power_of_two_pick_the_less_loaded():
    router = Router(RouterConfig(policy="least-load"), 3)
    assert [router.choose([1], "t", None).replica for _ in range(3)] == [0, 1, 2]
    router.end(1)
    assert router.choose([1], "t", None) == (1, "least_load", 0)
    two = Router(RouterConfig(policy="power-of-two", seed=3), 2)
    two.load[:] = [5, 0]
    assert all(two.choose([1], "t", None).replica == 1 for _ in range(3))  # a pair of 2 always holds replica 1


def test_prefix_tree_matches_whole_blocks_per_tenant_and_salt():
    tree = PrefixTree(block_size=16, max_keys=100)
    tree.insert(SYSTEM + [1, 2, 3], "alice", None, replica=1)
    assert tree.match(SYSTEM + [9] * 20, "alice", None) == {1: 64}
    assert tree.match(SYSTEM[:40], "alice", None) == {1: 32}  # 2 whole blocks of 40 tokens
    assert tree.match(SYSTEM, "bob", None) == {}  # tenants never match each other
    assert tree.match(SYSTEM, "alice", "salt") == {}
    tree.insert(SYSTEM[:32], "alice", None, replica=0)
    assert tree.match(SYSTEM, "alice", None) == {1: 64, 0: 32}
    tree.forget(1)
    assert tree.match(SYSTEM, "alice", None) == {0: 32}


def test_prefix_tree_forgets_least_recently_used_keys():
    tree = PrefixTree(block_size=16, max_keys=4)
    tree.insert(SYSTEM, "a", None, replica=0)  # 4 keys
    tree.insert(list(range(16)), "a", None, replica=1)  # the oldest key (SYSTEM's first block) goes
    assert len(tree) == 4
    assert tree.match(SYSTEM, "a", None) == {}  # the path is broken at its root
    assert tree.match(list(range(16)), "a", None) == {1: 16}


def test_cache_aware_follows_the_prefix_while_balanced_then_the_load():
    router = Router(RouterConfig(policy="cache-aware", balance_abs_threshold=2, balance_rel_threshold=1.5), 2)
    first = router.choose(SYSTEM + [1], "t", None)
    assert first.reason == "no_match"
    again = router.choose(SYSTEM + [2], "t", None)  # load 1 vs 0: balanced enough, the prefix wins
    assert again == (first.replica, "prefix_match", 64)
    other = router.choose(list(range(500, 540)), "t", None)
    assert other.reason == "no_match" and other.replica != first.replica
    assert router.choose(SYSTEM + [3], "t", None).reason == "prefix_match"  # 3 vs 1: a spread of 2 is balanced
    assert router.choose(SYSTEM + [4], "t", None).reason == "prefix_match"  # 4 vs 1
    imbalanced = router.choose(SYSTEM + [5], "t", None)  # a spread of 3 > 2 and 4 > 1.5 x 1
    assert imbalanced.reason == "imbalanced" and imbalanced.replica == other.replica
    assert sorted(router.load) == [2, 4]


def test_a_restarted_replica_loses_its_prefixes():
    router = Router(RouterConfig(policy="cache-aware"), 2)
    route = router.choose(SYSTEM, "t", None)
    router.end(route.replica)
    router.mark_down(route.replica)
    assert router.choose(SYSTEM, "t", None).replica != route.replica
    router.mark_up(route.replica, restarted=True)
    assert route.replica not in router.tree.match(SYSTEM, "t", None)


@pytest.mark.parametrize("kwargs", [{"policy": "random"}, {"balance_rel_threshold": 0.5},
                                    {"balance_abs_threshold": -1}, {"block_size": 0}])
def test_router_config_refuses_bad_values(kwargs):
    with pytest.raises(ConfigError):
        RouterConfig(**kwargs)
