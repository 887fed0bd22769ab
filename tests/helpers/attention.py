"""Shared by the attention tests: a padded and packed batch's segments and positions, dense
attention over an explicit mask (the oracle of the masks), and the error measure."""

import jax
import jax.numpy as jnp
import numpy as np

from rlx.kernels.attention import attention_mask, gqa_attention

TOL = 1e-5  # float32 outputs; gradients relative to their largest entry


def batch(b, t, pad, packed, seed=0):
    """Segments and positions: row 0 left-padded by ``pad``, row 1 two packed sequences."""
    seg = np.ones((b, t), np.int32)
    pos = np.tile(np.arange(t), (b, 1))
    seg[0, :pad] = 0
    pos[0] = np.maximum(np.arange(t) - pad, 0)
    if packed:
        cut = t // 3
        seg[1, cut:] = 2
        pos[1, cut:] = np.arange(t - cut)
    return jnp.asarray(seg), jnp.asarray(pos)


def dense(q, k, v, seg, pos, window=None, sinks=None):
    t, (h, d), kv = q.shape[1], q.shape[2:], k.shape[2]
    mask = attention_mask(seg, seg, pos, pos) & (jnp.arange(t)[None, :] <= jnp.arange(t)[:, None])
    if window is not None:
        mask &= pos[:, :, None] - pos[:, None, :] < window
    if sinks is None:
        return gqa_attention(q, k, v, mask)
    kk, vv = jnp.repeat(k, h // kv, axis=2), jnp.repeat(v, h // kv, axis=2)
    s = jnp.where(mask[:, None], jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(d), -1e30)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1)[..., :-1], vv)


def errors(fn, ref, args, seg):
    """(max |out - ref| over real tokens, max relative gradient error) of ``fn`` vs ``ref``."""
    real = (seg != 0)[:, :, None, None]
    fn, ref = jax.jit(fn), jax.jit(ref)
    w = jax.random.normal(jax.random.key(9), ref(*args).shape) * real
    out_err = float(jnp.abs((fn(*args) - ref(*args)) * real).max())
    idx = tuple(range(len(args)))
    g_fn = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * w), idx))(*args)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * w), idx))(*args)
    grad_err = max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(g_fn, g_ref))
    return out_err, grad_err
