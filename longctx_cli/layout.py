"""The parallel layout of a run: degrees, sharding, ring algorithm and kernel, checked once.

A :class:`Layout` is built once from the plan (``config.plan.layout_for``): ``validate``
prints it and every rank builds its process groups from it (``parallel.mesh``), so the
degrees and the kernel the plan shows are the ones the ranks run. It is pure Python (no
``torch.distributed``): every rule about how ranks are arranged lives here and raises a
:class:`LayoutError` naming the config key, the bad value and the fix.

The world is the mesh ``dp_replicate x dp_shard x ring x ulysses x tp``, ``tp`` fastest:

* rank = ``(d * sp + c) * tp + t`` for data-parallel index ``d``, sequence-parallel index
  ``c`` and tensor-parallel index ``t``; a TP group is ``tp`` consecutive ranks (TP moves
  activations four times per layer, so it gets the closest ranks) and an SP group is ``sp``
  ranks ``tp`` apart (one node when ``sp * tp <= ranks per node``);
* inside an SP group, ``c = ring_index * ulysses + ulysses_index``: a Ulysses group is
  ``ulysses`` consecutive members, a ring group is member ``i`` of every Ulysses group;
* ``d = replica * dp_shard + shard``: HSDP replicates across ``dp_replicate`` groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from math import gcd
from typing import Literal, get_args

# The allowed values of the layout's config keys: the schema's types, and (as tuples) what
# the rules below list in their messages.
Mode = Literal["ring", "ulysses", "hybrid"]
Sharding = Literal["contiguous", "zigzag", "stripe"]
# The ring algorithm (Axolotl's `ring_attn_func` names): llama3-style all-gather, or a P2P
# ring whose sharding is in its name.
RingAttnFunc = Literal["varlen_llama3", "batch_ring", "batch_zigzag", "batch_stripe"]
# The attention kernels a layout runs (`attention_kernel: auto` resolves to one of them).
Kernel = Literal["torch", "flash", "torch_flash", "cudnn", "fa4"]
MODES: tuple[str, ...] = get_args(Mode)
SHARDINGS: tuple[str, ...] = get_args(Sharding)
RING_ATTN_FUNCS: tuple[str, ...] = get_args(RingAttnFunc)
CONCRETE_KERNELS: tuple[str, ...] = get_args(Kernel)
P2P_SHARDING = {"batch_ring": "contiguous", "batch_zigzag": "zigzag", "batch_stripe": "stripe"}
# Mesh dimension names, outermost first (the rank order above).
MESH_DIMS = ("dp_replicate", "dp_shard", "ring", "ulysses", "tp")


class LayoutError(ValueError):
    """A layout rule broken by a config value: ``key`` names it, ``fix`` says what to do."""

    def __init__(self, key: str, message: str, fix: str):
        super().__init__(f"{message} {fix}")
        self.key, self.message, self.fix = key, message, fix


def divisors(n: int) -> str:
    """``"1, 2, 4 or 8"``: the values a degree dividing ``n`` may take, for fix texts."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + f" or {ds[-1]}" if len(ds) > 1 else ds[0]


@dataclass(frozen=True)
class HeadSplit:
    """How a Ulysses group splits one layer's heads: group rank ``j`` holds ``q_counts[j]``
    consecutive query heads and ``kv_counts[j]`` KV heads, the next ones of ``kv_index``
    (the KV heads sent, in rank order; a repeated index is a replica)."""

    q_counts: tuple[int, ...]
    kv_counts: tuple[int, ...]
    kv_index: tuple[int, ...]

    @property
    def even(self) -> bool:
        return len(set(self.q_counts)) == 1 and len(set(self.kv_counts)) == 1

    @property
    def replicated(self) -> bool:
        return len(self.kv_index) > len(set(self.kv_index))

    def q_start(self, rank: int) -> int:
        return sum(self.q_counts[:rank])

    def q_slice(self, rank: int) -> slice:
        """The query heads group rank ``rank`` holds."""
        start = self.q_start(rank)
        return slice(start, start + self.q_counts[rank])

    @property
    def imbalance(self) -> float:
        """The largest rank's query heads over the mean."""
        return max(self.q_counts) * len(self.q_counts) / sum(self.q_counts)

    def describe(self) -> str:
        """``"6, 3 query heads per rank (KV heads 2, 1); the largest 1.33x the mean"``."""
        kv = ", ".join(map(str, self.kv_counts))
        replicas = ", replicated" if self.replicated else ""
        return (f"{', '.join(map(str, self.q_counts))} query heads per rank (KV heads {kv}"
                f"{replicas}); the largest {self.imbalance:.2f}x the mean")


@cache
def head_split(q_heads: int, kv_heads: int, size: int) -> HeadSplit:
    """The split of ``q_heads`` query heads over ``kv_heads`` KV heads onto a Ulysses group.

    Whole KV-head groups: a KV head travels with all its query heads, and the KV heads are
    dealt out as evenly as they go (the first ranks get one more). With fewer KV heads than
    ranks each rank gets one KV head, replicated, and a share of its query heads (KV head
    ``j`` goes to ``size // kv_heads`` ranks, one more for the first ``size % kv_heads``).
    Even head counts give the even split. Raises ``ValueError`` when a rank would get no
    query head (fewer query heads than ranks) or the heads are not GQA groups.
    """
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} must be a multiple of key/value heads {kv_heads}")
    if q_heads < size:
        raise ValueError(f"Ulysses cannot give each of its {size} ranks one of the {q_heads} "
                         "attention heads")
    group = q_heads // kv_heads
    if kv_heads >= size:
        kv_counts = tuple(kv_heads // size + (j < kv_heads % size) for j in range(size))
        return HeadSplit(tuple(n * group for n in kv_counts), kv_counts, tuple(range(kv_heads)))
    q_counts, index = [], []
    for j in range(kv_heads):
        copies = size // kv_heads + (j < size % kv_heads)  # at most `group`: q_heads >= size
        q_counts += [group // copies + (c < group % copies) for c in range(copies)]
        index += [j] * copies
    return HeadSplit(tuple(q_counts), (1,) * size, tuple(index))


def largest_share(q_heads: int, kv_heads: int, size: int) -> tuple[int, int]:
    """The most query heads and KV heads one rank of a Ulysses group of ``size`` holds (what
    its memory is sized by); heads the group cannot split count as an even share."""
    try:
        split = head_split(q_heads, kv_heads, size)
    except ValueError:
        return max(1, q_heads // size), max(1, kv_heads // size)
    return max(split.q_counts), max(split.kv_counts)


def head_chunk_counts(q_heads: int, kv_heads: int, size: int) -> list[int]:
    """The head-chunk counts a Ulysses group of ``size`` can run on these heads: each chunk
    holds whole KV-head groups and splits over the group (:func:`head_split`), and no rank
    holds more query heads over all the chunks than the unchunked split gives it."""
    try:
        most = max(head_split(q_heads, kv_heads, size).q_counts)
    except ValueError:
        return []
    return [c for c in range(1, kv_heads + 1)
            if not q_heads % c and not kv_heads % c and q_heads // c >= size
            and c * max(head_split(q_heads // c, kv_heads // c, size).q_counts) <= most]


def ring_sharding(ring_attn_func: str, sharding: str | None) -> str:
    """The sharding a ring algorithm runs on: a P2P ring's name fixes it (``None``: not
    given, derive it); the stripe sharding exists only for ``batch_stripe``."""
    implied = P2P_SHARDING.get(ring_attn_func)
    if implied is None:
        if sharding == "stripe":
            raise LayoutError(
                "sp_sharding",
                "`sp_sharding: stripe` is computed only by `ring_attn_func: batch_stripe`; "
                "varlen_llama3 balances causal work with `sp_sharding: zigzag`.",
                "set `sp_sharding: zigzag`, or `ring_attn_func: batch_stripe`.",
            )
        return sharding or "contiguous"
    if sharding is not None and sharding != implied:
        raise LayoutError(
            "sp_sharding",
            f"`ring_attn_func: {ring_attn_func}` runs on `sp_sharding: {implied}`, but "
            f"`sp_sharding` is {sharding!r}.",
            f"set `sp_sharding: {implied}` (or leave it out), or pick the ring of that layout.",
        )
    return implied


def default_ring(
    mode: str, tp: int, ring_attn_func: str | None, sharding: str | None,
    heads_k_stride_given: bool = False, kernel: str = "auto",
) -> tuple[str, str]:
    """``(ring_attn_func, sharding)`` of a config that may name neither (``None``).

    Unnamed, the ring is ``batch_stripe``: the only layout whose causal work is within 5% of
    even on one long document and on packed rows alike (``benchmarks/balance.py``: contiguous
    is 1.27-1.94x, zigzag 1.13-1.23x on packed rows). llama3's all-gather stays where the
    config asks for what only it has (a contiguous or zigzag ``sp_sharding``,
    ``heads_k_stride``, ``attention_kernel: flash``, whose packed rows only ring-flash-attn's
    llama3 function takes) and where a stripe cannot run: hybrid (a Ulysses group is not one
    stripe) and tensor parallelism."""
    if ring_attn_func is not None:
        return ring_attn_func, ring_sharding(ring_attn_func, sharding)
    stripe_fits = not stripe_blockers(mode, tp, heads_k_stride_given, kernel)
    if sharding == "stripe" or (sharding is None and stripe_fits):
        return "batch_stripe", "stripe"
    return "varlen_llama3", ring_sharding("varlen_llama3", sharding)


def stripe_blockers(mode: str, tp: int, heads_k_stride_given: bool = False,
                    kernel: str = "auto") -> list[str]:
    """Why a config naming no ring runs ``varlen_llama3`` instead of the balanced
    ``batch_stripe`` (empty: it runs ``batch_stripe``); the reasons ``default_ring`` applies,
    worded for the plan."""
    blockers = []
    if mode != "ring":
        blockers.append(f"`sequence_parallel_mode: {mode}`: a Ulysses group's tokens are not "
                        "one stripe of the ring")
    if tp > 1:
        blockers.append(f"`tensor_parallel_size: {tp}`: the stripe does not run with tensor "
                        "parallelism")
    if heads_k_stride_given:
        # Axolotl configs often carry `heads_k_stride: 1`, its default: written, it still asks
        # for the ring that reads it, as it does in Axolotl.
        blockers.append("`heads_k_stride` is given (even at its default 1): only this ring "
                        "reads it; leave it out for batch_stripe")
    if kernel == "flash":
        blockers.append("`attention_kernel: flash`: ring-flash-attn takes packed rows only "
                        "in its llama3 function")
    return blockers


def ring_reason(
    mode: str, tp: int, named_by_config: bool, heads_k_stride_given: bool = False,
    kernel: str = "auto",
) -> str:
    """Why the run's ring is the one it is, for the plan: the config names it (through
    ``ring_attn_func`` or the ``sp_sharding`` it runs on), or :func:`default_ring` chose it."""
    if named_by_config:
        return "named by the config's `ring_attn_func` / `sp_sharding`"
    blockers = stripe_blockers(mode, tp, heads_k_stride_given, kernel)
    if not blockers:
        return "the default (ring_attn_func unset): the balanced ring"
    return "ring_attn_func unset, not batch_stripe: " + "; ".join(blockers)


def ulysses_degree_for(mode: str, sp: int, given: int | None) -> int:
    """Ranks per Ulysses (all-to-all) group: 1 for ring, sp for ulysses, the given
    `ulysses_degree` for hybrid."""
    if mode not in MODES:
        raise LayoutError("sequence_parallel_mode", f"unknown mode {mode!r}.",
                          f"use one of {', '.join(MODES)}.")
    if mode != "hybrid" and given is not None:
        raise LayoutError(
            "ulysses_degree",
            f"`ulysses_degree` = {given} is only used by `sequence_parallel_mode: hybrid`, "
            f"but the mode is {mode!r}.",
            "remove `ulysses_degree`, or set `sequence_parallel_mode: hybrid`.",
        )
    if mode == "ring":
        return 1
    if mode == "ulysses":
        return sp
    if given is None:
        raise LayoutError(
            "ulysses_degree",
            "`sequence_parallel_mode: hybrid` needs `ulysses_degree` (ranks per all-to-all "
            "group; the ring runs across the groups).",
            f"add `ulysses_degree: N` with N dividing `sequence_parallel_degree` = {sp} "
            f"({divisors(sp)}), usually the GPUs per node.",
        )
    if given < 1 or sp % given:
        raise LayoutError(
            "ulysses_degree",
            f"`ulysses_degree` = {given} does not divide `sequence_parallel_degree` = {sp}: "
            "the SP group must split into equal Ulysses groups.",
            f"set `ulysses_degree` to {divisors(sp)}.",
        )
    return given


def flash_fits(sharding: str, ring_attn_func: str) -> bool:
    """ring-flash-attn has a function for this sharding: its llama3 varlen function expects
    contiguous slices, each P2P ring function its own sharding."""
    return sharding == "contiguous" or ring_attn_func in P2P_SHARDING


def zigzag_order(n: int) -> list[int]:
    """Global index of each of the ``2n`` zigzag chunks, in rank order: rank ``r`` stores
    chunks ``r`` and ``2n-1-r`` (one early, one late, so causal work balances)."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def check_world(sp: int, tp: int, world: int, source: str = "given") -> None:
    """``world`` splits into groups of ``sp x tp`` ranks."""
    if tp == 1 and sp > world:
        raise LayoutError(
            "sequence_parallel_degree",
            f"`sequence_parallel_degree` = {sp} is larger than the world size {world} "
            f"({source}): a sequence cannot be split over more ranks than exist.",
            f"set `sequence_parallel_degree` to {divisors(world)}, or launch at least {sp} "
            "ranks (--nproc-per-node / --nnodes).",
        )
    if tp == 1 and world % sp:
        raise LayoutError(
            "sequence_parallel_degree",
            f"`sequence_parallel_degree` = {sp} does not divide the world size {world} "
            f"({source}): every rank must belong to one SP group of {sp} ranks.",
            f"set `sequence_parallel_degree` to {divisors(world)}, or run a multiple of {sp} "
            "ranks.",
        )
    if world % (tp * sp):
        raise LayoutError(
            "tensor_parallel_size",
            f"`tensor_parallel_size` = {tp} x `sequence_parallel_degree` = {sp} = {tp * sp} "
            f"does not divide the world size {world} ({source}): the world is dp x tp x cp.",
            f"launch a multiple of {tp * sp} ranks, or change the two degrees so their "
            f"product divides {world}.",
        )


def data_parallel_misfit(replicate: int | None, shard: int | None, world: int, sp: int,
                         tp: int) -> LayoutError:
    """The error of data-parallel degrees that do not fill the ranks ``sp x tp`` leave."""
    given = " x ".join(f"{k} {v}" for k, v in (("dp_replicate_size", replicate),
                                                 ("dp_shard_size", shard)) if v is not None)
    return LayoutError(
        "dp_shard_size",
        f"{given} does not fit the {world // (sp * tp)} data-parallel ranks (world {world} / "
        f"sequence_parallel_degree {sp}" + (f" / tensor_parallel_size {tp}" if tp > 1 else "")
        + ").",
        "make dp_replicate_size x dp_shard_size equal the data-parallel ranks (world / "
        "sequence_parallel_degree / tensor_parallel_size), or leave one of them out.",
    )


def data_parallel_degrees(
    world: int, sp: int, tp: int, fsdp: bool, replicate: int | None, shard: int | None
) -> tuple[int, int]:
    """(replicas, shards) of the ``world / (sp x tp)`` data-parallel ranks: Axolotl's
    ``dp_replicate_size x dp_shard_size`` (given ones only); without FSDP every data-parallel
    rank is a replica. ``world`` must split into ``sp x tp`` groups (:func:`check_world`)."""
    dp = world // (sp * tp)
    if replicate is not None and replicate > 1 and not fsdp:
        raise LayoutError(
            "dp_replicate_size",
            f"`dp_replicate_size` = {replicate} replicates sharded weights, but FSDP is off.",
            "set `dp_shard_size` > 1 or `fsdp: true` (HSDP), or drop dp_replicate_size.",
        )
    product = (replicate or 1) * (shard or 1)
    if (replicate is not None and shard is not None and product != dp) or dp % product:
        raise data_parallel_misfit(replicate, shard, world, sp, tp)
    if not fsdp:
        return dp, 1
    replicas = replicate or 1
    return replicas, dp // replicas


@dataclass(frozen=True)
class Layout:
    """How the ranks of a run are arranged and what attention runs on them.

    Constructing one checks every rule that needs only the layout itself; the world-size
    rules are in :meth:`for_world`, the model's in :meth:`check_heads`.
    """

    sp: int = 1  # ranks sharing one row (the `cp` of the mesh: ring x ulysses)
    tp: int = 1
    dp_replicate: int = 1  # data-parallel replicas (DDP; HSDP's replica groups with fsdp)
    dp_shard: int = 1  # FSDP2 shards parameters over dp_shard x sp ranks (fsdp only)
    fsdp: bool = False
    mode: str = "ring"
    # Ranks per all-to-all group: 1 for ring, sp for ulysses (0: derive those), given for
    # hybrid.
    ulysses: int = 0
    sharding: str = "contiguous"
    ring_attn_func: str = "varlen_llama3"
    heads_k_stride: int = 1
    head_chunks: int = 1  # Ulysses: heads attended per all-to-all chunk (parallel/ulysses.py)
    kernel: str = "torch"  # one of CONCRETE_KERNELS, never auto
    kernel_reason: str = ""  # why that kernel (printed)

    def __post_init__(self) -> None:
        for key, value in (("sequence_parallel_degree", self.sp),
                           ("tensor_parallel_size", self.tp),
                           ("dp_replicate_size", self.dp_replicate),
                           ("dp_shard_size", self.dp_shard),
                           ("heads_k_stride", self.heads_k_stride)):
            if value < 1:
                raise LayoutError(key, f"`{key}` = {value} must be at least 1.",
                                  f"set `{key}` to 1 or more.")
        if self.head_chunks < 1 or (self.head_chunks > 1 and self.mode != "ulysses"):
            raise LayoutError(
                "ulysses_head_chunks",
                f"`ulysses_head_chunks` = {self.head_chunks} cuts the heads of "
                "`sequence_parallel_mode: ulysses` into chunks; it must be at least 1, and "
                f"{self.mode}'s attention runs unchunked.",
                "leave `ulysses_head_chunks` out, or use `sequence_parallel_mode: ulysses`.",
            )
        if self.dp_shard > 1 and not self.fsdp:
            raise LayoutError("dp_shard_size", f"`dp_shard_size` = {self.dp_shard} shards "
                              "parameters, which needs FSDP.", "set `fsdp: true`.")
        derived = ulysses_degree_for(
            self.mode, self.sp,
            (self.ulysses or None) if self.mode == "hybrid" else None)
        if self.ulysses == 0:
            object.__setattr__(self, "ulysses", derived)  # frozen: set once, here
        elif self.ulysses != derived:
            raise LayoutError("ulysses_degree", f"a {self.mode} layout over {self.sp} ranks "
                              f"cannot have Ulysses groups of {self.ulysses}.",
                              f"leave the Ulysses degree out (it is {derived}).")
        if self.sharding not in SHARDINGS:
            raise LayoutError("sp_sharding", f"unknown sharding {self.sharding!r}.",
                              f"use one of {', '.join(SHARDINGS)}.")
        if self.ring_attn_func not in RING_ATTN_FUNCS:
            raise LayoutError("ring_attn_func", f"unknown ring_attn_func "
                              f"{self.ring_attn_func!r}.",
                              f"use one of {', '.join(RING_ATTN_FUNCS)}.")
        if self.mode != "ulysses":
            ring_sharding(self.ring_attn_func, self.sharding)
        if self.sharding == "stripe" and self.mode != "ring" and self.sp > 1:
            raise LayoutError(
                "sp_sharding",
                f"`sp_sharding: stripe` (`ring_attn_func: {self.ring_attn_func}`) is not "
                f"supported by `sequence_parallel_mode: {self.mode}`: "
                + ("the all-to-all would reorder one-token pieces" if self.mode == "ulysses"
                   else "a Ulysses group's tokens are not one stripe of the ring across "
                   "the groups") + ".",
                "use `ring_attn_func: batch_zigzag` (or batch_ring) with hybrid, "
                "`sp_sharding: zigzag` with ulysses, or `sequence_parallel_mode: ring`.",
            )
        if self.kernel not in CONCRETE_KERNELS:
            raise LayoutError("attention_kernel", f"the layout's kernel must be resolved, got "
                              f"{self.kernel!r}.", f"use one of {', '.join(CONCRETE_KERNELS)}.")
        if self.kernel == "flash" and self.ring > 1 and not flash_fits(self.sharding,
                                                                      self.ring_attn_func):
            raise LayoutError(
                "sp_sharding",
                f"`sp_sharding` = {self.sharding!r} is not supported by `attention_kernel: "
                "flash` (ring-flash-attn's llama3 varlen kernel expects contiguous slices).",
                "set `sp_sharding: contiguous`, or `attention_kernel: torch_flash` (CUDA) or "
                "`torch` to keep zigzag.",
            )

    @classmethod
    def filling(cls, world: int, **fields: object) -> Layout:
        """A layout whose data-parallel replicas fill ``world`` ranks (tests, benchmarks)."""
        sp, tp = int(fields.get("sp", 1)), int(fields.get("tp", 1))  # type: ignore[call-overload]
        return cls(dp_replicate=world // (sp * tp), **fields)  # type: ignore[arg-type]

    # ---- degrees ------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def ring(self) -> int:
        """Ranks per ring (1 when Ulysses spans the SP group)."""
        return self.sp // self.ulysses

    @property
    def world(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of :data:`MESH_DIMS`, outermost first."""
        return (self.dp_replicate, self.dp_shard, self.ring, self.ulysses, self.tp)

    @property
    def p2p(self) -> bool:
        """True when the ring passes K/V blocks point to point (``batch_*``)."""
        return self.ring_attn_func in P2P_SHARDING


    @property
    def row_multiple(self) -> int:
        """Rows are padded to a multiple of this: equal slices for every SP rank (2 chunks
        each for zigzag), each split once more over the TP group."""
        return self.sp * (2 if self.sharding == "zigzag" else 1) * self.tp

    @property
    def sequence_len_multiple(self) -> int:
        """What `sequence_len` must be a multiple of (zigzag over one rank cuts nothing)."""
        return self.sp * (2 if self.sharding == "zigzag" and self.sp > 1 else 1) * self.tp

    # ---- ranks ------------------------------------------------------------------------

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp index, sp index, tp index)`` of a world rank."""
        return rank // (self.sp * self.tp), rank // self.tp % self.sp, rank % self.tp

    def local_ranges(self, total_len: int, sp_rank: int) -> tuple[tuple[int, int], ...]:
        """Global token ranges SP rank ``sp_rank`` owns in a row, in local storage order."""
        n, r = self.sp, sp_rank
        multiple = self.row_multiple // self.tp
        if total_len % multiple:
            raise ValueError(f"row length {total_len} is not a multiple of {multiple}")
        if self.sharding == "contiguous":
            size = total_len // n
            return ((r * size, (r + 1) * size),)
        if self.sharding == "zigzag":
            c = total_len // (2 * n)
            return tuple((j * c, (j + 1) * c) for j in zigzag_order(n)[2 * r:2 * r + 2])
        if n == 1:
            return ((0, total_len),)
        return tuple((i, i + 1) for i in range(r, total_len, n))  # stripe

    # ---- rules that need the world or the model ----------------------------------------

    def for_world(self, world: int, source: str = "given") -> Layout:
        """Check that this layout fills ``world`` ranks exactly; returns itself."""
        check_world(self.sp, self.tp, world, source)
        if self.world != world:
            raise data_parallel_misfit(self.dp_replicate, self.dp_shard, world, self.sp, self.tp)
        return self

    def check_heads(self, heads: int, kv_heads: int, key: str | None = None) -> None:
        """The attention heads (those one TP rank holds) fit the Ulysses split and the
        ring's ``heads_k_stride``."""
        u = self.ulysses
        key = key or ("ulysses_degree" if self.mode == "hybrid" else "sequence_parallel_degree")
        if u > 1 and heads < u:
            raise LayoutError(
                key,
                f"`{key}` = {u}: the model's num_attention_heads = {heads} is fewer than the "
                f"Ulysses group size {u}; after the all-to-all every rank attends with at "
                "least one whole head.",
                f"use a Ulysses size of at most {heads}, or `sequence_parallel_mode: ring`.",
            )
        if heads % kv_heads:
            return  # not GQA groups: the model's own rule (its config) refuses them
        counts = head_chunk_counts(heads, kv_heads, u)
        if self.head_chunks > 1 and self.head_chunks not in counts:
            raise LayoutError(
                "ulysses_head_chunks",
                f"`ulysses_head_chunks` = {self.head_chunks} cannot cut {heads} heads with "
                f"{kv_heads} KV heads into chunks of whole KV-head groups that split over the "
                f"Ulysses group of {u} with no rank holding more heads than unchunked.",
                f"use one of {', '.join(map(str, counts))}, or leave it out (the plan picks).",
            )
        if self.ring > 1:
            held = sorted(set(head_split(heads, kv_heads, u).kv_counts))  # KV heads per rank
            if any(n % self.heads_k_stride for n in held):
                where = f"num_key_value_heads = {kv_heads}" + (
                    f" ({' or '.join(map(str, held))} per rank after the all-to-all)"
                    if u > 1 else "")
                raise LayoutError(
                    "heads_k_stride",
                    f"`heads_k_stride` = {self.heads_k_stride} does not divide the model's "
                    f"{where}: the ring gathers K,V in chunks of that many heads.",
                    f"set `heads_k_stride` to {divisors(gcd(*held))}.",
                )

    def ring_part(self, heads_k_stride: int) -> Layout:
        """The layout of the ring that runs across the Ulysses groups of a hybrid layout."""
        return Layout(sp=self.ring, mode="ring", sharding=self.sharding,
                      ring_attn_func=self.ring_attn_func, heads_k_stride=heads_k_stride,
                      kernel=self.kernel, kernel_reason=self.kernel_reason)

    def describe(self) -> str:
        """One line: the degrees and what runs (the ranks print it at start-up)."""
        parts = [f"dp {self.dp}", f"sp {self.sp} ({self.mode}: {self.ulysses} ulysses x "
                 f"{self.ring} ring)"]
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        return (", ".join(parts) + f", sharding {self.sharding}, ring {self.ring_attn_func}, "
                f"kernel {self.kernel}")
