"""OpGraph: the model as a DAG of operators, in a framework-neutral JSON form.

- A **node** is one op: a leaf module call (kind ``module:<name>`` or ``submodule``), a function
  (``function``), a tensor method (``method``), an out-of-place item assignment (``setitem``), a
  parameter or buffer read outside any op (``attr``), or a graph input (``input``).
- Every tensor a node produces is an **edge**, named ``"<node id>.<k>"`` for the node's k-th
  tensor output (the tensor leaves of its output, in pytree order).
- A node's ``call`` is its argument template: JSON in which ``{"$e": i}`` stands for the node's
  i-th input edge (see ``fusionllm.graph.template``).
- A **parameter** (or buffer) has one global name and one ``ParamSpec``; nodes refer to it by
  that name from their local names, so a tied weight is owned once and its gradients summed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from fusionllm.core.errors import GraphError
from fusionllm.core.meta import TensorMeta

IR_VERSION = 1


@dataclass(frozen=True)
class Edge:
    """A tensor produced by a node."""

    id: str
    meta: TensorMeta
    requires_grad: bool

    def to_json(self) -> dict:
        return {"id": self.id, **self.meta.to_json(), "requires_grad": self.requires_grad}

    @staticmethod
    def from_json(obj: dict) -> Edge:
        return Edge(str(obj["id"]), TensorMeta.from_json(obj), bool(obj["requires_grad"]))


@dataclass(frozen=True)
class ParamSpec:
    """A parameter (trainable) or buffer of the model, by its global name."""

    name: str
    meta: TensorMeta
    trainable: bool

    def to_json(self) -> dict:
        return {"name": self.name, **self.meta.to_json(), "trainable": self.trainable}

    @staticmethod
    def from_json(obj: dict) -> ParamSpec:
        return ParamSpec(str(obj["name"]), TensorMeta.from_json(obj), bool(obj["trainable"]))


@dataclass
class Node:
    id: str
    kind: str
    name: str
    config: dict = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    call: dict = field(default_factory=lambda: {"args": [], "kwargs": {}})
    params: dict[str, str] = field(default_factory=dict)
    outputs: list[Edge] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "kind": self.kind,
            "name": self.name,
            "config": self.config,
            "inputs": list(self.inputs),
            "call": self.call,
            "params": dict(self.params),
            "outputs": [e.to_json() for e in self.outputs],
        }

    @staticmethod
    def from_json(obj: dict) -> Node:
        return Node(
            id=str(obj["id"]),
            kind=str(obj["kind"]),
            name=str(obj["name"]),
            config=dict(obj["config"]),
            inputs=[str(e) for e in obj["inputs"]],
            call=dict(obj["call"]),
            params={str(k): str(v) for k, v in obj["params"].items()},
            outputs=[Edge.from_json(e) for e in obj["outputs"]],
        )


@dataclass
class OpGraph:
    """Nodes in a topological order, the parameter table, and the graph's outputs."""

    nodes: list[Node]
    params: dict[str, ParamSpec]
    outputs: list[str]
    loss: str | None = None
    meta: dict = field(default_factory=dict)

    # ---- lookups -------------------------------------------------------------------------
    def node(self, node_id: str) -> Node:
        index = self.__dict__.get("_index")
        if index is None or len(index) != len(self.nodes):
            index = self.__dict__["_index"] = {n.id: n for n in self.nodes}
        try:
            return index[node_id]
        except KeyError:
            raise GraphError(f"no node {node_id!r} in the graph") from None

    def edges(self) -> dict[str, Edge]:
        return {e.id: e for n in self.nodes for e in n.outputs}

    @property
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "input"]

    @property
    def compute_nodes(self) -> list[Node]:
        """Every node a stage can own (all but graph inputs)."""
        return [n for n in self.nodes if n.kind != "input"]

    def consumers(self) -> dict[str, list[str]]:
        """Edge id -> ids of the nodes that read it (in node order, without repeats)."""
        out: dict[str, list[str]] = {e: [] for e in self.edges()}
        for n in self.nodes:
            for e in dict.fromkeys(n.inputs):
                out.setdefault(e, []).append(n.id)
        return out

    def boundary(self, node_ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """What a set of nodes (a stage) receives and hands out: the edges entering it (read there,
        made by other nodes or graph inputs; in order of first reading) and those leaving it (made
        there, read by other nodes or a graph output; in node order)."""
        wanted = set(node_ids)
        inside = [n for n in self.nodes if n.id in wanted]
        produced = {e.id for n in inside for e in n.outputs}
        read_outside = {e for n in self.nodes if n.id not in wanted for e in n.inputs}
        entering = list(dict.fromkeys(e for n in inside for e in n.inputs if e not in produced))
        leaving = [e.id for n in inside for e in n.outputs if e.id in read_outside or e.id in self.outputs]
        return entering, leaving

    def num_params(self, trainable_only: bool = True) -> int:
        return sum(p.meta.numel for p in self.params.values() if p.trainable or not trainable_only)

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": IR_VERSION,
            "nodes": [n.to_json() for n in self.nodes],
            "params": [p.to_json() for p in self.params.values()],
            "outputs": list(self.outputs),
            "loss": self.loss,
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @staticmethod
    def from_json(text: str | bytes | dict, *, check_kinds: bool = True) -> OpGraph:
        """Parse and validate; every problem names the node or key at fault."""
        if isinstance(text, dict):
            obj = text
        else:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise GraphError(f"OpGraph JSON is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise GraphError("OpGraph JSON must be an object")
        if obj.get("version") != IR_VERSION:
            raise GraphError(
                f"OpGraph version {obj.get('version')!r} not supported (this fusionllm reads {IR_VERSION})"
            )
        try:
            nodes = [Node.from_json(n) for n in obj["nodes"]]
            params = {p["name"]: ParamSpec.from_json(p) for p in obj["params"]}
            graph = OpGraph(nodes, params, [str(e) for e in obj["outputs"]], obj.get("loss"), dict(obj.get("meta", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise GraphError(f"OpGraph JSON is malformed: {type(exc).__name__}: {exc}") from None
        graph.validate(check_kinds=check_kinds)
        return graph

    # ---- validation ------------------------------------------------------------------------
    def validate(self, *, check_kinds: bool = True) -> None:
        """Reject duplicate ids, dangling edges and params, cycles, and unknown op kinds."""
        ids: set[str] = set()
        producers: dict[str, str] = {}
        for n in self.nodes:
            if n.id in ids:
                raise GraphError(f"node {n.id!r} ({n.name}) appears twice")
            ids.add(n.id)
            for k, e in enumerate(n.outputs):
                if e.id != f"{n.id}.{k}":
                    raise GraphError(f"node {n.id!r} ({n.name}): output {k} is named {e.id!r}, expected '{n.id}.{k}'")
                producers[e.id] = n.id
        for n in self.nodes:
            for e in n.inputs:
                if e not in producers:
                    raise GraphError(f"node {n.id!r} ({n.name}) reads edge {e!r}, which no node produces")
            for local, name in n.params.items():
                if name not in self.params:
                    raise GraphError(f"node {n.id!r} ({n.name}) uses parameter {name!r} (as {local!r}), which is not in the parameter table")
        for e in self.outputs:
            if e not in producers:
                raise GraphError(f"graph output {e!r} is produced by no node")
        if self.loss is not None and self.loss not in producers:
            raise GraphError(f"loss edge {self.loss!r} is produced by no node")
        self._check_acyclic(producers)
        if check_kinds:
            from fusionllm.graph.registry import check_node

            for n in self.nodes:
                check_node(n)

    def _check_acyclic(self, producers: dict[str, str]) -> None:
        deps = {n.id: {producers[e] for e in n.inputs} for n in self.nodes}
        state: dict[str, int] = {}  # 1 = on the stack, 2 = done
        for start in deps:
            if start in state:
                continue
            stack: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(deps[start])))]
            state[start] = 1
            while stack:
                nid, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[nid] = 2
                    stack.pop()
                elif state.get(nxt) == 1:
                    raise GraphError(f"the graph has a cycle through node {nxt!r} ({self.node(nxt).name})")
                elif nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(sorted(deps[nxt]))))


def op_key(node: Node) -> str:
    """The name of a node's op as backends advertise the kinds they run: ``module:torch.nn.Linear``, ``method:view``, ..."""
    if node.kind in ("function",):
        return f"function:{node.config.get('target')}"
    if node.kind in ("method", "property"):
        return f"{node.kind}:{node.config.get('name')}"
    if node.kind == "submodule":
        return f"submodule:{node.config.get('class')}"
    return node.kind
