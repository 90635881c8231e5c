"""The nodes of an output's autograd graph, for the tests that check which path a step took."""

from __future__ import annotations

import torch


def graph_nodes(out: torch.Tensor) -> list:
    """Every node reachable from ``out.grad_fn``, once each."""
    seen, todo, nodes = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo += [nxt for nxt, _ in node.next_functions]
    return nodes


def node_names(out: torch.Tensor) -> set:
    """The class names of graph_nodes(out), e.g. ``_FusedAttentionPackedBackward``."""
    return {type(node).__name__ for node in graph_nodes(out)}
