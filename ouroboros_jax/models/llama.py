"""The Llama-family decoder (Llama 2/3, CodeLlama, Yi, DeepSeek-Coder, Mistral, Qwen2/3, Phi-3;
Gemma 2 / 3 through config flags: GeGLU, (1 + w) norms around attention and the MLP, q/k norms,
scaled embeddings, soft caps, per-layer sliding windows and RoPE bases) as one pure function over
a params pytree.

Letters (the model's part of the package glossary, `ouroboros_jax/__init__.py`):
    B batch rows          T new tokens of this forward     S cache slots
    L layers              H query heads                    K kv heads
    J query heads per kv head (H = K * J)                  D head dim
    E embed (hidden)      F ffn (intermediate; an expert's in an MoE layer)
    V vocab               Q positions whose logits `select` keeps
    Y experts             O routed rows: the B*T tokens' (token, expert) assignments, B*T*k
                          for k = experts_per_token

`forward(params, config, tokens[B,T], positions[B,T], mask[B,T,T], cache) -> (logits, NewKV)`.
Positions and the mask among the new tokens are inputs, so one function serves prefill, single
token decoding, Jacobi windows and verification trees alike. Every committed cache slot
`s < cache.lengths[b]` is visible to every new token of row b (the committed prefix is everyone's
ancestor); the forward never writes the cache (see kv_cache.commit). Attention reads only the
cache blocks below the longest row (models/attention.py), so its cost follows the live length.

Params (layers stacked on a leading L axis and scanned, so compile time does not grow with depth):
a dict {embed, final_norm, lm_head (unless embeddings are tied), layers: {attn_norm, wq, wk, wv,
wo, (qwen2: bq, bk, bv), (qwen3, gemma3: q_norm, k_norm), mlp_norm, (gemma: post_attn_norm,
post_mlp_norm), (olmoe: q_norm_all, k_norm_all), w_gate, w_up, w_down (a mixture of experts:
router [E,Y], we_gate, we_up [Y,E,F], we_down [Y,F,E] instead)}}; each leaf's shape, sharding
axes, HF name and layout and initializer are described once, in `params.LEAVES` (Phi-3's fused
qkv_proj / gate_up_proj are split into those leaves, `Family.hf_fused`). `forward` also takes
the packed layout decoding runs on a CPU (per-layer buffers, fused q/k/v and gate/up matmuls,
unrolled; `layout.py`): the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .attention import kernel_for_backend, live_block_count
from .config import ModelConfig
from .few_rows import LayerOf, at_applies
from .kv_cache import KVCache, NewKV
from .layout import STACKED, is_packed
from .quant import dense, linear, take
from .params import nest

Params = dict


# ------------------------------------------------------------------------------------ init
def param_shapes(config: ModelConfig) -> dict:
    """Shape of every parameter leaf of the config ({..., "layers": {...}}), from the one
    table of leaves (`params.LEAVES`)."""
    return nest(config, lambda leaf: leaf.shape(config))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32,
                std: float = 0.02) -> Params:
    """Random params, each leaf by its table initializer: normal(0, std) matrices, unit norms,
    zero biases. One key per leaf, split in the pytree's (sorted) leaf order."""
    leaves, treedef = jax.tree.flatten(nest(config, lambda leaf: leaf))
    keys = jax.random.split(key, len(leaves))
    out = []
    for leaf, k in zip(leaves, keys):
        shape = leaf.shape(config)
        if leaf.init == "ones":
            out.append(jnp.ones(shape, dtype))
        elif leaf.init == "zeros":
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((std * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------------ pieces
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """[..., E] -> [..., E]; statistics in fp32, as transformers computes them. unit_offset
    (Gemma): scales by (1 + weight), in fp32 before the cast back, as Gemma's RMSNorm does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def _norm(config: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """The config's RMSNorm of x [..., N] with weight [N]."""
    return rms_norm(x, weight, config.rms_norm_eps, config.norm_unit_offset)


def _act(config: ModelConfig, gate: jax.Array) -> jax.Array:
    """The MLP's gate activation: SiLU (SwiGLU) or tanh-approximate GELU (Gemma's GeGLU)."""
    if config.hidden_act == "gelu_pytorch_tanh":
        return jax.nn.gelu(gate, approximate=True)
    return jax.nn.silu(gate)


# The window of a global layer in a model whose layers differ: wider than any position, so
# `position - slot < window` always holds.
NO_WINDOW = 2**30


def layer_windows(config: ModelConfig) -> Optional[np.ndarray]:
    """int32[L] attention window per layer (NO_WINDOW on global layers) when the layers
    differ (Gemma's local/global layers, `config.sliding_layers`); None when every layer uses
    `config.sliding_window` (None or one width, Mistral)."""
    if config.sliding_layers is None:
        return None
    return np.array([config.sliding_window if s else NO_WINDOW for s in config.sliding_layers],
                    np.int32)


def layer_inv_freq(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies, [D/2] when every layer shares them, else [L, D/2]: Gemma 3's
    sliding layers rotate with their own unscaled base (`config.rope_local_theta`)."""
    inv = rope_inv_freq(config)
    if config.rope_local_theta is None:
        return inv
    local = rope_inv_freq(dataclasses.replace(config, rope_theta=config.rope_local_theta,
                                              rope_scaling=None))
    return np.stack([local if s else inv for s in config.sliding_layers])


def _of_layer(table, layer, rank: int):
    """Row `layer` (an int or traced int32[]) of a per-layer table, whose rows have `rank`
    dims; the table itself when it is shared by every layer (None or of that rank)."""
    if table is None or np.ndim(table) == rank:
        return table
    return jnp.asarray(table)[layer]


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [D/2] (fp32), with linear or llama3 scaling or a GGUF's per-frequency
    factors applied."""
    D = config.rotary_dim  # the head dim unless rotary embeddings are partial (Phi-3)
    inv = 1.0 / (config.rope_theta ** (np.arange(0, D, 2, dtype=np.float32) / D))
    sc = config.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if sc[0] == "linear":
        return (inv / sc[1]).astype(np.float32)
    if sc[0] in ("factors", "longrope"):  # divisors: a GGUF's rope_freqs, LongRoPE's short
        return (inv / np.asarray(sc[1], np.float32)).astype(np.float32)
    _, factor, lo, hi, orig = sc
    low_wavelen, high_wavelen = orig / lo, orig / hi
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (orig / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               scale: float = 1.0) -> jax.Array:
    """x [B,T,N,D], positions int[B,T] -> [B,T,N,D]; angles in fp32 (bf16 positions drift).
    Rotates the first 2 * len(inv_freq) dims (all unless partial, Phi-3), the rest pass;
    `scale` multiplies cos and sin (LongRoPE's attention factor)."""
    R = 2 * len(inv_freq)
    if R < x.shape[-1]:
        rot = apply_rope(x[..., :R], positions, inv_freq, scale)
        return jnp.concatenate([rot, x[..., R:]], axis=-1)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B,T,1,D]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _matmul_heads(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [B,T,E] @ w [E,N,D] -> [B,T,N,D], as one 2-D matmul over a [E, N*D] view of w (or
    w's codes and scales when it is quantized, `quant.linear`).

    The same product as einsum("bte,end->btnd"), but XLA:CPU runs the 3-D contraction far
    slower than the plain matrix product of the same weights (measured on SmolLM2-135M at
    T = 1, experiments/cpu_forward.py); a reshape of a contiguous weight costs nothing inside jit,
    so the parameter layout (sharding, loading, training) stays [E,N,D]."""
    return linear(h, w)


def _qkv(config: ModelConfig, h: jax.Array, lp: dict):
    """h [B,T,E] -> (q [B,T,H,D], k [B,T,K,D], v [B,T,K,D]) from one layer's params in either
    layout: three head-split matmuls (stacked) or one fused one (packed, layout.py)."""
    if "wqkv" not in lp:
        q, k, v = (_matmul_heads(h, lp[w]) for w in ("wq", "wk", "wv"))
        if config.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        return q, k, v
    B, T, _ = h.shape
    H, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = linear(h, lp["wqkv"])
    if config.qkv_bias:
        qkv = qkv + lp["bqkv"]
    return (qkv[..., :H * D].reshape(B, T, H, D), qkv[..., H * D:(H + K) * D].reshape(B, T, K, D),
            qkv[..., (H + K) * D:].reshape(B, T, K, D))


def _mlp(config: ModelConfig, h: jax.Array, lp: dict) -> jax.Array:
    """The SwiGLU MLP, h [B,T,E] -> [B,T,E], in either layout (gate and up fused when packed)."""
    if "w_gate_up" not in lp:
        gate, up = linear(h, lp["w_gate"]), linear(h, lp["w_up"])
        return linear(_act(config, gate) * up, lp["w_down"])
    F = config.intermediate_size
    gate_up = linear(h, lp["w_gate_up"])
    return linear(_act(config, gate_up[..., :F]) * gate_up[..., F:], lp["w_down"])


# ------------------------------------------------------------------------ mixture of experts
def route(config: ModelConfig, h: jax.Array, router: jax.Array):
    """The router of an MoE layer: h [N,E], router [E,Y] -> (experts int32[N,k], weights
    [N,k] in h's dtype), k = experts_per_token. As transformers: the logits in the params'
    dtype, their softmax in fp32, the top k (ties to the lower expert), renormalized to sum to
    1 when `norm_topk_prob`, cast back."""
    logits = h @ router
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, config.experts_per_token)
    if config.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights.astype(h.dtype)


def expert_groups(experts: jax.Array, num_experts: int):
    """How the grouped path lays out the routed rows. experts int32[N,k] ->
    (order int32[O]: the (token, k) assignments, flattened, sorted by expert (stable);
    slots int32[U]: the expert whose weights each group reads; sizes int32[U]: each group's
    rows), O = N*k. Group u's rows are order[sum(sizes[:u]) : sum(sizes[:u+1])].

    With fewer rows than experts (O < Y: decoding and short verifications), U = O and the slots
    are the distinct routed experts ascending, then `num_experts` (no expert, zero rows) in the
    slots left over, so that only routed experts are gathered (`_moe_grouped`). Otherwise U = Y
    and slot u is expert u (zero rows where none routes to it)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[flat].add(1)
    if flat.shape[0] >= num_experts:
        return order, jnp.arange(num_experts, dtype=jnp.int32), counts[:num_experts]
    slots = jnp.unique(flat, size=flat.shape[0], fill_value=num_experts).astype(jnp.int32)
    return order, slots, counts[slots]


def _swiglu_grouped(config: ModelConfig, xs: jax.Array, sizes: jax.Array, w_gate: jax.Array,
                    w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """xs [O,E] in groups of `sizes` int32[U] consecutive rows, group u through expert u's
    SwiGLU (w_gate, w_up [U,E,F], w_down [U,F,E]) -> [O,E]; each expert's weights read once."""
    gate = jax.lax.ragged_dot(xs, w_gate, sizes)
    up = jax.lax.ragged_dot(xs, w_up, sizes)
    return jax.lax.ragged_dot(_act(config, gate) * up, w_down, sizes)


def _moe_grouped(config: ModelConfig, h: jax.Array, experts: jax.Array, weights: jax.Array,
                 lp: dict) -> jax.Array:
    """h [N,E] through its routed experts, grouped: the N*k (token, expert) rows sorted by
    expert and multiplied with their expert's weights by `ragged_dot`, one group per expert
    (`expert_groups`); the rows put back in token order and summed with their router weights.
    experts int32[N,k], weights [N,k] -> [N,E].

    Which weights are read: with fewer rows than experts, each distinct routed expert's are
    gathered once (the slots left over gather zeros, `mode="fill"`, reading nothing) and an
    unrouted expert's never, on every backend. With more, all Y go to `ragged_dot` with zero
    rows for the unrouted: on GPU and TPU that is XLA's ragged dot instruction, whose cost for
    an empty group is the backend's; on CPU jax lowers it to a masked dense product that
    multiplies every group (so there the grouped path saves reads only below Y rows)."""
    N, k = experts.shape
    Y = config.num_experts
    order, slots, sizes = expert_groups(experts, Y)
    xs = h[order // k]  # [O,E]: row r is token order[r] // k
    w = [lp[n] for n in ("we_gate", "we_up", "we_down")]
    if slots.shape[0] < Y:  # fewer rows than experts: gather the routed ones, each once
        w = [take(a, slots, axis=0) for a in w]
    w = [dense(a) for a in w]  # quantized experts: the gathered ones dequantized here
    ys = _swiglu_grouped(config, xs, sizes, *w)  # [O,E], sorted by expert
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    ys = ys[back].reshape(N, k, -1)  # token order: [N,k,E]
    return jnp.einsum("nk,nke->ne", weights, ys)


def _moe_onehot(config: ModelConfig, h: jax.Array, experts: jax.Array, weights: jax.Array,
                lp: dict) -> jax.Array:
    """The reference: every expert on every token, h [N,E] -> [N,Y,E], summed with the router
    weights of the routed ones (zero elsewhere) -> [N,E]. Reads every expert's weights
    whatever the routing."""
    gate = jnp.einsum("ne,yef->nyf", h, dense(lp["we_gate"]))
    up = jnp.einsum("ne,yef->nyf", h, dense(lp["we_up"]))
    ys = jnp.einsum("nyf,yfe->nye", _act(config, gate) * up, dense(lp["we_down"]))
    combine = jnp.einsum("nk,nky->ny", weights,
                         jax.nn.one_hot(experts, config.num_experts, dtype=weights.dtype))
    return jnp.einsum("ny,nye->ne", combine, ys)


def _moe(config: ModelConfig, h: jax.Array, lp: dict) -> jax.Array:
    """A mixture-of-experts MLP, h [B,T,E] -> [B,T,E]: each token through its top-k experts
    (`route`), by `config.moe_dispatch`'s path; either layout (expert leaves are not fused)."""
    B, T, E = h.shape
    flat = h.reshape(B * T, E)
    experts, weights = route(config, flat, lp["router"])
    run = _moe_grouped if config.moe_dispatch == "grouped" else _moe_onehot
    return run(config, flat, experts, weights, lp).reshape(B, T, E)


def _norm_across_heads(config: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """OLMoE's q / k norm: x [B,T,N,D] normalized over all N*D values at once, weight [N,D]."""
    B, T, N, D = x.shape
    return _norm(config, x.reshape(B, T, N * D), weight.reshape(N * D)).reshape(B, T, N, D)


def _layer(config: ModelConfig, inv_freq, kernel, x, lp, layer, positions, mask, cache,
           live_blocks):
    """One decoder layer, its params in either layout. x [B,T,E] -> (x [B,T,E],
    k [B,T,K,D], v [B,T,K,D])."""
    h = _norm(config, x, lp["attn_norm"])
    q, k, v = _qkv(config, h, lp)
    if config.qk_norm:  # per head, before RoPE (Qwen3; Gemma 3's with 1 + w)
        q, k = _norm(config, q, lp["q_norm"]), _norm(config, k, lp["k_norm"])
    if config.qk_norm_across_heads:  # OLMoE: over all heads, before RoPE
        q = _norm_across_heads(config, q, lp["q_norm_all"])
        k = _norm_across_heads(config, k, lp["k_norm_all"])
    inv_freq = _of_layer(inv_freq, layer, 1)
    q = apply_rope(q, positions, inv_freq, config.rope_attention_scale)
    k = apply_rope(k, positions, inv_freq, config.rope_attention_scale)
    ck, cv, clen = (None, None, None) if cache is None else (cache.k, cache.v, cache.lengths)
    window = _of_layer(layer_windows(config), layer, 0)
    a = kernel(q, k, v, positions, mask, ck, cv, clen, layer,
               config.sliding_window if window is None else window, live_blocks=live_blocks,
               **_attention_kwargs(config))
    B, T, H, D = a.shape
    a = linear(a.reshape(B, T, H * D), lp["wo"].reshape(H * D, -1))  # packed wo is [H*D, E]
    if config.sandwich_norms:
        a = _norm(config, a, lp["post_attn_norm"])
    x = x + a
    h = _norm(config, x, lp["mlp_norm"])
    m = _moe(config, h, lp) if config.is_moe else _mlp(config, h, lp)
    if config.sandwich_norms:
        m = _norm(config, m, lp["post_mlp_norm"])
    return x + m, k, v


def _attention_kwargs(config: ModelConfig) -> dict:
    """The kernel's optional score scale and soft cap, where the config sets them."""
    kw = {}
    if config.query_pre_attn_scalar is not None:
        kw["scale"] = config.query_pre_attn_scalar ** -0.5
    if config.attn_softcap is not None:
        kw["softcap"] = config.attn_softcap
    return kw


def embed_tokens(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens int[B,T] -> [B,T,E] in the params' dtype; Gemma multiplies by sqrt(E), the
    normalizer rounded to fp32 and then to the params' dtype as transformers does."""
    dtype = params["embed"].dtype
    x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)
    if config.embed_scale:
        x = x * jnp.asarray(np.float32(math.sqrt(config.hidden_size))).astype(dtype)
    return x


def softcap(x: jax.Array, cap: Optional[float]) -> jax.Array:
    """cap * tanh(x / cap) (identity for cap None)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


# a layer's product weights (either canonical form: split q/k/v, gate/up); its other leaves
# (norms, biases) are vectors
PRODUCTS = frozenset(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
VECTORS = frozenset(("attn_norm", "mlp_norm", "bq", "bk", "bv", "post_attn_norm",
                     "post_mlp_norm", "q_norm", "k_norm", "q_norm_all", "k_norm_all"))


def scans_in_place(params: Params, config: ModelConfig, rows: int, dtype) -> bool:
    """Whether a forward of `rows` tokens (B*T) on packed params scans its layers over the
    stacked leaves (`layout.STACKED`, a CPU's views) instead of unrolling them: every product
    weight has a kernel form reading one layer in place at these rows (`few_rows.at_applies`:
    2-16 rows in float32, 1-64 for the int8 and w8a8 forms), and every other leaf is a known
    vector. A dense model only (an MoE's experts are not products of that kind)."""
    stacked = params.get(STACKED)
    if stacked is None or config.is_moe or not set(stacked) <= PRODUCTS | VECTORS:
        return False
    return all(at_applies(stacked[name], rows, dtype) for name in stacked if name in PRODUCTS)


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            mask: jax.Array, cache: Optional[KVCache] = None,
            select: Optional[jax.Array] = None) -> tuple[jax.Array, NewKV]:
    """Logits of T new tokens given the committed cache.

    tokens int32[B,T]; positions int32[B,T] (absolute, = cache slot the token would occupy);
    mask bool[B,T,T], mask[b,i,j]: new token i attends to new token j (include i == j);
    cache: KVCache or None (no prefix). select: optional int32[B,Q] picking which of the T
    hidden states go through the LM head (prefill needs only the last one).
    Returns (logits float32[B,T,V] or [B,Q,V], NewKV with k, v [L,B,T,K,D]).
    """
    if cache is not None and cache.pending is not None:
        raise ValueError("the cache has writes pending: pass kv_cache.settle(cache), and keep "
                         "the settled cache for the commit that follows")
    inv_freq = layer_inv_freq(config)
    x = embed_tokens(params, config, tokens)

    kernel = kernel_for_backend()
    # the trip count over cache blocks, once for all layers
    live = None if cache is None else live_block_count(cache.lengths, cache.num_slots)

    def step(x, xs):
        lp, layer = xs
        x, k, v = _layer(config, inv_freq, kernel, x, lp, layer, positions, mask, cache, live)
        return x, (k, v)

    rows = tokens.shape[0] * tokens.shape[1]
    if is_packed(params) and scans_in_place(params, config, rows, x.dtype):
        # every product of a layer has a kernel that reads the layer where it lies in the
        # stack (few_rows.LayerOf): the layers are scanned, so the program holds one layer's
        # code and compiles (and loads from the compile cache) in the time of one; norms and
        # biases, a few KB, are sliced
        stacked = params[STACKED]

        def step_in_place(x, layer):
            lp = {name: (LayerOf(a, layer) if name in PRODUCTS else
                         jax.lax.dynamic_index_in_dim(a, layer, keepdims=False))
                  for name, a in stacked.items()}
            return step(x, (lp, layer))

        x, (ks, vs) = jax.lax.scan(step_in_place, x,
                                   jnp.arange(config.num_layers, dtype=jnp.int32))
        head = params["head_t"] if "head_t" in params else None
    elif is_packed(params):
        # one buffer per layer (models/layout.py): unrolled, each matmul reads its weights
        # where they lie instead of a scan's copy of them out of the stack. Each layer is one
        # nested jit of the same function, so layers of one shape are traced once (XLA inlines
        # the calls: the same program)
        ks, vs = [], []
        layer_step = jax.jit(step)
        for i, lp in enumerate(params["layers"]):
            x, (k, v) = layer_step(x, (lp, jnp.int32(i)))
            ks.append(k)
            vs.append(v)
        ks, vs = jnp.stack(ks), jnp.stack(vs)
        # a tied model's views (layout.view_pack) keep no transposed copy of the embedding
        head = params["head_t"] if "head_t" in params else None
    else:
        # the cache is not scanned over: each layer's kernel reads its own live blocks from it
        layers = jnp.arange(config.num_layers, dtype=jnp.int32)
        x, (ks, vs) = jax.lax.scan(step, x, (params["layers"], layers))
        head = None if config.tie_word_embeddings else params["lm_head"]
    if select is not None:
        x = jnp.take_along_axis(x, select[..., None], axis=1)
    x = _norm(config, x, params["final_norm"])
    if head is None:  # tied: contract with the embedding's own rows. `x @ embed.T` lowers on
        # XLA:CPU to a transposed copy of the [V, E] table in every forward (~20% of a 0.5B's)
        logits = jnp.einsum("...e,ve->...v", x, params["embed"],
                            preferred_element_type=jnp.float32)
    else:
        logits = linear(x, head, out_dtype=jnp.float32)
    return softcap(logits, config.final_softcap), NewKV(k=ks, v=vs)


def causal_mask(batch: int, length: int) -> jax.Array:
    """bool[B,T,T] lower-triangular mask for a plain causal chain."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
