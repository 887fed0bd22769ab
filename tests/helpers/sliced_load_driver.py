"""One process of a multi-process load of a shipped (quantized) checkpoint, counting what it reads.

Run as ``python -m tests.helpers.sliced_load_driver --path DIR --out OUT.npz --num-processes P
--process-id I --coordinator HOST:PORT --local-devices D`` once per process. Each process loads
``DIR`` (``quant.format="shipped"``, float parameters in the file's dtype) on a mesh over every
process's devices (``MESH``: fsdp, the first mesh axis, runs across processes) through a
``SafetensorsFolder`` that counts the bytes it returns, then loads it again on one local device
(a one-process load, read through its own folder). It writes to ``OUT.npz``:

- ``read``: bytes of the checkpoint this process read for the sharded load; ``held``: bytes of
  the distinct slices its devices hold (each leaf's distinct addressable shards, in the stored
  dtype); ``whole``: bytes of every tensor of the checkpoint; ``partial``: how many tensors this
  process read part of, not all;
- ``equal``: 1 if every addressable shard equals the one-device load's slice bit for bit;
- ``shard/<leaf>/<start:stop,...>``: the elements of each slice this process holds, ``size/<leaf>``
  each leaf's elements (for the caller to check that the processes together hold every element).
"""

from __future__ import annotations

import argparse

import numpy as np

from tests.helpers.multiprocess import add_process_args, start_devices

MESH = dict(data=1, fsdp=2, tensor=2, expert=2)


def _parse(argv=None) -> argparse.Namespace:
    p = add_process_args(argparse.ArgumentParser(description=__doc__))
    p.add_argument("--path", required=True)
    return p.parse_args(argv)


def _key(index: tuple) -> str:
    return ",".join(f"{s.start or 0}:{'' if s.stop is None else s.stop}" for s in index)


def _leaves(model) -> dict[str, object]:
    from flax import nnx

    return {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(nnx.state(model))}


def run(args: argparse.Namespace) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from rlx.mesh import MeshShape, make_mesh
    from rlx.models.safetensors_io import SafetensorsFolder
    from rlx.quant.loading import load_shipped

    mesh = make_mesh(MeshShape(**MESH), jax.devices())
    folder = SafetensorsFolder(args.path)
    sharded = _leaves(load_shipped(args.path, jnp.float32, mesh, tensors=folder)[0].model)
    alone = load_shipped(args.path, jnp.float32, None, tensors=SafetensorsFolder(args.path))
    one = _leaves(alone[0].model)
    out, held, equal = {}, 0, True
    for name, arr in sharded.items():
        ref = np.asarray(one[name])
        out[f"size/{name}"] = np.array(arr.size)
        distinct = {_key(s.index): s for s in arr.addressable_shards}
        for key, s in distinct.items():
            got = np.asarray(s.data)
            held += got.nbytes
            equal &= got.dtype == ref.dtype and got.tobytes() == np.ascontiguousarray(
                ref[s.index]).tobytes()
            out[f"shard/{name}/{key}"] = np.array(got.size)
    whole = sum(folder.nbytes(n) for n in folder)
    partial = sum(0 < folder.bytes_read[n] < folder.nbytes(n) for n in folder)
    out.update(read=np.array(sum(folder.bytes_read.values())), held=np.array(held),
               whole=np.array(whole), partial=np.array(partial), equal=np.array(int(equal)),
               process_count=np.array(jax.process_count()))
    return out


def main(argv=None) -> None:
    args = _parse(argv)
    start_devices(args, distributed=True)
    np.savez(args.out, **run(args))


if __name__ == "__main__":
    main()
