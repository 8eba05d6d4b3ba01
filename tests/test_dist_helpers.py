"""Shared helpers for the distributed tests (CPU and GPU): meshes, mask families, random masks, and the
global round trip dispatch -> calc_attn -> undispatch checked against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import magi_jax as mj
from magi_jax import comm, masks
from magi_jax.mask import AttnMask
from tests.conftest import check_against_reference, random_qkv, remat_grads_and_calls

# 380 tokens: not a multiple of chunk_size * cp for most settings, so the plans pad.
DOCS = [61, 7, 90, 1, 18, 127, 4, 72]


def mesh_of(cp: int, dp: int = 1, platform: str = "cpu") -> Mesh:
    """A (cp,) mesh, or (dp, cp) when dp > 1, over the first devices of the platform."""
    devices = jax.devices(platform)
    if len(devices) < dp * cp:
        raise RuntimeError(f"need {dp * cp} {platform} devices, have {len(devices)}")
    if dp == 1:
        return Mesh(np.array(devices[:cp]), ("cp",))
    return Mesh(np.array(devices[:dp * cp]).reshape(dp, cp), ("dp", "cp"))


def dp2_cp4_batch(seed: int):
    """A (dp 2, cp 4) mesh, a block-causal mask over DOCS planned on it (overlap 2), and fresh q, k, v
    [2, T, 2, 64]: a batch over dp, tokens over cp. Returns (mesh, mask, plan, q, k, v)."""
    mesh = mesh_of(4, dp=2)
    mask = masks.block_causal(DOCS, 48)
    mp = mj.plan(mask, mesh, axis="cp", chunk_size=16, overlap=2, num_heads_q=2, head_dim=64)
    rng = np.random.default_rng(seed)
    T = mask.total_seqlen_q
    q, k, v = (jnp.stack(x) for x in zip(*(random_qkv(rng, T, T, 2, 2, 64) for _ in range(2))))
    return mesh, mask, mp, q, k, v


def families(docs=DOCS) -> dict[str, AttnMask]:
    """One mask of every family of magi_jax.masks."""
    total = sum(docs)
    third = total // 3
    return {
        "full": masks.full(total),
        "causal": masks.causal(total),
        "varlen_full": masks.varlen_full(docs),
        "varlen_causal": masks.varlen_causal(docs),
        "sliding_window": masks.sliding_window(docs, 24),
        "sliding_window_bi": masks.sliding_window(docs, 17, causal=False),
        "block_causal": masks.block_causal(docs, 32),
        "shared_question": masks.shared_question([(40, [60, 20, 17]), (third, [total - 137 - third])]),
        "prefix_lm": masks.prefix_lm(docs, [n // 3 for n in docs]),
        "global_sliding_window": masks.global_sliding_window(docs, 20, 6),
        "causal_blockwise": masks.causal_blockwise(docs),
    }


def random_mask(seed: int, total: int = 380, max_slices: int = 10) -> AttnMask:
    """Seeded arbitrary slices of all four types: overlapping rows, empty rows, any key ranges."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, max_slices + 1))
    q = np.sort(rng.integers(0, total + 1, (n, 2)), axis=1)
    k = np.sort(rng.integers(0, total + 1, (n, 2)), axis=1)
    return AttnMask(q, k, rng.integers(0, 4, n), total, total)


def global_fn(mp, **options):
    """Global q, k, v -> (out, lse) in global order through dispatch, calc_attn and undispatch (jitted)."""
    @jax.jit
    def fn(q, k, v):
        qd, kd, vd = (mj.dispatch(x, mp) for x in (q, k, v))
        out, lse = mj.calc_attn(qd, kd, vd, mp, **options)
        return mj.undispatch(out, mp), mj.undispatch(lse, mp)
    return fn


def check_dist(mask: AttnMask, mesh: Mesh, *, overlap=2, chunk_size=16, hq=2, hkv=2, d=64, dv=None,
               dtype=np.float32, seed=0, softmax_scale=None, softcap=0.0, **options):
    """The global round trip on ``mesh`` against the float64 reference: out, lse, dq, dk, dv within the
    tolerance rule (dv: v's own head dim, default d). Returns the plan."""
    mp = mj.plan(mask, mesh, chunk_size=chunk_size, overlap=overlap, num_heads_q=hq, num_heads_kv=hkv,
                 head_dim=d)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hkv, d, dtype)
    v = v[..., :dv]
    fn = global_fn(mp, softmax_scale=softmax_scale, softcap=softcap, **options)
    check_against_reference(fn, mask, q, k, v, rng, softmax_scale, softcap)
    return mp


def check_plan_tables(mask_list, mesh: Mesh, *, overlap=1, chunk_size=16, hq=2, hkv=2, d=64, dtype=np.float32,
                      seed=0, **options) -> list:
    """The global round trip of check_dist for masks of one length through one jitted function taking
    their PlanTables (one PlanCapacity for all) as an argument: each against the float64 reference, and
    one trace for all. Returns the tables."""
    plans = [mj.plan(m, mesh, chunk_size=chunk_size, overlap=overlap, num_heads_q=hq, num_heads_kv=hkv,
                     head_dim=d) for m in mask_list]
    capacity = mj.PlanCapacity.of(plans, headroom=1.25)
    tables = [mj.plan_tables(mp, capacity) for mp in plans]
    traces = []

    @jax.jit
    def fn(q, k, v, t):
        traces.append(1)
        qd, kd, vd = (mj.dispatch(x, t) for x in (q, k, v))
        out, lse = mj.calc_attn(qd, kd, vd, t, **options)
        return mj.undispatch(out, t), mj.undispatch(lse, t)

    rng = np.random.default_rng(seed)
    total = mask_list[0].total_seqlen_q
    q, k, v = random_qkv(rng, total, total, hq, hkv, d, dtype)
    for mp, t in zip(plans, tables):
        check_against_reference(lambda q, k, v: fn(q, k, v, t), mp.mask, q, k, v, rng)
    assert len(traces) == 1, f"{len(traces)} traces for {len(plans)} plans of one capacity"
    return tables


def check_batched_plan_tables(mask_list, mesh: Mesh, batch: int, *, chunk_size=16, hq=2, hkv=2, d=64,
                              dtype=np.float32, seed=0) -> None:
    """Batched PlanTables (one plan per batch element): dispatch, calc_attn and undispatch of [B, T, H, D]
    give element b its own mask's attention, forward and gradients, against the float64 reference; two
    batches of different masks, one trace."""
    plans = [mj.plan(m, mesh, chunk_size=chunk_size, overlap=1, num_heads_q=hq, num_heads_kv=hkv, head_dim=d)
             for m in mask_list]
    capacity = mj.PlanCapacity.of(plans)
    traces = []

    @jax.jit
    def fn(q, k, v, t):
        traces.append(1)
        qd, kd, vd = (mj.dispatch(x, t, seq_dim=1) for x in (q, k, v))
        out, lse = mj.calc_attn(qd, kd, vd, t)
        return mj.undispatch(out, t, seq_dim=1), mj.undispatch(lse, t, seq_dim=1)

    rng = np.random.default_rng(seed)
    total = mask_list[0].total_seqlen_q
    q, k, v = (jnp.stack(x) for x in zip(*(random_qkv(rng, total, total, hq, hkv, d, dtype) for _ in range(batch))))
    for first in (0, 1):
        chosen = [(first + 2 * b) % len(plans) for b in range(batch)]
        t = mj.plan_tables([plans[i] for i in chosen], capacity)
        assert t.spec.batch == batch and mj.position_ids(t).shape == (batch, plans[0].padded_seqlen)
        for b, i in enumerate(chosen):
            def element(qb, kb, vb, b=b):
                return tuple(y[b] for y in fn(q.at[b].set(qb), k.at[b].set(kb), v.at[b].set(vb), t))
            check_against_reference(element, mask_list[i], q[b], k[b], v[b], rng)
    assert len(traces) == 1, f"{len(traces)} traces for two batches of one capacity"


def remat_grads(mask: AttnMask, mesh: Mesh, *, chunk_size=16, hq=2, d=64, dtype=np.float32, **options):
    """remat_grads_and_calls of a loss through calc_attn's out and lse, and the plan."""
    mp = mj.plan(mask, mesh, chunk_size=chunk_size, overlap=2, num_heads_q=hq, head_dim=d)
    rng = np.random.default_rng(9)
    q, k, v = (mj.dispatch(x, mp) for x in random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hq, d,
                                                           dtype))

    def loss(q, k, v):
        out, lse = mj.calc_attn(q, k, v, mp, **options)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return (*remat_grads_and_calls(loss, q, k, v), mp)


# ---------------------------------------------------------------------------------------------------------
# HLO analysis: does any collective depend on an attention call, and what runs between an async
# collective's start and done in a scheduled module. Used by the tests and by bench/dist.py on GPUs.

import re  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
COLLECTIVES = ("all-to-all", "collective-permute", "all-gather", "all-reduce", "reduce-scatter")
FFA_TARGETS = ("magi_jax_ffa_fwd", "magi_jax_ffa_bwd")


def parse_hlo(text: str) -> dict[str, list[dict]]:
    """computation name -> its instructions in order: name, opcode, operands, called computations, target,
    and whether it is the ENTRY."""
    comps: dict[str, list[dict]] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _COMP.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    comps["__entry__"] = comps[current]
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, _, opcode, rest = m.groups()
        depth, args = 1, []
        for i, ch in enumerate(rest):
            depth += 1 if ch == "(" else -1 if ch == ")" else 0
            if depth == 0:
                args, attrs = rest[:i], rest[i + 1:]
                break
        else:
            attrs = ""
        called = re.findall(r"(?:calls|to_apply|body|condition|branch_computations|called_computations)="
                            r"\{?([%\w.\-, ]+)\}?", attrs)
        target = re.search(r'custom_call_target="([^"]+)"', attrs)
        comps[current].append({
            "name": name, "opcode": opcode, "operands": re.findall(r"%([\w.\-]+)", args),
            "called": [c.strip().lstrip("%") for group in called for c in group.split(",") if c.strip()],
            "target": target.group(1) if target else None})
    return comps


def _contains(comps, comp: str, pred, seen=None) -> bool:
    seen = set() if seen is None else seen
    if comp in seen or comp not in comps:
        return False
    seen.add(comp)
    return any(pred(ins) or any(_contains(comps, c, pred, seen) for c in ins["called"]) for ins in comps[comp])


def _is_ffa(ins) -> bool:
    return ins["target"] in FFA_TARGETS


def _is_collective(ins) -> bool:
    return any(ins["opcode"].startswith(c) for c in COLLECTIVES)


def collective_dependencies(text: str) -> dict[str, dict[str, str]]:
    """For every collective (or async wrapper holding one): the FFA calls it depends on, directly or through
    other instructions of its computation, as {collective: {ffa call: target}}. group_cast transfers
    should depend on none (free to overlap any attention call); a group_reduce transfer on its own stage's
    backward call alone."""
    comps = parse_hlo(text)
    deps: dict[str, dict[str, str]] = {}
    for comp, instrs in comps.items():
        if comp == "__entry__":
            continue
        by_name = {i["name"]: i for i in instrs}
        ffa = {}
        for i in instrs:
            if _is_ffa(i):
                ffa[i["name"]] = i["target"]
            elif any(_contains(comps, c, _is_ffa) for c in i["called"]):
                ffa[i["name"]] = "nested"
        for ins in instrs:
            holds = _is_collective(ins) or any(_contains(comps, c, _is_collective) for c in ins["called"])
            if not holds or ins["name"] in ffa or ins["opcode"].endswith("-done"):
                continue
            stack, seen, found = list(ins["operands"]), set(), {}
            while stack:
                n = stack.pop()
                if n in seen or n not in by_name:
                    continue
                seen.add(n)
                if n in ffa:
                    found[n] = ffa[n]
                stack.extend(by_name[n]["operands"])
            deps[ins["name"]] = found
    return deps


def count_ops(text: str) -> dict[str, int]:
    """FFA calls, range-op calls and collectives anywhere in the module."""
    comps = parse_hlo(text)
    instrs = [i for c, v in comps.items() if c != "__entry__" for i in v]
    return {"ffa": sum(map(_is_ffa, instrs)),
            "range_ops": sum(1 for i in instrs if (i["target"] or "").startswith("magi_jax_range")),
            "collectives": sum(1 for i in instrs if _is_collective(i) and not i["opcode"].endswith("-done"))}


def async_overlap(text: str) -> list[dict]:
    """For a scheduled module (GPU: collectives split into start/done), per async collective in execution
    order: its start and done names and the FFA calls scheduled between them (the kernels it can overlap)."""
    comps = parse_hlo(text)
    entry = comps.get("__entry__", [])
    result = []
    for i, ins in enumerate(entry):
        holds = _is_collective(ins) or any(_contains(comps, c, _is_collective) for c in ins["called"])
        if not (holds and ins["opcode"].endswith("-start")):
            continue
        for j in range(i + 1, len(entry)):
            if entry[j]["opcode"].endswith("-done") and ins["name"] in entry[j]["operands"]:
                between = [e["name"] for e in entry[i + 1:j]
                           if _is_ffa(e) or any(_contains(comps, c, _is_ffa) for c in e["called"])]
                result.append({"start": ins["name"], "done": entry[j]["name"], "ffa_between": between})
                break
    return result


def assert_packed_range_ops_equal_separate(k, v, g, init, ranges) -> None:
    """packed=True range ops against separate arrays, bitwise: the gather of k, v [L_in, ...] side by side
    in one buffer, the scatter-adds of g [L_out, 2, ...] from zero (float32) and into init (two arrays like
    k, v) reading one packed buffer."""
    out_len, in_len = g.shape[0], k.shape[0]
    (kv,) = jax.jit(lambda a, b: comm.range_gather([a, b], ranges, out_len, packed=True))(k, v)
    for j, want in enumerate(comm.range_gather([k, v], ranges, out_len)):
        np.testing.assert_array_equal(np.asarray(kv[:, j]), np.asarray(want))
    sums = jax.jit(lambda y: comm.range_scatter_add([y], ranges, in_len, out_dtype=np.float32, packed=True))(g)
    for got, want in zip(sums, comm.range_scatter_add([g[:, 0], g[:, 1]], ranges, in_len, out_dtype=np.float32)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    into = jax.jit(lambda y, a, b: comm.range_scatter_add([y], ranges, init=[a, b], packed=True))(g, *init)
    for got, want in zip(into, comm.range_scatter_add([g[:, 0], g[:, 1]], ranges, init=init)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
