"""The jit-able step function: one forward pass over a ForwardBatch and the paged cache.

`forward(model_state, kv_cache, batch)` returns
`(logits [L, vocab] float32, hidden, new_kv_cache)` where `hidden` is the
final normed hidden state of every token row ([T, hidden_size]), or, when
`aux_hidden_layer_ids` names layers, the outputs of those layers stacked in
the order given ([A, T, hidden_size]; the residual stream after layer i,
before the final norm), as Eagle drafters consume them. Logits are computed
only for `batch.logits_indices`.

`jit_forward` is the compiled form with the cache donated: pass it the cache
and use only the returned one afterwards. It compiles once per distinct
(model, cache layout, batch shapes, static arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.batch import ForwardBatch
from esurge.models.decoder import CausalLM
from esurge.models.kv_cache import KVCache
from esurge.models.layers import DecoderLayer
from esurge.models.paged_attention import AttentionMetadata

__all__ = ["HashedGraph", "ModelState", "Params", "SharedLayerTraces", "ShellState", "SplitGraph",
           "forward", "jit_forward"]


class HashedGraph:
    """A graph definition with its hash computed once.

    jit hashes the static part of its arguments on every call; hashing an nnx
    GraphDef walks the whole module tree (~0.1 ms per layer), so it is done
    once here and equality short-cuts on identity. Two equal graphs found
    equal once share one GraphDef from then on: a second engine of the same
    model in a process (its jit cache entries hold the first's graph)
    otherwise paid a full comparison on every step (dispatch 107 -> 230 us
    on the 4M test model).
    """

    __slots__ = ("_hash", "graphdef", "split")

    def __init__(self, graphdef: nnx.GraphDef[Any]) -> None:
        self.graphdef = graphdef
        self._hash = hash(graphdef)
        self.split: SplitGraph | None = None  # a model's, once ModelState.shell asks for it

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HashedGraph):
            return NotImplemented
        if self.graphdef is other.graphdef:
            return True
        if self._hash != other._hash or self.graphdef != other.graphdef:
            return False
        other.graphdef = self.graphdef  # equal: compare by identity from now on
        return True


@dataclass(frozen=True, slots=True)
class SplitGraph:
    """A model's graph in parts: the model with no decoder layers, and each layer's graph."""

    shell: HashedGraph
    layers: tuple[HashedGraph, ...]  # one object per distinct layer structure


Params = dict[str, Any]  # nested {module name: ... {param name: array}}, as nnx.to_pure_dict


class ShellState:
    """The parameters outside the decoder layers (embedding, final norm, LM head)
    as a pytree: what a program that only embeds or projects to the vocabulary
    (the draft head's steps, prompt logprobs) needs of the model.

    A jit call checks and prepares every leaf of its arguments on the host
    (SmolLM2's model step, with 545 leaves of weights: 1.6-1.8 ms of host CPU a
    call on a 2-core EPYC): the whole model is some 18 leaves a layer, its
    shell a handful.
    """

    __slots__ = ("_graph", "params")

    def __init__(self, graph: HashedGraph, params: Params) -> None:
        self._graph = graph
        self.params = params

    def shell(self) -> CausalLM:
        """The module without its decoder layers."""
        return nnx.merge(self._graph.graphdef, self.params)

    def _flatten(self) -> tuple[tuple[Params], HashedGraph]:
        return (self.params,), self._graph

    @classmethod
    def _unflatten(cls, graph: HashedGraph, children: tuple[Params]) -> ShellState:
        return cls(graph, children[0])


jax.tree_util.register_pytree_node(ShellState, ShellState._flatten, ShellState._unflatten)


class _StateShape:
    """A ModelState's static half: its graph and its parameters' tree structure,
    hashed once and compared by identity first (jit hashes and compares it on
    every call)."""

    __slots__ = ("_hash", "graph", "treedef")

    def __init__(self, graph: HashedGraph, treedef: jax.tree_util.PyTreeDef) -> None:
        self.graph, self.treedef = graph, treedef
        self._hash = hash((graph, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _StateShape):
            return NotImplemented
        return self is other or (self._hash == other._hash and self.graph == other.graph
                                 and self.treedef == other.treedef)


class ModelState:
    """A model as a pytree: its static graph definition and its parameter arrays.

    params is a plain nested dict, never changed in place: the state keeps its
    leaves in a flat tuple, which jit flattens at every call. Walking the
    nested dicts instead (key sorting and lookups over SmolLM2's 545 leaves)
    cost about 0.2 ms of a step call's 1.6-1.8 ms host time on a 2-core EPYC.
    """

    __slots__ = ("_leaves", "_shape", "_shell", "params")

    def __init__(self, graphdef: nnx.GraphDef[CausalLM], params: Params) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        self._init(_StateShape(HashedGraph(graphdef), treedef), tuple(leaves), params)

    def _init(self, shape: _StateShape, leaves: tuple[Any, ...], params: Params) -> None:
        self._shape, self._leaves, self.params = shape, leaves, params
        self._shell: ShellState | None = None

    @property
    def graphdef(self) -> nnx.GraphDef[CausalLM]:
        """The static nnx graph definition."""
        return self._shape.graph.graphdef

    def module(self) -> CausalLM:
        """The nnx module holding these parameters."""
        return nnx.merge(self.graphdef, self.params)

    def shell(self) -> CausalLM:
        """The module without its decoder layers (embedding, final norm, LM head).

        Merging the whole module walks every layer's modules, most of the
        cost of tracing a step once the layers share one trace; a step
        program merges the shell and runs the layers with SharedLayerTraces.
        """
        return self.shell_state().shell()

    def shell_state(self) -> ShellState:
        """The shell's parameters alone (kept: the same object every call)."""
        if self._shell is None:
            model = {k: v for k, v in self.params["model"].items() if k != "layers"}
            self._shell = ShellState(self.split_graph().shell, {**self.params, "model": model})
        return self._shell

    def split_graph(self) -> SplitGraph:
        """The graph in parts, computed once per graph (shared by every trace)."""
        static = self._shape.graph
        if static.split is None:
            model = self.module()
            distinct: dict[HashedGraph, HashedGraph] = {}
            layers = tuple(distinct.setdefault(g, g) for g in (
                HashedGraph(nnx.graphdef(layer)) for layer in model.model.layers))
            model.model.layers = nnx.List([])
            static.split = SplitGraph(HashedGraph(nnx.graphdef(model)), layers)
        return static.split

    def _flatten(self) -> tuple[tuple[Any, ...], _StateShape]:
        return self._leaves, self._shape

    @classmethod
    def _unflatten(cls, shape: _StateShape, children: tuple[Any, ...]) -> ModelState:
        state = cls.__new__(cls)
        leaves = tuple(children)
        state._init(shape, leaves, jax.tree_util.tree_unflatten(shape.treedef, leaves))
        return state


jax.tree_util.register_pytree_node(ModelState, ModelState._flatten, ModelState._unflatten)


@partial(jax.jit, static_argnums=(0, 1))
def _shared_layer(graph: HashedGraph, block_pages: int | None, params: Params,
                  x: jax.Array,  # [T, hidden]
                  rope: tuple[jax.Array, jax.Array], kv: tuple[jax.Array, jax.Array],
                  metadata: AttentionMetadata, slot_mapping: jax.Array,  # [T]
                  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    layer: DecoderLayer = nnx.merge(graph.graphdef, params)
    return layer(x, rope, kv, metadata, slot_mapping, block_pages)


class SharedLayerTraces:
    """Runs each decoder layer as a nested jit keyed by the layer's graph.

    Layers of one structure then share one trace and one lowering per step
    program (jit caches the nested call by graph and shapes), where inline
    they were traced one by one: 30 traced layers were most of a warm
    restart's warm-up. XLA inlines the calls, so the compiled step is the
    same program.
    """

    __slots__ = ("_graphs", "_params")

    def __init__(self, model_state: ModelState) -> None:
        self._graphs = model_state.split_graph().layers
        self._params: dict[int, Params] = model_state.params["model"]["layers"]

    def __call__(self, index: int, x: jax.Array,  # [T, hidden]
                 rope: tuple[jax.Array, jax.Array], kv: tuple[jax.Array, jax.Array],
                 metadata: AttentionMetadata, slot_mapping: jax.Array,  # [T]
                 block_pages: int | None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        return _shared_layer(self._graphs[index], block_pages, self._params[index], x, rope,
                             kv, metadata, slot_mapping)


def _check_aux_ids(ids: tuple[int, ...], num_layers: int) -> None:
    if not isinstance(ids, tuple) or len(set(ids)) != len(ids):
        raise ValueError(f"aux_hidden_layer_ids must be a tuple of distinct ints, got {ids!r}")
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux_hidden_layer_ids {bad} are outside [0, {num_layers})")


def logits_rows(logits_indices: jax.Array  # [L] int32: increasing, then 0-padded
                ) -> jax.Array:  # [] int32
    """Rows of logits_indices up to its last real one: real rows increase
    (token order), padding is 0 (esurge.models.batch), so the last increase
    marks the end (one row when there is no increase)."""
    position = jnp.arange(logits_indices.shape[0], dtype=jnp.int32)[1:]
    rises = logits_indices[1:] > logits_indices[:-1]
    return 1 + jnp.max(jnp.where(rises, position, 0), initial=0)


def forward(
    model_state: ModelState,
    kv_cache: KVCache,
    batch: ForwardBatch,
    aux_hidden_layer_ids: tuple[int, ...] = (),
    block_pages: int | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One step: (logits [L, vocab], hidden [T, H] or aux [A, T, H], updated cache).

    block_pages: pages per attention step (None: sized to the token bucket).
    """
    model = model_state.shell()
    _check_aux_ids(aux_hidden_layer_ids, model.config.num_layers)
    hidden, aux, kv_cache = model(batch, kv_cache, aux_hidden_layer_ids, block_pages,
                                  SharedLayerTraces(model_state))
    logits = model.compute_logits(hidden[batch.logits_indices],
                                  logits_rows(jnp.asarray(batch.logits_indices)))
    return logits, (hidden if aux is None else aux), kv_cache


jit_forward = jax.jit(
    forward, donate_argnums=(1,), static_argnames=("aux_hidden_layer_ids", "block_pages")
)
