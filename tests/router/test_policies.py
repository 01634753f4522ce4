"""The prefix tree and the routing policies, with made-up loads: no servers, milliseconds."""

from __future__ import annotations

import random

import pytest

from pagedserve.router.config import RouterConfig
from pagedserve.router.policies import (
    CacheAwarePolicy,
    LeastLoadPolicy,
    PrefixTree,
    RoundRobinPolicy,
    WorkerLoad,
    create_policy,
    routing_text,
)


def loads(*in_flight: int, polled: tuple[int | None, ...] | None = None) -> list[WorkerLoad]:
    polled = polled or (None,) * len(in_flight)
    return [WorkerLoad(f"w{i}", n, p) for i, (n, p) in enumerate(zip(in_flight, polled))]


# ---- PrefixTree ----


def test_match_counts_the_shared_prefix_across_split_edges():
    tree = PrefixTree(max_chars=1000)
    tree.insert("hello world")
    tree.insert("hello there")  # splits "hello world" after "hello "
    tree.check_integrity()
    assert tree.num_chars == len("hello ") + len("world") + len("there")
    assert tree.match("hello world") == 11
    assert tree.match("hello wonder") == 8  # "hello wo", inside the "world" edge
    assert tree.match("hello") == 5
    assert tree.match("help") == 3
    assert tree.match("xyz") == 0
    assert tree.match("") == 0


def test_insert_of_a_known_prefix_adds_no_chars():
    tree = PrefixTree(max_chars=1000)
    tree.insert("abcdef")
    tree.insert("abc")  # ends inside an edge: a split, no new characters
    tree.insert("abcdef")
    tree.check_integrity()
    assert tree.num_chars == 6
    assert tree.match("abcdefgh") == 6


def test_eviction_keeps_the_bound_and_drops_least_recently_used_leaves():
    tree = PrefixTree(max_chars=30)
    tree.insert("a" * 10)
    tree.insert("b" * 10)
    tree.insert("c" * 10)
    tree.insert("a" * 10)  # "a" is now the most recently used
    tree.insert("d" * 10)  # over the bound: the oldest leaf, "b", goes
    tree.check_integrity()
    assert tree.num_chars == 30
    assert tree.match("b" * 10) == 0
    assert tree.match("a" * 10) == tree.match("c" * 10) == tree.match("d" * 10) == 10


def test_eviction_reaches_inner_nodes_once_their_leaves_are_gone():
    tree = PrefixTree(max_chars=12)
    tree.insert("shared-x")
    tree.insert("shared-y")  # "shared-" (7) + "x" + "y" = 9 chars
    tree.insert("zzzzzzzzzz")  # 19 > 12: "x", "y", then the bare "shared-" are evicted
    tree.check_integrity()
    assert tree.num_chars == 10
    assert tree.match("shared-x") == 0
    assert tree.match("zzzzzzzzzz") == 10


def test_text_longer_than_the_bound_is_truncated():
    tree = PrefixTree(max_chars=8)
    tree.insert("0123456789")
    tree.check_integrity()
    assert tree.num_chars == 8
    assert tree.match("0123456789") == 8


def test_random_inserts_keep_integrity_and_bound():
    rng = random.Random(0)
    tree = PrefixTree(max_chars=500)
    prefixes = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 40))) for _ in range(20)]
    inserted = []
    for _ in range(2000):
        text = rng.choice(prefixes) + "".join(rng.choice("abcd") for _ in range(rng.randint(0, 30)))
        tree.insert(text)
        inserted.append(text)
        assert tree.num_chars <= 500
    tree.check_integrity()
    # The latest insert is always held whole (it is the most recently used leaf).
    assert tree.match(inserted[-1]) == len(inserted[-1])
    assert len(tree._leaf_heap) <= 2 * len(tree._leaves()) + 64  # stale entries are pruned


# ---- policies ----


def test_round_robin_takes_workers_in_turn():
    policy = RoundRobinPolicy()
    assert [policy.select(loads(0, 0, 0), "").url for _ in range(6)] == ["w0", "w1", "w2"] * 2


def test_least_load_takes_the_larger_of_in_flight_and_polled_load():
    policy = LeastLoadPolicy()
    assert policy.select(loads(3, 1, 2), "").url == "w1"
    # The polled load sees other clients' requests: w0's 9 outweighs its 1 in flight.
    assert policy.select(loads(1, 2, 2, polled=(9, 4, 0)), "").url == "w2"
    assert policy.select(loads(1, 1, 2, polled=(0, 4, 0)), "").url == "w0"  # in flight counts
    assert policy.select(loads(1, 1, polled=(None, 3)), "").url == "w0"  # no /load: in flight


def test_least_load_takes_ties_in_turn():
    policy = LeastLoadPolicy()
    assert {policy.select(loads(0, 0), "").url for _ in range(2)} == {"w0", "w1"}


def cache_aware(**overrides) -> CacheAwarePolicy:
    config = RouterConfig(policy="cache_aware", **overrides)
    policy = create_policy(config)
    assert isinstance(policy, CacheAwarePolicy)
    return policy


DOC_A = "You answer questions about document A. " * 20
DOC_B = "Questions about document B follow here. " * 20


def test_cache_aware_sends_a_shared_prefix_to_the_same_worker():
    policy = cache_aware()
    first = policy.select(loads(0, 0), DOC_A + "question 1")
    assert not first.affinity_hit
    for question in ("question 2", "question 3"):
        decision = policy.select(loads(0, 0), DOC_A + question)
        assert decision.url == first.url and decision.affinity_hit
    other = policy.select(loads(0, 0), DOC_B + "question 1")
    assert other.url != first.url and not other.affinity_hit  # the emptier tree
    assert policy.select(loads(0, 0), DOC_B + "question 2") == type(other)(other.url, True)


def test_cache_aware_below_threshold_goes_to_the_smallest_tree():
    policy = cache_aware(cache_threshold=0.9)
    policy.select(loads(0, 0), "x" * 100)  # w0
    policy.select(loads(0, 0), "y" * 10)  # w1: smaller tree
    decision = policy.select(loads(0, 0), "x" * 50 + "z" * 50)  # 50% match on w0 < 0.9
    assert decision == type(decision)("w1", False)
    assert policy.trees["w1"].num_chars == 10 + 100


def test_cache_aware_imbalance_overrides_affinity():
    policy = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert policy.select(loads(0, 0), DOC_A).url == "w0"
    assert policy.select(loads(4, 0), DOC_A).url == "w0"  # 4 - 0 is not > 4: affinity holds
    decision = policy.select(loads(5, 0), DOC_A)  # 5 - 0 > 4 and 5 > 1.5 * 0
    assert decision.url == "w1" and not decision.affinity_hit
    assert policy.select(loads(20, 14), DOC_A).url == "w1"  # now both hold it: w1 is less loaded
    assert policy.select(loads(20, 15), DOC_A).url == "w1"


def test_cache_aware_relative_threshold_keeps_affinity_under_uniform_load():
    policy = cache_aware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy.select(loads(0, 0), DOC_A)  # w0
    assert policy.select(loads(110, 100), DOC_A).url == "w0"  # 10 > 4 but 110 < 150


def test_cache_aware_forgets_a_removed_worker():
    policy = cache_aware()
    policy.select(loads(0, 0), DOC_A)
    policy.remove_worker("w0")
    assert "w0" not in policy.trees
    assert not policy.select(loads(0, 0), DOC_A).affinity_hit


def test_empty_text_is_never_an_affinity_hit():
    policy = cache_aware()
    assert not policy.select(loads(0, 0), "").affinity_hit
    assert not policy.select(loads(0, 0), "").affinity_hit


@pytest.mark.parametrize("body, text", [
    ({"prompt": "hello"}, "hello"),
    ({"prompt": [1, 22, 333]}, "1 22 333"),
    ({"prompt": ["a", "b"]}, "a\nb"),
    ({"prompt": [[1, 2], [3]]}, "1 2\n3"),
    ({"prompt": None}, ""),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]},
     "system\nS\nuser\nU\n"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {}},
                                                {"type": "text", "text": "b"}]}]}, "user\nab\n"),
])
def test_routing_text(body, text):
    assert routing_text(body) == text


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="worker_metrics_label"):
        RouterConfig(worker_metrics_label="not a label")
