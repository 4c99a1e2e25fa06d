"""The Engine's constructor arguments checked by name, before anything is allocated (moved
out of engine.py, which stays under its size bound)."""

from __future__ import annotations

import jax

from ..distributed import check_same, fetch, mesh_id, model_id, model_spans_processes, \
    spans_processes
from ..request import check_call, check_draft, check_model, is_int, resolve_method


def check_args(target, draft, method, config, slots, max_cache_len, rounds_per_step, pool,
                shared_pool, max_queue, mesh):
    """The Engine's arguments checked by name (on several processes: the same on each) ->
    (spec, spans processes, the prompt + max_tokens limit)."""
    check_model(target, "target")
    if draft is not None:
        check_model(draft, "draft")
    multi = spans_processes(mesh) or model_spans_processes(target)
    if multi:  # SPMD: engines that differ would pair their collectives wrongly and hang
        check_same("Engine", target=model_id(target), draft=model_id(draft), method=method,
                   config=repr(config), slots=slots, max_cache_len=max_cache_len,
                   rounds_per_step=rounds_per_step, shared_pool=shared_pool,
                   pool=None if pool is None else jax.tree_util.tree_leaves(fetch(pool)),
                   mesh=mesh_id(mesh) if isinstance(mesh, jax.sharding.Mesh) else None)
    spec = resolve_method(method)
    for name, v in (("slots", slots), ("rounds_per_step", rounds_per_step),
                    ("max_queue", max_queue)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not isinstance(shared_pool, bool):
        raise ValueError(f"shared_pool must be a bool, got {shared_pool!r}")
    check_draft(target, draft, method, spec.needs_draft)
    limit = target.config.max_position_embeddings
    if max_cache_len is not None:
        if not is_int(max_cache_len) or max_cache_len < 2:
            raise ValueError(f"max_cache_len must be an integer >= 2, got {max_cache_len!r}")
        limit = min(limit, int(max_cache_len))
    # sizes against the models and device before auto's probes allocate (issue 24)
    check_call(spec, None, target, draft, int(slots), 16, 0, limit, mesh, batch_name="slots")
    return spec, multi, limit
