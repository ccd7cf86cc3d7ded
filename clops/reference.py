"""Float64 numpy reference of every clops op, written from the formulas.

Inputs are any array-likes; results are float64 numpy arrays. Shapes and
argument names follow the device API (``clops/__init__.py``).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .args import finite_float, positive_int


def _f64(*arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def sigmoid(x):
    """σ(x) from e = exp(−|x|): no overflow, and no cancellation in either tail (0.5·(1 + tanh(x/2))
    loses σ's digits for x ≲ −20 and gives 0 from x ≈ −37)."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


# ---- elementwise ----

def swiglu(a, b):
    a, b = _f64(a, b)
    return a * sigmoid(a) * b


def swiglu_bwd(a, b, dc):
    a, b, dc = _f64(a, b, dc)
    s = sigmoid(a)
    return dc * b * s * (1.0 + a * sigmoid(-a)), dc * a * s


def swiglu_limit(a, b, *, limit, scale=1.0, row_weight=None):
    a, b = _f64(a, b)
    if limit > 0:
        a, b = np.minimum(a, limit), np.clip(b, -limit, limit)
    c = scale * a * sigmoid(a) * b
    if row_weight is not None:
        c = c * np.asarray(row_weight, dtype=np.float64)[:, None]
    return c


def swiglu_gated(a, b, gate):
    return swiglu(a, b) * np.asarray(gate, dtype=np.float64)


def swiglu_gated_bwd(a, b, gate, dc):
    return swiglu_bwd(a, b, np.asarray(dc, dtype=np.float64) * np.asarray(gate, dtype=np.float64))


def sigmoid_gate(a, b):
    a, b = _f64(a, b)
    return a * sigmoid(b)


def sigmoid_gate_bwd(a, b, dc):
    a, b, dc = _f64(a, b, dc)
    s = sigmoid(b)
    return dc * s, dc * a * s * sigmoid(-b)  # σ(−b), not 1 − σ(b): no cancellation in the tail


def add(a, b):
    a, b = _f64(a, b)
    return a + b


# ---- RMSNorm ----

def _gain(w, gemma):
    w = np.asarray(w, dtype=np.float64)
    return 1.0 + w if gemma else w


def _inv_rms(x, eps):
    """1/sqrt(mean(x²) + eps) over the last axis, the squares taken of x·2^−e (e the exponent of the row's
    largest |x|; powers of two are exact), so that no row of float64 leaves float64's range in the squares
    (#19: a float32 row's squares leave float32's; the reference must not lose them either)."""
    m = np.max(np.abs(x), axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1])
    sc = np.ldexp(1.0, -np.frexp(np.where(np.isfinite(m) & (m > 0), m, 1.0))[1])  # 2^−e, 1 for rows of 0
    xs = x * sc[..., None]
    with np.errstate(over="ignore", divide="ignore"):
        z = eps * sc * sc  # inf only where the mean square is negligible beside eps
        return np.where(np.isinf(z), 1.0 / np.sqrt(eps), sc / np.sqrt(np.mean(xs * xs, axis=-1) + z))


def rms_norm(x, w, *, eps=1e-6, gemma=False):
    """(y, inv): y = x·inv·w_eff over the last axis, inv = 1/sqrt(mean(x²) + eps)."""
    (x,) = _f64(x)
    inv = _inv_rms(x, eps)
    return x * inv[..., None] * _gain(w, gemma), inv


def rms_norm_bwd(x, w, inv, dy, *, gemma=False):
    """dx = inv·w·dy − x·inv³/d·Σ dy·w·x, as inv·(w·dy − x̂/d·Σ dy·w·x̂) with x̂ = x·inv (no x², no inv³)."""
    x, inv, dy = _f64(x, inv, dy)
    we = _gain(w, gemma)
    d = x.shape[-1]
    xh = x * inv[..., None]
    coef = np.sum(dy * we * xh, axis=-1) / d
    return inv[..., None] * (we * dy - xh * coef[..., None])


def rms_norm_dw(x, inv, dy):
    """Σ_rows dy·x·inv (as dy·(x·inv))."""
    x, inv, dy = _f64(x, inv, dy)
    return np.sum((dy * (x * inv[..., None])).reshape(-1, x.shape[-1]), axis=0)


def add_rms_norm(a, b, w, *, eps=1e-6, gemma=False):
    """(s, y, inv): s = a + b, then rms_norm of s (of the exact sum)."""
    a, b = _f64(a, b)
    s = a + b
    return (s, *rms_norm(s, w, eps=eps, gemma=gemma))


def add_rms_norm_bwd(s, w, inv, dy, ds, *, gemma=False):
    """(dx, dw): dx = ds + rms_norm_bwd(s, w, inv, dy), dw = rms_norm_dw(s, inv, dy)."""
    return np.asarray(ds, dtype=np.float64) + rms_norm_bwd(s, w, inv, dy, gemma=gemma), rms_norm_dw(s, inv, dy)


# ---- q/k RMSNorm + partial RoPE ----

def rope_table(window, rotary_half, *, theta=1e7):
    """[window, half, 2] (cos, sin) of pos·theta^(−2i/(2·half)), float32."""
    window = positive_int("window", window)
    rotary_half = positive_int("rotary_half", rotary_half, zero_ok=True)
    if not finite_float("theta", theta) > 0:
        raise ValueError(f"theta: must be positive, got {theta}")
    if rotary_half == 0:
        return np.zeros((window, 0, 2), np.float32)
    inv_freq = 1.0 / theta ** (2.0 * np.arange(rotary_half) / (2 * rotary_half))
    ang = np.arange(window)[:, None] * inv_freq[None, :]
    return np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)


def _rotate(y, rope, cu_seqlens, inverse):
    """Half-split rotation of the first 2·half dims of y [n, heads, hd] by position: row mod len(rope), or
    the row's offset in its sequence of ``cu_seqlens``."""
    half = rope.shape[1]
    if half == 0:
        return y
    rope = np.asarray(rope, dtype=np.float64)
    n = y.shape[0]
    if cu_seqlens is None:
        pos = np.arange(n) % len(rope)
    else:
        pos = np.concatenate([np.arange(b - a) for a, b in _sequences(n, None, cu_seqlens)])
    cos, sin = rope[pos, :, 0][:, None, :], rope[pos, :, 1][:, None, :]
    if inverse:
        sin = -sin
    lo, hi = y[..., :half].copy(), y[..., half:2 * half].copy()
    y = y.copy()
    y[..., :half] = lo * cos - hi * sin
    y[..., half:2 * half] = lo * sin + hi * cos
    return y


def qk_norm_rope(x, w, rope, *, eps=1e-6, gemma=True, cu_seqlens=None):
    """(y, inv) for x [n, heads, hd]: per-head RMSNorm, then RoPE; the window is len(rope), or positions
    restart at each sequence of ``cu_seqlens``."""
    y, inv = rms_norm(x, w, eps=eps, gemma=gemma)
    return _rotate(y, rope, cu_seqlens, inverse=False), inv


def qk_norm_rope_bwd(x, w, inv, rope, dy, *, gemma=True, cu_seqlens=None):
    """(dx, dw): the inverse rotation of dy, then the RMSNorm backward; dw summed over rows and heads."""
    g = _rotate(np.asarray(dy, dtype=np.float64), rope, cu_seqlens, inverse=True)
    return rms_norm_bwd(x, w, inv, g, gemma=gemma), rms_norm_dw(x, inv, g)


# ---- grouped-query attention ----

def _windows(a, window):
    """[n, heads, hd] → [windows, heads, window, hd]."""
    n, heads, hd = a.shape
    return np.asarray(a, dtype=np.float64).reshape(n // window, window, heads, hd).transpose(0, 2, 1, 3)


def _tokens(a):
    """[windows, heads, window, hd] → [n, heads, hd]."""
    w, heads, t, hd = a.shape
    return a.transpose(0, 2, 1, 3).reshape(w * t, heads, hd)


def _expand(k, rep):
    return np.repeat(k, rep, axis=1)


def attention_mask(t, *, causal=True, sliding_window=None):
    """[t, t] bool: query i (row) sees key j (column) of its window or sequence."""
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    seen = j <= i if causal else np.ones((t, t), bool)
    if sliding_window is not None:
        seen &= np.abs(i - j) < sliding_window
    return seen


def _sequences(n, window, cu_seqlens):
    """[(start, end)] of the windows (``window``) or sequences (``cu_seqlens``) of n tokens."""
    if cu_seqlens is None:
        return [(s, s + window) for s in range(0, n, window)]
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    return list(zip(cu[:-1], cu[1:]))


# The attention products are einsums with optimize=True: BLAS, where the plain einsum is C loops on one
# thread (minutes for one check of the bench's shapes, as clops tune makes).
def _scores(qw, kw, scale, softcap):
    """(scores, tanh of the scaled scores / softcap or None): q·k·scale, capped to c·tanh(s/c)."""
    s = np.einsum("bhqd,bhkd->bhqk", qw, kw, optimize=True) * scale
    if softcap is None:
        return s, None
    t = np.tanh(s / softcap)
    return softcap * t, t


def attention(q, k, v, *, window=None, cu_seqlens=None, causal=True, sliding_window=None, softcap=None, scale=None):
    """(o [n, nh, hd], lse [n, nh]): softmax attention inside each window (or sequence of
    ``cu_seqlens``), K/V shared by groups; ``lse`` is that of the (capped) scaled scores."""
    n, nh, hd = q.shape
    rep = nh // k.shape[1]
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    o, lse = np.zeros((n, nh, hd)), np.zeros((n, nh))
    for a, b in _sequences(n, window, cu_seqlens):
        if a == b:
            continue
        t = b - a
        qw, kw, vw = _windows(q[a:b], t), _expand(_windows(k[a:b], t), rep), _expand(_windows(v[a:b], t), rep)
        s, _ = _scores(qw, kw, scale, softcap)
        s = np.where(attention_mask(t, causal=causal, sliding_window=sliding_window), s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        o[a:b] = _tokens(np.einsum("bhqk,bhkd->bhqd", p / l, vw, optimize=True))
        lse[a:b] = (m + np.log(l))[0, :, :, 0].T
    return o, lse


def attention_bwd(q, k, v, o, lse, do, *, window=None, cu_seqlens=None, causal=True, sliding_window=None,
                  softcap=None, scale=None):
    """(dq, dk, dv); dk/dv summed over each group's query heads; the softcap differentiated through."""
    n, nh, hd = q.shape
    nkv = k.shape[1]
    rep = nh // nkv
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    dq, dk, dv = np.zeros((n, nh, hd)), np.zeros((n, nkv, hd)), np.zeros((n, nkv, hd))

    def group(x):
        b, _, t, d = x.shape
        return x.reshape(b, nkv, rep, t, d).sum(axis=2)

    for a, b in _sequences(n, window, cu_seqlens):
        if a == b:
            continue
        t = b - a
        qw, kw, vw = _windows(q[a:b], t), _expand(_windows(k[a:b], t), rep), _expand(_windows(v[a:b], t), rep)
        ow, dow = _windows(o[a:b], t), _windows(do[a:b], t)
        lse_w = np.asarray(lse[a:b], dtype=np.float64).T[None, :, :, None]
        s, tanh = _scores(qw, kw, scale, softcap)
        p = np.exp(np.where(attention_mask(t, causal=causal, sliding_window=sliding_window), s - lse_w, -np.inf))
        dp = np.einsum("bhqd,bhkd->bhqk", dow, vw, optimize=True)
        ds = p * (dp - np.sum(dow * ow, axis=-1, keepdims=True)) * scale
        if tanh is not None:
            ds *= 1 - tanh * tanh
        dq[a:b] = _tokens(np.einsum("bhqk,bhkd->bhqd", ds, kw, optimize=True))
        dk[a:b] = _tokens(group(np.einsum("bhqk,bhqd->bhkd", ds, qw, optimize=True)))
        dv[a:b] = _tokens(group(np.einsum("bhqk,bhqd->bhkd", p, dow, optimize=True)))
    return dq, dk, dv


# ---- test data and comparison ----

def rnd(shape, seed, scale=1.0):
    """Seeded float32 data, uniform in [−scale, scale) (the seed's tests' distribution)."""
    return np.random.default_rng(seed).uniform(-scale, scale, size=shape).astype(np.float32)


def ulp(x, dtype):
    """The spacing of ``dtype`` (float16, bfloat16, float32) at each |x| (x float64; subnormals: the
    smallest spacing)."""
    fi = ml_dtypes.finfo(dtype)
    x = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(x))  # −inf at 0: the subnormal spacing below
    return np.exp2(np.maximum(e, fi.minexp) - fi.nmant)


def ulps_off(got, want, dtype, scale=None):
    """Largest |got − round(want)| over ``dtype``'s spacing, where round(want) is ``want`` rounded once
    to ``dtype``; the spacing is taken at round(want), or at ``scale`` (an array broadcast against it:
    "relative to the row's scale") when given. Non-finite values must match exactly (NaN as NaN)."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want, dtype=np.float64).astype(dtype).astype(np.float64)
    finite = np.isfinite(want)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    if not same[~finite].all():
        return np.inf
    spacing = ulp(want if scale is None else np.broadcast_to(scale, want.shape), dtype)
    return float(np.max(np.abs(got - want)[finite] / spacing[finite], initial=0.0))


def rel_err(got, want):
    """Relative L2 error ‖got − want‖ / ‖want‖ in float64."""
    got, want = _f64(got, want)
    return float(np.sqrt(np.sum((got - want) ** 2) / max(np.sum(want * want), 1e-30)))


def _capped(logits, softcap):
    z = logits.astype(np.float64)
    return z if softcap is None else softcap * np.tanh(z / softcap)


def cross_entropy(logits, targets, ignore_index=-100, label_smoothing=0.0, softcap=None):
    """(loss, lse) per row, torch.nn.functional.cross_entropy's definition without reduction; a target
    outside [0, vocab) other than ignore_index gives NaN."""
    z = _capped(logits, softcap)
    m = z.max(1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(1))
    valid = (targets >= 0) & (targets < z.shape[1])
    picked = z[np.arange(len(z)), np.where(valid, targets, 0)]
    e = label_smoothing
    smooth = e * (lse - z.mean(1)) if e else 0.0  # torch's: no term at all without smoothing (z may hold −∞)
    loss = np.where(valid, (1 - e) * (lse - picked) + smooth, np.nan)
    return np.where(targets == ignore_index, 0.0, loss), lse


def cross_entropy_bwd(logits, targets, lse, dloss, ignore_index=-100, label_smoothing=0.0, softcap=None):
    """dlogits of :func:`cross_entropy` given dloss; 0 on ignored and out-of-range rows."""
    z = _capped(logits, softcap)
    n, vocab = z.shape
    valid = (targets != ignore_index) & (targets >= 0) & (targets < vocab)
    d = np.exp(z - np.asarray(lse, np.float64)[:, None]) - label_smoothing / vocab
    rows = np.flatnonzero(valid)
    d[rows, targets[rows]] -= 1 - label_smoothing
    if softcap is not None:
        d *= 1 - (z / softcap) ** 2
    return d * np.where(valid, dloss, 0.0)[:, None]


def adamw(p, g, m, v, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """(p, m, v) after one torch.optim.AdamW step, in float64."""
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g, m, v))
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1 ** step) * m / (np.sqrt(v) / np.sqrt(1 - beta2 ** step) + eps)
    return p, m, v


def embedding(table, ids):
    """table rows by id; zeros for ids outside [0, vocab)."""
    valid = (ids >= 0) & (ids < len(table))
    out = np.zeros((len(ids), table.shape[1]))
    out[valid] = table[ids[valid]]
    return out


def embedding_bwd(ids, dout, vocab):
    """dtable [vocab, d]: the dout rows summed by id (ids outside [0, vocab) dropped), in float64."""
    valid = (ids >= 0) & (ids < vocab)
    dtable = np.zeros((vocab, dout.shape[1]))
    np.add.at(dtable, ids[valid], dout[valid].astype(np.float64))
    return dtable

