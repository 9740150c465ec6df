"""Reader for the published benchmark graphs (Checkmate / Moccasin node-link JSON).

Two flavours exist: Checkmate's Keras extractions (`cost_cpu`, `cost_ram`, `backward`,
node ids already topological) and the random layered graphs (`duration`, `out_cost`,
edges keyed "0"/"1", topological order in `graph["order"]`). Both become a `Graph`
whose node numbering is that topological order, so a schedule's stage t runs node t.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optremat.core.graph import Graph, GraphError


def load(path: str | Path) -> Graph:
    """Load an optremat graph file or a published benchmark graph (node-link JSON)."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as error:
        raise GraphError(f"graph file {path} is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise GraphError(f"not a graph: expected a JSON object, found {json.dumps(data)[:40]}")
    if data.get("format") == "optremat.graph":
        return Graph.from_json(data)
    try:
        return from_node_link(data)
    except (TypeError, KeyError, AttributeError, ValueError, IndexError) as error:
        if isinstance(error, GraphError):
            raise
        raise GraphError(f"malformed node-link graph: {type(error).__name__} {error}") from None


def from_node_link(data: dict[str, Any]) -> Graph:
    """Convert node-link JSON of either published flavour into a Graph."""
    nodes = data.get("nodes")
    links = data.get("links", data.get("edges"))
    if not isinstance(nodes, list) or not isinstance(links, list):
        raise GraphError("not a node-link graph: expected 'nodes' and 'links' lists")
    id_key = "id" if nodes and "id" in nodes[0] else "name"
    by_id = {node[id_key]: node for node in nodes}
    meta = data.get("graph", {})
    order = meta.get("order") or sorted(by_id)
    if sorted(order) != sorted(by_id):
        raise GraphError("graph['order'] is not a permutation of the node ids")
    index = {node_id: i for i, node_id in enumerate(order)}
    src_key, dst_key = ("source", "target") if links and "source" in links[0] else ("0", "1")
    edges = [(index[link[src_key]], index[link[dst_key]]) for link in links]
    ordered = [by_id[node_id] for node_id in order]
    if "cost_cpu" in ordered[0]:
        cost = [float(node["cost_cpu"]) for node in ordered]
        size = [int(node["cost_ram"]) for node in ordered]
        backward = [bool(node.get("backward", False)) for node in ordered]
        names = [str(node.get("name", node_id)) for node, node_id in zip(ordered, order)]
    elif "duration" in ordered[0]:
        cost = [float(node["duration"]) for node in ordered]
        size = [int(node["out_cost"]) for node in ordered]
        backward = [False] * len(ordered)
        names = [str(node_id) for node_id in order]
    else:
        raise GraphError("unknown node attributes: expected cost_cpu/cost_ram or duration/out_cost")
    return Graph.build(cost=cost, size=size, edges=edges, backward=backward, names=names)
