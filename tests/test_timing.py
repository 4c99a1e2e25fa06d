"""models.timing: what a timed forward must compute."""

import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models.kv_cache import NewKV
from ouroboros_jax.models.timing import read_all


@pytest.mark.parametrize("part", ["logits", "k", "v"])
def test_a_timed_forward_reads_every_logit_and_every_new_kv(part):
    # a timer whose result ignored any of them would let XLA skip or refuse that work (the LM
    # head's columns, the new K/V's layout), and time a forward decoding never runs: so raising
    # any single element of any of the three must change what the timer accumulates
    rng = np.random.default_rng(0)
    shapes = {"logits": (1, 5, 11), "k": (2, 1, 5, 3, 4), "v": (2, 1, 5, 3, 4)}
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    base = float(read_all(jnp.asarray(arrays["logits"]),
                          NewKV(k=jnp.asarray(arrays["k"]), v=jnp.asarray(arrays["v"]))))
    for flat in range(0, int(np.prod(shapes[part])), 7):
        changed = {n: a.copy() for n, a in arrays.items()}
        changed[part].reshape(-1)[flat] = 100.0
        out = float(read_all(jnp.asarray(changed["logits"]),
                             NewKV(k=jnp.asarray(changed["k"]), v=jnp.asarray(changed["v"]))))
        assert out != base, (part, flat)
