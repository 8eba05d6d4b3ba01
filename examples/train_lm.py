"""A small decoder-only language model trained with magi_jax distributed attention on a (dp, cp) mesh.

Every sequence of every step packs new synthetic documents (new lengths, so its own varlen causal mask and
plan): each is an arithmetic progression modulo the vocabulary with its own random start and step, so
predicting the next token needs the document's earlier tokens (attention) and nothing from other documents.
The batch's plans travel as an argument of the jitted step (magi_jax.plan_tables of one plan per sequence,
padded to one magi_jax.PlanCapacity), so every batch runs the same compiled step. Everything runs in
dispatched order: tokens, labels and RoPE positions (magi_jax.position_ids) are dispatched once per step,
and the attention of every layer is magi_jax.calc_attn on the (dp, cp) mesh: batch over dp, tokens over cp.
Each layer is rematerialised in the backward pass except its attention output (magi_jax.CHECKPOINT_NAMES).
One jitted step (forward, backward, Adam); the loss falls from ln(vocab). --qk-clip TAU adds QK-clip (as
MuonClip): the attention returns each q head's largest logit of the step (return_max_logit), and after the
update every head whose largest logit passed TAU has its W_q scaled by TAU / that logit (its logits scale
alike; W_k is shared by a group of q heads, so it is left as it is).

    python examples/train_lm.py                 # 8 CPU devices (dp 2 x cp 4) unless GPUs are present
    python examples/train_lm.py --steps 300 --cp 2 --dp 1
    python examples/train_lm.py --qk-clip 5   # with QK-clip at 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Eight host devices for the CPU run; only the CPU platform reads this flag, so GPU runs are unaffected.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import magi_jax as mj  # noqa: E402
from magi_jax.planner.cli import int_at_least  # noqa: E402


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


# Tokens per planner chunk on each platform.
CHUNK_SIZE = {"cpu": 64, "gpu": 512}


def document_lengths(total: int, mean: int, seed: int | list[int]) -> list[int]:
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < total:
        lens.append(int(min(total - sum(lens), max(8, rng.exponential(mean)))))
    return lens


def make_batch(rng: np.random.Generator, packings: list[list[int]], vocab: int):
    """Token ids [B, T], next-token labels [B, T] and loss weights [B, T] (0 on each document's last token);
    sequence b packs documents of the lengths packings[b]."""
    batch, T = len(packings), sum(packings[0])
    tokens = np.empty((batch, T), np.int32)
    weights = np.ones((batch, T), np.float32)
    for b in range(batch):
        s = 0
        for n in packings[b]:
            start, step = rng.integers(0, vocab), rng.integers(1, vocab)
            tokens[b, s:s + n] = (start + step * np.arange(n)) % vocab
            weights[b, s + n - 1] = 0.0
            s += n
    labels = np.roll(tokens, -1, axis=1)
    return tokens, labels, weights


def init_params(key, vocab: int, width: int, layers: int, heads: int, kv_heads: int, head_dim: int):
    def dense(key, fan_in, fan_out):
        return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
    keys = iter(jax.random.split(key, 2 + 6 * layers))
    params = {"embed": jax.random.normal(next(keys), (vocab, width), jnp.float32) * 0.02,
              "head": dense(next(keys), width, vocab), "layers": []}
    for _ in range(layers):
        params["layers"].append({
            "wq": dense(next(keys), width, heads * head_dim), "wk": dense(next(keys), width, kv_heads * head_dim),
            "wv": dense(next(keys), width, kv_heads * head_dim), "wo": dense(next(keys), heads * head_dim, width),
            "w1": dense(next(keys), width, 4 * width), "w2": dense(next(keys), 4 * width, width),
            "norm1": jnp.ones(width), "norm2": jnp.ones(width)})
    params["norm"] = jnp.ones(width)
    return params


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def rope(x, positions):
    """Rotary embedding of x [B, T, H, D] at integer positions [B, T] (RoPE is relative: global positions of
    packed documents work as well as per-document ones)."""
    d = x.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = positions.astype(jnp.float32)[..., None] * freq
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    x1, x2 = x[..., : d // 2].astype(jnp.float32), x[..., d // 2:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def block(x, layer, positions, plan, cfg):
    """One decoder layer on the residual stream x [B, T, width], and the largest logit of each q head [Hq]
    (with --qk-clip; else None)."""
    B, T, _ = x.shape
    h = rms_norm(x, layer["norm1"]).astype(cfg.dtype)
    q = (h @ layer["wq"].astype(cfg.dtype)).reshape(B, T, cfg.heads, cfg.head_dim)
    k = (h @ layer["wk"].astype(cfg.dtype)).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    v = (h @ layer["wv"].astype(cfg.dtype)).reshape(B, T, cfg.kv_heads, cfg.head_dim)
    q, k = rope(q, positions), rope(k, positions)
    attn, _, *max_logit = mj.calc_attn(q, k, v, plan, return_max_logit=cfg.qk_clip is not None)
    x = x + (attn.reshape(B, T, -1) @ layer["wo"].astype(cfg.dtype)).astype(jnp.float32)
    h = rms_norm(x, layer["norm2"]).astype(cfg.dtype)
    x = x + (jax.nn.gelu(h @ layer["w1"].astype(cfg.dtype)) @ layer["w2"].astype(cfg.dtype)).astype(jnp.float32)
    return x, jnp.max(max_logit[0], axis=0) if max_logit else None   # over the batch


# Long-context training keeps few activations: each layer is recomputed in the backward pass except the
# attention's out and lse, saved by name, so the attention forward (and its key fetch) runs once per step.
remat_block = jax.checkpoint(block, static_argnums=(4,),
                             policy=jax.checkpoint_policies.save_only_these_names(*mj.CHECKPOINT_NAMES))


def forward(params, tokens, positions, plan, cfg):
    """Logits [B, T, vocab] of dispatched tokens [B, T], and each layer's largest logit per q head (a list)."""
    x = params["embed"][tokens]
    max_logits = []
    for layer in params["layers"]:
        x, max_logit = remat_block(x, layer, positions, plan, cfg)
        max_logits.append(max_logit)
    return rms_norm(x, params["norm"]) @ params["head"], max_logits


def make_step(cfg, lr: float):
    def loss_fn(params, tokens, labels, weights, plan):
        logits, max_logits = forward(params, tokens, mj.position_ids(plan), plan, cfg)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weights) / jnp.sum(weights), max_logits

    def qk_clip(layer, max_logit):
        """W_q of every q head whose largest logit passed cfg.qk_clip scaled by qk_clip / that logit."""
        factor = jnp.where(max_logit > cfg.qk_clip, cfg.qk_clip / max_logit, 1.0)
        wq = layer["wq"].reshape(-1, cfg.heads, cfg.head_dim) * factor[None, :, None]
        return {**layer, "wq": wq.reshape(layer["wq"].shape)}

    @jax.jit
    def step(params, opt, tokens, labels, weights, plan):
        (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, labels, weights, plan)
        t = opt["t"] + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, opt["m"], grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["v"], grads)
        scale = lr * jnp.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + 1e-8), params, m, v)
        if cfg.qk_clip is None:
            return params, {"t": t, "m": m, "v": v}, loss, jnp.nan
        params["layers"] = [qk_clip(layer, x) for layer, x in zip(params["layers"], max_logits)]
        largest = jnp.max(jnp.stack(max_logits)) if max_logits else -jnp.inf
        return params, {"t": t, "m": m, "v": v}, loss, largest
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int_at_least(1), default=200)
    ap.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto")
    ap.add_argument("--dp", type=int_at_least(1), default=None,
                    help="data-parallel size (default: 2 if the devices allow, else 1)")
    ap.add_argument("--cp", type=int_at_least(1), default=None,
                    help="context-parallel size (default: 4 of 8 CPU devices, half of 4 or more GPUs)")
    # 2 tokens at least: a document's last token predicts nothing (weight 0), so 1 would leave no loss.
    ap.add_argument("--seqlen", type=int_at_least(2), default=None,
                    help=f"tokens per sequence (default: 1024 CPU, 16384 GPU); at least 2 and more than (cp - 1) x "
                         f"the chunk size ({CHUNK_SIZE['cpu']} CPU, {CHUNK_SIZE['gpu']} GPU), so that every cp rank "
                         f"gets a chunk")
    ap.add_argument("--layers", type=int_at_least(0), default=2)
    ap.add_argument("--width", type=int_at_least(1), default=None, help="model width (default: 128 CPU, 512 GPU)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qk-clip", type=positive_float, default=None, metavar="TAU",
                    help="QK-clip: scale W_q of the q heads whose largest logit passed TAU (default: off)")
    args = ap.parse_args(argv)

    platform = args.platform
    if platform == "auto":
        platform = "gpu" if any(d.platform == "gpu" for d in jax.devices()) else "cpu"
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        ap.error(f"--platform {platform}: no {platform} devices on this host (it has "
                 f"{', '.join(sorted({d.platform for d in jax.devices()}))})")
    n = len(devices)
    cp = args.cp if args.cp is not None else 4 if platform == "cpu" and n >= 8 else max(1, n // 2) if n >= 4 else n
    dp = args.dp if args.dp is not None else max(1, min(2, n // cp))
    if dp * cp > n:
        ap.error(f"--dp {dp} x --cp {cp} needs {dp * cp} {platform} devices, have {n}")
    on_gpu = platform == "gpu"

    class cfg:
        vocab = 64
        heads, kv_heads, head_dim = (8, 2, 128) if on_gpu else (4, 2, 64)
        dtype = jnp.bfloat16 if on_gpu else jnp.float32
        qk_clip = args.qk_clip
    width = args.width if args.width is not None else 512 if on_gpu else 128
    seqlen = args.seqlen if args.seqlen is not None else 16384 if on_gpu else 1024
    chunk_size = CHUNK_SIZE[platform]
    # The planner gives each cp rank whole chunks (the last one padded), so it needs at least cp of them.
    if seqlen <= (cp - 1) * chunk_size:
        ap.error(f"--seqlen {seqlen}: must be more than (cp - 1) x chunk size = {(cp - 1) * chunk_size} tokens "
                 f"for cp {cp} (chunk size {chunk_size} on {platform})")

    mesh = Mesh(np.array(devices[:dp * cp]).reshape(dp, cp), ("dp", "cp"))

    def packing(i: int) -> tuple[list[int], mj.MeshPlan]:
        """The document lengths of sequence i (of all steps) and their plan (one overlap stage for every
        mask). Sequence b of step s is i = s * dp + b."""
        lengths = document_lengths(seqlen, mean=max(32, seqlen // 12), seed=[args.seed, i])
        plan = mj.plan(mj.masks.varlen_causal(lengths), mesh, axis="cp", num_heads_q=cfg.heads,
                       num_heads_kv=cfg.kv_heads, head_dim=cfg.head_dim, chunk_size=chunk_size,
                       overlap=1)
        return lengths, plan

    # Capacity for the plans of the first 32 packings and half as much again; a later packing that needs
    # more grows it (and the step compiles once more).
    capacity = mj.PlanCapacity.of([packing(i)[1] for i in range(32)], headroom=1.5)
    lengths, plan = packing(0)
    print(f"{dp * cp} x {devices[0].device_kind}: mesh dp {dp} x cp {cp}; {dp} sequence{'s' * (dp > 1)} of {seqlen} tokens of "
          f"new documents every step (the first: {len(lengths)}, {plan!r}); {capacity}")

    params = init_params(jax.random.key(args.seed), cfg.vocab, width, args.layers, cfg.heads, cfg.kv_heads,
                         cfg.head_dim)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt = jax.device_put({"t": jnp.zeros((), jnp.int32), "m": jax.tree.map(jnp.zeros_like, params),
                          "v": jax.tree.map(jnp.zeros_like, params)}, replicated)
    step = make_step(cfg, args.lr)
    dispatch = jax.jit(lambda plan, *xs: tuple(mj.dispatch(x, plan, seq_dim=1) for x in xs))

    rng = np.random.default_rng(args.seed + 1)
    losses, seconds = [], []
    batch = [packing(b) for b in range(dp)]
    for i in range(args.steps):
        start = time.perf_counter()
        plans = [plan for _, plan in batch]
        try:
            tables = mj.plan_tables(plans, capacity)
        except ValueError:
            capacity = mj.PlanCapacity.of([capacity, *plans], headroom=1.25)
            print(f"step {i}: capacity grown to {capacity}")
            tables = mj.plan_tables(plans, capacity)
        tokens, labels, weights = dispatch(tables, *make_batch(rng, [lengths for lengths, _ in batch], cfg.vocab))
        params, opt, loss, max_logit = step(params, opt, tokens, labels, weights, tables)
        batch = [packing((i + 1) * dp + b) for b in range(dp)]   # planned while the device runs this step
        losses.append(float(loss))       # waits for the step: seconds below are whole steps, planning included
        seconds.append(time.perf_counter() - start)
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            clip = "" if args.qk_clip is None else f"  largest logit {float(max_logit):.3f} (clip {args.qk_clip})"
            print(f"step {i:4d}  loss {losses[-1]:.4f}{clip}", flush=True)
    k = max(1, min(5, args.steps // 4))
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps ({np.median(seconds) * 1e3:.1f} ms per step, "
          f"median, planning included; ln(vocab) = {np.log(cfg.vocab):.3f}); compiled {step._cache_size()} time(s)")
    if args.steps >= 4 and not last < first:
        print("train_lm: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
