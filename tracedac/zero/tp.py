"""Tensor-parallel parameters in a sharded model: ZeRO over one mesh dimension, TP over the rest.

A parameter ``parallelize_module`` made a ``DTensor`` on a TP mesh (``ColwiseParallel``:
``Shard(0)``, ``RowwiseParallel``: ``Shard(1)``, a replicated bias) is sharded by its
*TP-local* tensor: the flat group holds this rank's ``Shard(0)`` rows of it over the data
parallel group, exactly as it holds a plain parameter's rows, and the all-gather rebuilds the
TP-local tensor (FSDP2's 2-D layout). Three views of one parameter:

- in the flat group: the TP-local tensor (``Slice.shape``), gathered and reduced over ``dp``;
- in forward: the gathered TP-local view wrapped back into a DTensor with the parameter's
  own TP placements (``wrap``, differentiable: ``DTensor.from_local``), so the module runs
  tensor parallel as ``parallelize_module`` set it up, and a region records the local ops;
- to optimizers and DCP: a DTensor on the 2-D root mesh (``spec``), ``Shard(0)`` over
  ``dp`` (``_StridedShard`` where TP shards rows too: the rows are cut by TP first, then by
  dp, the reverse of DTensor's left-to-right order) and the TP placements over the rest.
  Parameters of the model that are not DTensors sit on the same mesh, replicated over TP,
  so that every parameter of the model lives on one mesh.

``mesh_for`` refuses what this layout cannot express, by name; ``local_value`` /
``global_value`` move between a parameter's full value and its TP-local one (state dicts,
``full_parameters``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from ..errors import ZeroError

__all__ = ["as_read", "checkpoint_group", "global_value", "local_value", "mesh_for", "spec", "wrap"]


def _root(mesh):
    """The mesh ``mesh`` was sliced from (``init_device_mesh(...)["tp"]``'s 2-D mesh), or itself."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources  # torch before DeviceMesh._get_root_mesh

    return _mesh_resources.get_root_mesh(mesh)


def _dims(root) -> str:
    return f"({', '.join(repr(n) for n in root.mesh_dim_names or ())})"


def _root_dims(mesh, root) -> tuple:
    """The dimensions of ``root`` that ``mesh`` (itself, or a slice by names) spans."""
    if mesh == root:
        return tuple(range(root.ndim))
    return tuple(root.mesh_dim_names.index(n) for n in mesh.mesh_dim_names)


def mesh_for(group, tp: list, children: list):
    """``(mesh, dp_dim)`` for a model with tensor-parallel parameters, or None without any.

    ``tp``: ``(qualified name, DTensorSpec)`` of each DTensor parameter; ``children``: the
    ``Sharded`` of submodules sharded before (one mesh for the whole model). The mesh is
    the TP meshes' root, ``dp_dim`` its dimension whose process group is ``group``; every
    other dimension must be a TP dimension of each DTensor parameter."""
    roots = [(name, _root(s.mesh)) for name, s in tp]
    roots += [("of a submodule sharded before", c.mesh) for c in children if c.mesh.ndim > 1]
    if not roots:
        return None
    name, root = roots[0]
    for other, r in roots[1:]:
        if r != root:
            raise ZeroError(
                f"parameters {name!r} and {other!r} are DTensors on meshes sliced from two different "
                f"device meshes ({_dims(root)} and {_dims(r)}); tracedac.zero puts every parameter of a "
                "model on one mesh. Build one mesh with init_device_mesh((dp, tp), mesh_dim_names=("
                '"dp", "tp")) and parallelize every module over mesh["tp"].'
            )
    ranks, rank = dist.get_process_group_ranks(group), dist.get_rank(group)
    dp = [
        d
        for d in range(root.ndim)
        if dist.get_process_group_ranks(root.get_group(d)) == ranks and root.get_local_rank(d) == rank
    ]
    if root.ndim < 2 or not dp:
        where = (
            f"a 1-D mesh {_dims(root)}, not sliced from a larger one"
            if root.ndim < 2
            else f"a mesh sliced from {_dims(root)}, of which no dimension is the process group "
            f"shard() shards over (ranks {ranks})"
        )
        raise ZeroError(
            f"parameter {name!r} is a DTensor (tensor parallel) on {where}. shard() keeps a "
            "tensor-parallel parameter's local tensor in Shard(0) rows over one more dimension of "
            'the same mesh: build it with init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", '
            '"tp")), parallelize over mesh["tp"] and pass shard(model, group=mesh["dp"].get_group()).'
        )
    dp_dim = dp[0]
    others = [d for d in range(root.ndim) if d != dp_dim]
    for fqn, s in tp:
        if sorted(_root_dims(s.mesh, root)) != others:
            raise ZeroError(
                f"parameter {fqn!r} is a DTensor on mesh dimensions {s.mesh.mesh_dim_names} of the mesh "
                f"{_dims(root)}, and shard() shards over its dimension {dp_dim}: every other dimension "
                "must be one of the parameter's, and that one must not (its values on the other "
                "dimensions would be unknown: a pipeline stage, a replica). Parallelize it over every "
                "dimension of the mesh but the data-parallel one."
            )
        bad = [p for p in s.placements if type(p) not in (Shard, Replicate)]
        if bad:
            raise ZeroError(
                f"parameter {fqn!r} is a DTensor with placements {tuple(s.placements)}; shard() takes "
                f"tensor-parallel parameters placed by Shard(dim) or Replicate() only, not {bad[0]} (a "
                "Partial parameter has no value of its own to shard). Redistribute it before shard()."
            )
    return root, dp_dim


def spec(mesh, dp_dim: int, s) -> DTensorSpec:
    """The spec of slice ``s``'s parameter on the N-D ``mesh``: ``Shard(0)`` over ``dp_dim``
    (``_StridedShard`` when later dimensions cut rows first), its TP placements over the rest
    (``Replicate`` for a plain parameter), its global shape."""
    placements = [Replicate()] * mesh.ndim
    shape = s.shape
    if s.tp is not None:
        for name, p in zip(s.tp.mesh.mesh_dim_names, s.tp.placements):
            placements[mesh.mesh_dim_names.index(name)] = p
        shape = s.tp.shape
    split = math.prod(mesh.size(d) for d in range(dp_dim + 1, mesh.ndim) if placements[d].is_shard(0))
    placements[dp_dim] = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), stride, torch.float32))


def wrap(local: torch.Tensor, tp: DTensorSpec) -> DTensor:
    """The TP-local tensor ``local`` as the parameter the module computes with: a DTensor of
    the parameter's TP placements, with an autograd edge back to ``local``."""
    return DTensor.from_local(
        local, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride
    )


def as_read(views: list, slices: list) -> list:
    """The full views of a group's parameters as its modules read them: a tensor-parallel
    parameter's wrapped in its DTensor (``wrap``), the others as they are. (What "auto"
    watches too: the module's reads of a TP weight are reads of the DTensor.)"""
    return [view if s.tp is None else wrap(view, s.tp) for view, s in zip(views, slices)]


def local_value(s, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP-local part of a full value of slice ``s``'s parameter (no communication)."""
    if s.tp is None:
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(s.tp.shape, s.tp.mesh, s.tp.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def global_value(s, local: torch.Tensor) -> torch.Tensor:
    """The full value of slice ``s``'s parameter from its TP-local one (a collective over TP)."""
    if s.tp is None:
        return local
    with torch.no_grad():
        return wrap(local, s.tp).full_tensor()


def checkpoint_group(z):
    """The process group DCP coordinates a sharded model's checkpoint over: its group, or with
    tensor parallel every rank of its mesh (each holds a different piece), made once (by
    those ranks only: the mesh may be part of the world)."""
    if z.mesh.ndim == 1:
        return z.group
    if z.checkpoint_group is None:
        ranks = sorted(z.mesh.mesh.flatten().tolist())
        z.checkpoint_group = dist.new_group(ranks, use_local_synchronization=True)
    return z.checkpoint_group
