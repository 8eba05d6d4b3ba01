"""The kernels' calls over sharded arrays under jit: each device runs its own batch elements and heads.

A call takes whole sequences (its slices may index any token), so the token and head_dim axes are gathered;
the batch axis (a jax.vmap batch, B = 1 otherwise) and the heads (q heads with the kv heads of their group)
may stay sharded, which is what data and tensor parallelism shard. Without this, XLA would gather every
input onto every device and run the whole batch there. Arrays typed with Explicit mesh axes (jax.make_mesh's
default) get a shard_map over the axes that shard their batch and heads; Auto axes get custom_partitioning,
whose rule tells Shardy which dims may stay sharded and whose partition callback runs the call per device
(Shardy only, jax's default: under the deprecated GSPMD partitioner jax refuses such calls by name).

Each argument and result is described by a layout, one letter per dim: b the batch, H the q heads, G the kv
heads, any other letter a dim that is gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

SHARDABLE = "bHG"


def over_batch_and_heads(body: Callable, in_layouts: Sequence[str], out_layouts: Sequence[str]) -> Callable:
    """body(*args) -> tuple of results, run on each device's batch elements and heads. One layout per
    argument and per result (see the module docstring); the first argument with H and the first with G name
    the q and kv heads' shardings. Results over kv heads (G) must be sums over their q heads, as gradients
    are: where the q heads are split and a single kv head is not, they are summed across the devices."""
    partitioned = custom_partitioning(body)

    def per_device(entries):
        # A result over kv heads (a gradient) sums over the q heads of each kv head: with the q heads split
        # and the kv head whole, each device holds part of the sum.
        axes = _axes(entries["H"]) if entries["G"] is None else ()
        if not axes:
            return body
        return lambda *args: tuple(jax.lax.psum(y, axes) if "G" in layout else y
                                   for y, layout in zip(body(*args), out_layouts))

    def partition(mesh, arg_shapes, result_shapes):
        shapes, specs = [a.shape for a in arg_shapes], [a.sharding.spec for a in arg_shapes]
        entries = _entries(mesh.shape, in_layouts, shapes, specs)
        sharding = lambda layout: NamedSharding(mesh, _spec(layout, entries))
        return mesh, per_device(entries), tuple(map(sharding, out_layouts)), tuple(map(sharding, in_layouts))

    rule, options = _sdy_rule(in_layouts, out_layouts)
    partitioned.def_partition(partition, sharding_rule=rule, **options)

    def call(*args):
        args = [jnp.asarray(x) for x in args]
        mesh = _explicit_mesh(args)
        if mesh is None:
            return partitioned(*args)
        shapes, specs = [x.shape for x in args], [jax.typeof(x).sharding.spec for x in args]
        entries = _entries(mesh.shape, in_layouts, shapes, specs)
        args = [jax.sharding.reshard(x, _spec(layout, entries)) for x, layout in zip(args, in_layouts)]
        axes = {a for e in entries.values() for a in _axes(e)}
        if axes:
            outs = jax.shard_map(per_device(entries), mesh=mesh, axis_names=axes,
                                 in_specs=tuple(_spec(layout, entries) for layout in in_layouts),
                                 out_specs=tuple(_spec(layout, entries) for layout in out_layouts))(*args)
        else:
            outs = body(*args)
        # Typed results keep the arguments' shardings (a gradient must be typed as its primal): a result laid
        # out as an argument is sharded as it was, the others as the batch and heads were.
        given = {letter: _entry(in_layouts, shapes, specs, letter) for letter in SHARDABLE}
        like = lambda layout: P(*specs[in_layouts.index(layout)]) if layout in in_layouts else _spec(layout, given)
        return tuple(jax.sharding.reshard(y, like(layout)) for y, layout in zip(outs, out_layouts))
    return call


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def typed_sharding(x) -> NamedSharding | None:
    """x's NamedSharding when its type carries Explicit mesh axes (jax.make_mesh's default), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if mesh is None or explicit is None or explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    return sharding


def split_spec(x) -> tuple | None:
    """The PartitionSpec entries of x when its type splits some dim over Explicit mesh axes, else None."""
    sharding = typed_sharding(x)
    spec = tuple(sharding.spec) if sharding is not None else ()
    return spec if any(e is not None for e in spec) else None


def _explicit_mesh(args):
    """The abstract mesh of the arguments when any is split over an Explicit mesh axis, else None."""
    return next((typed_sharding(x).mesh for x in args if split_spec(x) is not None), None)


def _entries(mesh_shape, layouts: Sequence[str], shapes, specs) -> dict[str, object]:
    """The spec entry of b, H and G: the batch's and the heads' shardings as the arguments have them, kept
    where one call per device can run them. The kv heads must be split like the q heads (each device then
    holds whole groups), or hold a single kv head that every device keeps whole (MQA)."""
    size = lambda entry: int(np.prod([mesh_shape[a] for a in _axes(entry)]))
    batch = _entry(layouts, shapes, specs, "b")
    q_heads, kv_heads = _entry(layouts, shapes, specs, "H"), _entry(layouts, shapes, specs, "G")
    hkv = next(shape[layout.index("G")] for layout, shape in zip(layouts, shapes) if "G" in layout)
    if q_heads is not None and kv_heads == q_heads and hkv % size(q_heads) == 0:
        heads = (q_heads, q_heads)
    elif q_heads is not None and hkv == 1:
        heads = (q_heads, None)
    else:
        heads = (None, None)
    if set(_axes(batch)) & set(_axes(heads[0])):
        batch = None
    return {"b": batch, "H": heads[0], "G": heads[1]}


def _entry(layouts: Sequence[str], shapes, specs, letter: str):
    """The spec entry of the first argument's dim named letter."""
    i = next(i for i, layout in enumerate(layouts) if letter in layout)
    spec = tuple(specs[i]) + (None,) * (len(shapes[i]) - len(specs[i]))
    return spec[layouts[i].index(letter)]


def _spec(layout: str, entries: dict[str, object]) -> P:
    return P(*(entries.get(letter) for letter in layout))


def _sdy_rule(in_layouts: Sequence[str], out_layouts: Sequence[str]) -> tuple[str, dict]:
    """The Shardy rule of the layouts: b, H and G pass through, every other dim needs replication. A letter
    names one factor across the arguments, so the callers' layouts give dims of different sizes different
    letters. The q heads and the kv heads are separate factors: tied as a compound (G r), Shardy may split
    a mesh axis into sub-axes between them, which the partition callback cannot take; it ties them itself."""
    # Shardy wants the special factors in the order the rule names them first.
    others = tuple(dict.fromkeys(c for layout in (*in_layouts, *out_layouts) for c in layout if c not in SHARDABLE))
    side = lambda layouts: ", ".join(" ".join(layout) for layout in layouts)
    return f"{side(in_layouts)} -> {side(out_layouts)}", {"need_replication_factors": others}
