import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from optremat import Graph, GraphError
from optremat.core import published
from tests.dags import graphs

GRAPHS = Path(__file__).resolve().parents[2] / "shared" / "graphs"


def chain(n: int = 4) -> Graph:
    return Graph.build(cost=[1.0] * n, size=[10] * n, edges=[(i, i + 1) for i in range(n - 1)])


def test_build_defaults_and_adjacency():
    g = chain()
    assert g.n == 4
    assert g.preds[2].tolist() == [1] and g.succs[2].tolist() == [3]
    assert g.total_cost == 4.0
    assert not g.cost.flags.writeable and not g.size.flags.writeable
    assert list(g.to_networkx().edges) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(cost=[1, 1], size=[1, 1], edges=[(1, 0)]), "topological"),
    (dict(cost=[1, 1], size=[1, 1], edges=[(0, 2)]), "does not exist"),
    (dict(cost=[1, -1], size=[1, 1], edges=[]), "costs"),
    (dict(cost=[1, 1], size=[1, -1], edges=[]), "sizes"),
    (dict(cost=[1, 1], size=[1, 0], edges=[], alias_of=[-1, 0]), "does not read it"),
    (dict(cost=[1, 1], size=[1, 5], edges=[(0, 1)], alias_of=[-1, 0]), "larger than the node"),
    (dict(cost=[1, 0], size=[1, 1], edges=[], kind=["op", "param"]), "must come before"),
    (dict(cost=[1], size=[1], edges=[], kind=["weight"]), "unknown node kinds"),
    (dict(cost=[1, 1], size=[1], edges=[]), "'size' has shape"),
])
def test_invalid_graphs_are_rejected(kwargs, message):
    with pytest.raises(GraphError, match=message):
        Graph.build(**kwargs)


def test_units_of_aliases_and_parts():
    # node 1 is a two-output op (8 bytes): node 2 owns 3 bytes of it, node 3 is a view of node 2
    g = Graph.build(cost=[1, 1, 0, 0], size=[4, 8, 3, 0], edges=[(0, 1), (1, 2), (2, 3)], alias_of=[-1, -1, 1, 2])
    assert g.units == ((0,), (2, 1), (2,), (2,))
    assert g.unit_size.tolist() == [4, 5, 3, 0]


@settings(max_examples=50)
@given(graphs())
def test_json_round_trip(g):
    again = Graph.from_json(json.loads(json.dumps(g.to_json())))
    assert again.fingerprint == g.fingerprint
    for column in ("cost", "size", "alias_of", "output", "edges", "workspace"):
        assert np.array_equal(getattr(again, column), getattr(g, column))


def test_fingerprint_ignores_costs_but_not_structure():
    g = chain()
    costlier = Graph.build(cost=[2.0] * 4, size=[10] * 4, edges=g.edges.tolist())
    bigger = Graph.build(cost=[1.0] * 4, size=[10, 10, 10, 11], edges=g.edges.tolist())
    assert costlier.fingerprint == g.fingerprint
    assert bigger.fingerprint != g.fingerprint


def test_save_load(tmp_path):
    g = chain()
    g.save(tmp_path / "g.json")
    assert published.load(tmp_path / "g.json").fingerprint == g.fingerprint


def checkmate_flavour() -> dict:
    """Node-link JSON shaped like Checkmate's Keras extractions: ids already topological."""
    nodes = [{"id": i, "name": f"op{i}", "cost_cpu": 10 + i, "cost_ram": 100 * (i + 1), "backward": i >= 2}
             for i in range(4)]
    links = [{"source": a, "target": b} for a, b in [(0, 1), (1, 2), (0, 3), (2, 3)]]
    return {"directed": True, "multigraph": False, "graph": {}, "nodes": nodes, "links": links}


def test_a_checkmate_flavoured_graph_loads_with_its_costs_sizes_and_backward_flags(tmp_path):
    (tmp_path / "g.json").write_text(json.dumps(checkmate_flavour()))
    g = published.load(tmp_path / "g.json")
    assert sorted(map(tuple, g.edges.tolist())) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert g.cost.tolist() == [10, 11, 12, 13] and g.size.tolist() == [100, 200, 300, 400]
    assert g.backward.tolist() == [False, False, True, True] and g.names[2] == "op2"


def test_a_random_layered_graph_is_numbered_in_its_stated_order(tmp_path):
    nodes = [{"id": 10, "duration": 1.5, "out_cost": 7}, {"id": 5, "duration": 2.0, "out_cost": 3},
             {"id": 7, "duration": 0.5, "out_cost": 9}]
    links = [{"0": 5, "1": 10}, {"0": 10, "1": 7}, {"0": 5, "1": 7}]
    data = {"directed": True, "graph": {"order": [5, 10, 7]}, "nodes": nodes, "links": links}
    (tmp_path / "g.json").write_text(json.dumps(data))
    g = published.load(tmp_path / "g.json")
    assert sorted(map(tuple, g.edges.tolist())) == [(0, 1), (0, 2), (1, 2)]
    assert g.cost.tolist() == [2.0, 1.5, 0.5] and g.size.tolist() == [3, 7, 9]
    assert not g.backward.any()


@pytest.mark.parametrize("data, message", [
    ({"nodes": {}}, "node-link"),
    ({"graph": {"order": [0]}, "nodes": [{"id": 0, "duration": 1, "out_cost": 1},
                                         {"id": 1, "duration": 1, "out_cost": 1}], "links": []}, "permutation"),
    ({"nodes": [{"id": 0, "flops": 1}], "links": []}, "unknown node attributes"),
])
def test_a_malformed_node_link_graph_is_refused(tmp_path, data, message):
    (tmp_path / "g.json").write_text(json.dumps(data))
    with pytest.raises(GraphError, match=message):
        published.load(tmp_path / "g.json")


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    (tmp_path / "g.json").write_text("x = 1\n")
    with pytest.raises(GraphError, match=r"graph file .*g\.json is not JSON"):
        published.load(tmp_path / "g.json")


@pytest.mark.parametrize("name, nodes, edges", [
    ("vgg16_b256_224x224_train", 45, 87),
    ("resnet50_b256_224x224_train", 353, 751),
    ("random_layered_n100", 100, 236),
    ("random_layered_n1000", 1000, 5875),
])
def test_published_graphs_load(name, nodes, edges):
    path = GRAPHS / f"{name}.json"
    if not path.exists():
        pytest.skip(f"published graphs not found at {GRAPHS}")
    g = published.load(path)
    assert (g.n, len(g.edges)) == (nodes, edges)
    assert (g.size > 0).all() and g.total_cost > 0
