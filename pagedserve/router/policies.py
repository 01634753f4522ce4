"""Routing policies: which healthy worker gets a request. Pure Python, no I/O, no clock.

- round_robin: the workers in turn.
- least_load: the lowest load, then the lowest KV usage, then in turn. A worker's load is the
  larger of the requests the router has in flight to it (exact and current) and its own
  num_running + num_waiting at the last GET /load poll (which also sees other clients' traffic).
- cache_aware (SGLang's router): send a request where its prefix was sent before, so that the
  worker's prefix cache holds its KV, unless load is imbalanced.

cache_aware keeps, per worker, an approximate radix tree of the request texts routed to it: text
prefixes (characters, not tokens: the router has no tokenizer and sees no KV), their sizes, and
the logical time each was last routed. A tree holds at most max_tree_chars characters (default
2,000,000); past that its least recently used leaves are evicted. It only approximates what the
worker caches: the worker evicts on its own, and its KV is per token, not per character.
Defaults (RouterConfig): cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold 1.5.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedserve.router.config import RouterConfig


@dataclass(frozen=True)
class WorkerLoad:
    """What a policy knows of one candidate worker."""

    url: str
    in_flight: int
    """Requests the router has sent it and not yet finished (exact)."""
    polled_load: int | None = None
    """num_running + num_waiting at its last /load poll; None if it has no /load."""
    kv_cache_usage: float = 0.0
    """The KV pool's fraction in use at the last /load poll (0 if it has no /load)."""

    @property
    def load(self) -> int:
        return max(self.in_flight, self.polled_load or 0)


@dataclass(frozen=True)
class RouteDecision:
    url: str
    affinity_hit: bool = False
    """cache_aware: chosen because its tree matched at least cache_threshold of the text."""


class RoutingPolicy(Protocol):
    def select(self, workers: Sequence[WorkerLoad], text: str) -> RouteDecision:
        """Pick one of `workers` (non-empty, all healthy) for a request whose text is `text`."""
        ...

    def remove_worker(self, url: str) -> None:
        """Forget what was kept for `url`."""
        ...


def create_policy(config: RouterConfig) -> RoutingPolicy:
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    if config.policy == "least_load":
        return LeastLoadPolicy()
    assert config.policy == "cache_aware", config.policy
    return CacheAwarePolicy(config.cache_threshold, config.balance_abs_threshold,
                            config.balance_rel_threshold, config.max_tree_chars)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._num_selected = 0

    def select(self, workers: Sequence[WorkerLoad], text: str) -> RouteDecision:
        worker = workers[self._num_selected % len(workers)]
        self._num_selected += 1
        return RouteDecision(worker.url)

    def remove_worker(self, url: str) -> None:
        pass


class LeastLoadPolicy:
    def __init__(self) -> None:
        self._num_selected = 0

    def select(self, workers: Sequence[WorkerLoad], text: str) -> RouteDecision:
        def load(worker: WorkerLoad) -> tuple[int, float, int]:
            return worker.load, worker.kv_cache_usage, worker.in_flight

        least = min(load(worker) for worker in workers)
        ties = [worker for worker in workers if load(worker) == least]
        # Taking ties in turn spreads sequential requests (all loads 0) over every worker.
        worker = ties[self._num_selected % len(ties)]
        self._num_selected += 1
        return RouteDecision(worker.url)

    def remove_worker(self, url: str) -> None:
        pass


class CacheAwarePolicy:
    def __init__(self, cache_threshold: float, balance_abs_threshold: int,
                 balance_rel_threshold: float, max_tree_chars: int) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self.trees: dict[str, PrefixTree] = {}
        """Worker url -> the texts routed to it; made on first use."""

    def select(self, workers: Sequence[WorkerLoad], text: str) -> RouteDecision:
        trees = [self._tree(worker.url) for worker in workers]
        loads = [worker.load for worker in workers]
        max_load, min_load = max(loads), min(loads)
        if (max_load - min_load > self.balance_abs_threshold
                and max_load > self.balance_rel_threshold * min_load):
            # Imbalanced: cache affinity would pile more onto the busiest worker.
            index = min(range(len(workers)), key=lambda i: (
                loads[i], workers[i].kv_cache_usage, trees[i].num_chars))
            decision = RouteDecision(workers[index].url)
        else:
            matched = [tree.match(text) for tree in trees]
            best = max(range(len(workers)), key=lambda i: (matched[i], -loads[i]))
            if text and matched[best] / len(text) >= self.cache_threshold:
                index, decision = best, RouteDecision(workers[best].url, affinity_hit=True)
            else:
                # A new prefix goes where the least text is cached: spreads distinct prefixes.
                index = min(range(len(workers)), key=lambda i: (trees[i].num_chars, loads[i]))
                decision = RouteDecision(workers[index].url)
        trees[index].insert(text)
        return decision

    def remove_worker(self, url: str) -> None:
        self.trees.pop(url, None)

    def _tree(self, url: str) -> PrefixTree:
        tree = self.trees.get(url)
        if tree is None:
            tree = self.trees[url] = PrefixTree(self.max_tree_chars)
        return tree


class _Node:
    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: str, parent: _Node | None, last_used: int) -> None:
        self.edge = edge
        """The characters from the parent to this node (empty only at the root)."""
        self.children: dict[str, _Node] = {}
        """First character of the child's edge -> child."""
        self.parent = parent
        """None at the root and once evicted."""
        self.last_used = last_used


class PrefixTree:
    """A radix tree over characters: what texts were inserted, bounded by max_chars.

    `match` is read-only; `insert` marks every node on the text's path used now (a logical clock),
    so a parent is never older than its children and the oldest leaf is the one to evict.
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.root = _Node("", None, 0)
        self.num_chars = 0
        """Sum of the edge lengths: the characters this tree holds."""
        self._clock = 0
        self._leaf_heap: list[tuple[int, int, _Node]] = []
        """(last_used, tie-break, node) of leaves; an entry is stale once the node was used again,
        got children or was evicted (checked when popped)."""
        self._tie_breaks = itertools.count()
        self._heap_rebuild_size = 64

    def match(self, text: str) -> int:
        """The number of leading characters of `text` that some inserted text shares."""
        node, num_matched = self.root, 0
        while num_matched < len(text):
            child = node.children.get(text[num_matched])
            if child is None:
                break
            common = _common_prefix_len(child.edge, text, num_matched)
            num_matched += common
            if common < len(child.edge):
                break
            node = child
        return num_matched

    def insert(self, text: str) -> None:
        """Add `text` (its first max_chars characters), then evict old leaves past max_chars."""
        text = text[:self.max_chars]
        self._clock += 1
        node, position = self.root, 0
        node.last_used = self._clock
        while position < len(text):
            child = node.children.get(text[position])
            if child is None:
                child = _Node(text[position:], node, self._clock)
                node.children[text[position]] = child
                self.num_chars += len(child.edge)
                node, position = child, len(text)
                break
            common = _common_prefix_len(child.edge, text, position)
            if common < len(child.edge):
                # Split: node -[edge[:common]]-> middle -[edge[common:]]-> child.
                middle = _Node(child.edge[:common], node, self._clock)
                node.children[text[position]] = middle
                child.edge = child.edge[common:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            child.last_used = self._clock
            node, position = child, position + common
        if not node.children and node is not self.root:
            self._push_leaf(node)
        self._evict()

    def check_integrity(self) -> None:
        """Raise if the tree's structure or its char count is inconsistent."""
        num_chars, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            num_chars += len(node.edge)
            if node is not self.root and not node.edge:
                raise RuntimeError("a non-root node has an empty edge")
            for first_char, child in node.children.items():
                if child.edge[:1] != first_char or child.parent is not node:
                    raise RuntimeError(
                        f"child {child.edge[:20]!r} is misfiled under {first_char!r}")
                if child.last_used > node.last_used:
                    raise RuntimeError("a child was used after its parent")
                stack.append(child)
        if num_chars != self.num_chars:
            raise RuntimeError(f"{num_chars=} != {self.num_chars=}")
        if self.num_chars > self.max_chars:
            raise RuntimeError(f"{self.num_chars=} > {self.max_chars=}")

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaf_heap, (node.last_used, next(self._tie_breaks), node))

    def _evict(self) -> None:
        while self.num_chars > self.max_chars:
            last_used, _, node = heapq.heappop(self._leaf_heap)
            if node.parent is None or node.children or node.last_used != last_used:
                continue  # stale entry
            parent = node.parent
            del parent.children[node.edge[0]]
            node.parent = None
            self.num_chars -= len(node.edge)
            if not parent.children and parent is not self.root:
                self._push_leaf(parent)
        # Stale entries pile up as leaves are reused: rebuild when the heap has doubled since the
        # last rebuild (amortized O(1) per insert).
        if len(self._leaf_heap) > self._heap_rebuild_size:
            self._leaf_heap = []
            for leaf in self._leaves():
                self._push_leaf(leaf)
            self._heap_rebuild_size = max(64, 2 * len(self._leaf_heap))

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves


def _common_prefix_len(edge: str, text: str, start: int) -> int:
    """How many leading characters of `edge` equal text[start:]; C-speed slice compares."""
    if text.startswith(edge, start):
        return len(edge)
    low, high = 0, min(len(edge), len(text) - start)  # edge[:low] matches; edge[:high+1] cannot
    while low < high:
        middle = (low + high + 1) // 2
        if text.startswith(edge[:middle], start):
            low = middle
        else:
            high = middle - 1
    return low


def routing_text(body: dict) -> str:
    """The text cache_aware keys on: a chat request's roles and contents in order, else the
    completion prompt (token ids as decimal text). Malformed input gives "" (the worker 400s)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = _content_text(message.get("content"))
                parts.append(f"{message.get('role', '')}\n{content}\n")
        return "".join(parts)
    return _prompt_text(body.get("prompt"))


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(part["text"] for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(token_id, int) for token_id in prompt):
            return " ".join(map(str, prompt))
        return "\n".join(_prompt_text(item) for item in prompt)  # a batch of prompts
    return ""
