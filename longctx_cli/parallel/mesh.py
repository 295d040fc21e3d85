"""The process groups of a :class:`~longctx_cli.layout.Layout`, built by one DeviceMesh.

:func:`build_parallel_state` is the only place that creates process groups: one
``init_device_mesh`` over the layout's named dimensions (``dp_replicate, dp_shard, ring,
ulysses, tp``; dimensions of size one are left out) in the rank order the layout documents,
and the groups every part of the run needs are slices or flattenings of it. The result, a
:class:`ParallelState`, is what a rank knows about where it works, its layout's attention
kernel resolved once (:mod:`.kernel`) included; it is passed explicitly (to the attention
through the batch's SP metadata, to the loss and the optimizer step as an argument).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from longctx_cli.layout import MESH_DIMS, Layout

from .kernel import AttentionKernel, resolve_kernel


@dataclass(frozen=True)
class ParallelState:
    """One rank's place in the layout and its process groups (``None``: a group of one)."""

    layout: Layout = field(default_factory=Layout)
    sp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object | None = None  # the world's DeviceMesh (None in a single process)
    sp_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None  # hybrid only
    ring_group: ProcessGroup | None = None  # hybrid only
    tp_mesh: object | None = None  # the "tp" sub-mesh (what parallelize_module gets)
    tp_group: ProcessGroup | None = None
    # FSDP2 shards over this mesh: the world, dp x cp under TP, (replicas, shards) for HSDP.
    fsdp_mesh: object | None = None
    # The ranks holding the same parameters, whose gradients are summed: the world, or under
    # TP the ranks holding the same TP shard (dp x cp). None: this rank alone.
    replica_group: ProcessGroup | None = None
    # The layout's attention kernel, resolved when the state is made (a changed layout,
    # `with_layout` or `replace`, resolves its own): what strategies and blocks call.
    kernel: AttentionKernel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", resolve_kernel(self.layout.kernel))  # frozen

    @classmethod
    def of_rank(cls, layout: Layout, rank: int = 0, **groups: object) -> ParallelState:
        """The state of world rank ``rank`` (groups, if any, given by name)."""
        d, c, t = layout.coords(rank)
        return cls(layout, c, d, t, **groups)

    def with_layout(self, **changes: object) -> ParallelState:
        """The same rank and groups under a layout with ``changes`` (e.g. another kernel)."""
        return replace(self, layout=replace(self.layout, **changes))

    def local_ranges(self, total_len: int) -> tuple[tuple[int, int], ...]:
        """Global token ranges this rank owns in a padded row, in local storage order."""
        return self.layout.local_ranges(total_len, self.sp_rank)


def _sub_mesh(mesh, names: tuple[str, ...], flat_name: str):
    """The mesh over ``names`` (those present), flattened to one dimension; None if none."""
    present = tuple(n for n in names if n in mesh.mesh_dim_names)
    if not present:
        return None
    if len(present) == 1:
        return mesh[present[0]]
    return mesh[present]._flatten(flat_name)


def _group(mesh) -> ProcessGroup | None:
    return None if mesh is None or mesh.size() == 1 else mesh.get_group()


def build_parallel_state(layout: Layout, device: torch.device | None = None) -> ParallelState:
    """This rank's :class:`ParallelState`; a collective when ``torch.distributed`` is up.

    Without ``torch.distributed`` the layout must be a single process.
    """
    device = device or torch.device("cpu")
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    layout.for_world(world, "the initialised world" if initialised else "one process")
    if world == 1:
        return ParallelState(layout, device=device)
    dims = [(n, s) for n, s in zip(MESH_DIMS, layout.shape, strict=True) if s > 1]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, tuple(s for _, s in dims),
                            mesh_dim_names=tuple(n for n, _ in dims))
    cp = _sub_mesh(mesh, ("ring", "ulysses"), "cp")
    hybrid = layout.mode == "hybrid"
    groups: dict[str, object] = {
        "mesh": mesh,
        "sp_group": _group(cp),
        "ulysses_group": _group(_sub_mesh(mesh, ("ulysses",), "ulysses")) if hybrid else None,
        "ring_group": _group(_sub_mesh(mesh, ("ring",), "ring")) if hybrid else None,
    }
    data_and_cp = ("dp_replicate", "dp_shard", "ring", "ulysses")
    if layout.tp > 1:
        tp_mesh = mesh["tp"]
        replicas = _sub_mesh(mesh, data_and_cp, "dp_cp")
        groups.update(tp_mesh=tp_mesh, tp_group=tp_mesh.get_group(),
                      replica_group=_group(replicas),
                      fsdp_mesh=replicas if layout.fsdp else None)
    else:
        groups["replica_group"] = dist.group.WORLD
    if layout.tp == 1 and layout.fsdp:
        if layout.dp_replicate > 1:  # HSDP: shard within groups, replicate across them
            shards = _sub_mesh(mesh, data_and_cp[1:], "dp_shard_cp")
            groups["fsdp_mesh"] = (
                mesh["dp_replicate", shards.mesh_dim_names[0]] if shards is not None
                else init_device_mesh(device.type, (layout.dp_replicate, 1),
                                      mesh_dim_names=("dp_replicate", "dp_shard")))
        else:
            groups["fsdp_mesh"] = _sub_mesh(mesh, data_and_cp, "dp_shard_cp")
    return ParallelState.of_rank(layout, dist.get_rank(), device=device, **groups)
