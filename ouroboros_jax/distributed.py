"""One model over several processes (`jax.distributed`): what `generate` needs to run SPMD.

In JAX's multi-controller model every process runs the same program on its own devices, and a
mesh may span devices of several processes (hosts of a TPU pod slice, nodes of a GPU cluster,
or CPU processes on one machine). Then:

- every process must make the same call with the same arguments, or the collectives inside the
  compiled loop pair up wrongly and hang: `check_same` compares a hash of each named argument
  across processes and refuses, naming the arguments that differ;
- every host-side decision (the method and config `config="auto"` picks from timings, which
  differ per process) is made on process 0 and sent to the others (`broadcast`);
- arrays that span non-addressable devices cannot be read on one host: `fetch` gathers them
  (`multihost_utils.process_allgather`) so every process gets the full result.

On one process every function here is the identity or a plain `jax.device_get`, so the
single-host path pays nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
from typing import Any, Optional

import jax
import numpy as np

from . import liveness


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_ids: Optional[list[int]] = None,
               initialization_timeout: int = 300,
               heartbeat_timeout: int = liveness.HEARTBEAT_TIMEOUT_S) -> None:
    """`jax.distributed.initialize` with the arguments checked by name; call it once per
    process before any other JAX call. On a TPU pod slice or a SLURM/Open MPI cluster JAX finds
    all three itself: call `jax.distributed.initialize()` with no arguments there instead.

    heartbeat_timeout: seconds after which a silent process counts as dead. A dead process
    is then reported by name and its peers fail what they were doing, instead of being
    aborted by JAX's runtime (`liveness`); `jax.distributed.initialize` called directly keeps
    JAX's default (the survivors abort once the timeout, 100 s, has passed)."""
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
        raise ValueError("coordinator_address must be 'host:port' of process 0, got "
                         f"{coordinator_address!r}")
    for name, v, lo in (("num_processes", num_processes, 1), ("process_id", process_id, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, int) \
            or heartbeat_timeout < 1:
        raise ValueError(f"heartbeat_timeout must be an integer >= 1 (seconds), got "
                         f"{heartbeat_timeout!r}")
    if process_id >= num_processes:
        raise ValueError(f"process_id must be below num_processes ({num_processes}), got "
                         f"{process_id}")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=int(num_processes), process_id=int(process_id),
                               local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout,
                               **liveness.initialize_kwargs(heartbeat_timeout))
    liveness.start_beating()


def spans_processes(mesh) -> bool:
    """Whether a mesh (None: no mesh) holds devices of more than one process."""
    if not isinstance(mesh, jax.sharding.Mesh):
        return False  # None, or a wrong type that generate's validation names
    return len({d.process_index for d in mesh.devices.flat}) > 1


def model_spans_processes(model) -> bool:
    """Whether a model's params lie on devices of more than one process."""
    leaf = model.params["embed"]
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


def model_id(model) -> Optional[list]:
    """What must match between processes for one model (None: no model): its config and
    dtype (paths may differ between hosts; the weights are too large to hash on every call)."""
    if model is None:
        return None
    return [dataclasses.asdict(model.config), str(model.dtype)]


def mesh_id(mesh) -> Optional[list]:
    """A mesh as every process sees it (None: no mesh): axis names and its devices' global
    ids."""
    if mesh is None:
        return None
    return [list(mesh.axis_names), [int(d.id) for d in mesh.devices.flat]]


def is_leader() -> bool:
    """Process 0: the one that writes shared host state (the auto cache) and decides."""
    return jax.process_index() == 0


def _digest(value: Any) -> bytes:
    """32 bytes that differ when value differs: arrays by dtype, shape and bytes, everything
    else by a canonical JSON (repr for what JSON cannot hold)."""
    h = hashlib.sha256()

    def add(v):
        if isinstance(v, (np.ndarray, jax.Array)):
            a = np.asarray(v)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        elif isinstance(v, (list, tuple)) and any(isinstance(x, (np.ndarray, jax.Array))
                                                  for x in v):
            for x in v:
                add(x)
        else:
            h.update(json.dumps(v, sort_keys=True, default=repr).encode())

    add(value)
    return h.digest()


def check_same(what: str = "generate", **named: Any) -> None:
    """Refuses a call whose named arguments differ between processes: each is hashed here, the
    hashes are gathered from every process (one collective) and compared. Every process raises
    the same ValueError, naming the arguments that differ, instead of hanging in a collective
    later. No-op on one process."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(named)
    mine = np.frombuffer(b"".join(_digest(named[n]) for n in names), np.uint8)
    mine = mine.reshape(len(names), 32)
    every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, args, 32]
    differ = [n for i, n in enumerate(names) if not (every[:, i] == every[0:1, i]).all()]
    if differ:
        raise ValueError(f"{what}: every process must make the same call, but "
                         f"{', '.join(differ)} differ between processes (SPMD: "
                         f"{jax.process_count()} processes run one program together)")


def broadcast(value: Any) -> Any:
    """Process 0's value (any picklable object) on every process; the value itself on one
    process. For host decisions taken from process-local measures (timings) or files."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    blob = np.frombuffer(pickle.dumps(value), np.uint8) if is_leader() else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.array([blob.size], np.int64))[0])
    # padded to a power of two: each buffer size compiles its own collective, and a server
    # broadcasts a record before every device step (pickle ignores the bytes past its end)
    buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.uint8)
    if is_leader():
        buf[:n] = blob
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return pickle.loads(out[:n].tobytes())


def fetch(tree):
    """tree's arrays on the host as numpy arrays, whole: arrays that span other processes'
    devices are gathered from every process (collective: every process must call it), the
    others fetched with `jax.device_get`."""
    if isinstance(tree, jax.Array) and tree.is_fully_addressable:
        # one local array (a serving step's packed outputs): read directly, without
        # device_get's tree walk and copy scheduling (a tenth of its host time)
        return np.asarray(tree)

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:  # every process holds it whole already
                return np.asarray(x.addressable_data(0))
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree_util.tree_map(one, tree)


def local(tree):
    """tree's arrays gathered (`fetch`) and placed on this process's default device: a value
    returned to the user (the phrase pool) that later single-process calls can use as is."""
    import jax.numpy as jnp

    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, fetch(tree))
