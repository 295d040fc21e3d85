"""The smallest sequence_parallel_degree whose memory estimate fits a per-rank budget.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from longctx_cli.config.memory_estimate import estimate_memory
from longctx_cli.config.plan import Plan, layout_for
from longctx_cli.config.schema import Config
from longctx_cli.config.sections.parallel import check_heads, check_sequence_len
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.units import GIB, format_gib, memory_size
from longctx_cli.errors import UserError

# ---- smallest sp that fits --------------------------------------------------------------

def parse_memory_size(text: str) -> int:
    """Bytes in "80GiB", "80G" (binary), "80GB" (decimal), "512MiB" or a plain byte count."""
    size = memory_size(text)
    if size is None:
        raise UserError(
            f"--memory-per-rank {text!r} is not a memory size.",
            fix="write a number and a unit, e.g. `80GiB`, `24GB` or `512MiB`.",
        )
    return size


@dataclass(frozen=True)
class SpFit:
    """The estimate at one sequence-parallel degree, or why that degree is not legal."""

    sp: int
    total: int | None
    reason: str = ""

    def fits(self, limit: int) -> bool:
        return self.total is not None and self.total <= limit


def _sp_candidates(world_size: int, limit: int = 1024) -> list[int]:
    """Divisors of the world size, then powers of two beyond it (runs that need more ranks)."""
    divisors = {d for d in range(1, world_size + 1) if world_size % d == 0}
    powers = {2**k for k in range(11) if world_size < 2**k <= limit}
    return sorted(divisors | powers)


def _fit_at(
    config: Config, shape: ModelShape, world_size: int, sp: int, host_is_device: bool,
    tiled_scores: bool = False,
) -> SpFit:
    trial = config.model_copy(update={"sequence_parallel_degree": sp})
    world = max(world_size, sp)
    try:
        # The layout of one SP (x TP) group: the rules of the degree itself.
        one_group = trial.model_copy(update={"dp_replicate_size": None, "dp_shard_size": None})
        layout = layout_for(one_group, sp * trial.parallel.tensor_parallel_size, None)
        check_sequence_len(trial.data.sequence_len, layout)
        check_heads(layout, shape)
    except UserError as e:
        return SpFit(sp, None, str(e).split(":")[0])
    estimate = estimate_memory(
        trial, shape, world, layout, host_is_device=host_is_device,
        tiled_scores=tiled_scores,
    )
    return SpFit(sp, estimate[0].total)


def smallest_fitting_sp(
    config: Config,
    shape: ModelShape,
    world_size: int,
    memory_per_rank: int,
    host_is_device: bool = False,
    tiled_scores: bool = False,
) -> tuple[SpFit | None, list[SpFit]]:
    """The smallest legal sp whose per-rank estimate fits, and every degree tried up to it.

    Degrees beyond the world size are tried too (they answer "how many ranks would it
    take"); with `fsdp` the weights are then sharded over that many ranks.
    """
    tried = []
    for sp in _sp_candidates(world_size):
        fit = _fit_at(config, shape, world_size, sp, host_is_device, tiled_scores)
        tried.append(fit)
        if fit.fits(memory_per_rank):
            return fit, tried
    return None, tried


def fit_report(config: Config, plan: Plan, memory_per_rank: int) -> list[str]:
    """Lines answering `--memory-per-rank`: the smallest sp that fits, and the degrees tried."""
    budget = estimate_budget(memory_per_rank)
    best, tried = smallest_fitting_sp(
        config, plan.model, plan.world_size, budget, plan.host_is_device,
        plan.memory.score_tiles > 0,
    )
    lines = [f"memory per rank {format_gib(memory_per_rank)} (estimates up to "
             f"{format_gib(budget)} fit: {MARGIN_TEXT}):"]
    for fit in tried:
        what = format_gib(fit.total) if fit.total is not None else f"not legal ({fit.reason})"
        lines.append(f"  sp {fit.sp:>4}: {what}")
    if best is None:
        lines.append(f"no sequence-parallel degree up to {tried[-1].sp} fits; lower sequence_len "
                     "or turn on gradient_checkpointing / chunked_loss / tiled_mlp / fsdp.")
    elif best.sp > plan.world_size:
        lines.append(f"smallest sp that fits: {best.sp} ({format_gib(best.total or 0)} per rank), "
                     f"more than the {plan.world_size} ranks of this launch.")
    else:
        sp = plan.layout.sp
        lines.append(f"smallest sp that fits: {best.sp} ({format_gib(best.total or 0)} per rank)"
                     + ("" if best.sp == sp else f"; the config uses sp {sp}."))
    return lines


# ---- the fit of the plan on the target's memory ----------------------------------------

# What a rank holds beyond the estimate: the CUDA context, cuBLAS/cuDNN workspaces and NCCL
# buffers, then the caching allocator's fragmentation as a share of what it holds.
CUDA_CONTEXT_BYTES = GIB
FRAGMENTATION = 0.10
MARGIN_TEXT = "1 GiB for the CUDA context and NCCL, 10% for fragmentation"


def with_margin(total: int) -> int:
    """What a rank needs for an estimate of `total` bytes."""
    return total + CUDA_CONTEXT_BYTES + int(total * FRAGMENTATION)


def estimate_budget(memory: int) -> int:
    """The largest estimate whose need (`with_margin`) fits in `memory` bytes."""
    return max(0, int((memory - CUDA_CONTEXT_BYTES) / (1 + FRAGMENTATION)))


@dataclass(frozen=True)
class Target:
    """The memory one rank of the run has, and where that figure came from."""

    bytes: int
    source: str


def target_memory(config: Config, flag: str | None) -> Target | None:
    """The target's memory per rank: `--memory-per-rank`, else the config's `memory_per_rank`
    (Axolotl's `gpu_memory_limit`), else the smallest GPU of this machine; None: unknown."""
    if flag is not None:
        return Target(parse_memory_size(flag), f"--memory-per-rank {flag}")
    if config.memory.memory_per_rank_bytes is not None:
        axolotl = "gpu_memory_limit" in dict(config.axolotl_notes)
        return Target(config.memory.memory_per_rank_bytes,
                      f"`{'gpu_memory_limit' if axolotl else 'memory_per_rank'}: "
                      f"{config.memory.memory_per_rank}`")
    local = _local_gpu_memory()
    return None if local is None else Target(local[0], f"this machine's {local[1]}")


def _local_gpu_memory() -> tuple[int, str] | None:
    """The memory of this machine's smallest CUDA GPU and its name, if it has one."""
    from longctx_cli.kernel_choice import Platform

    if not Platform.detect().cuda:
        return None
    import torch

    props = min((torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                key=lambda p: p.total_memory)
    return props.total_memory, props.name


def judge_fit(config: Config, plan: Plan, target: Target) -> str:
    """The plan's fit line, or a UserError naming the parts that dominate and the fixes that
    would fit, each re-planned with every rule before it is offered."""
    needed = with_margin(plan.memory.total)
    if needed <= target.bytes:
        return (f"fit: {format_gib(needed)} per rank ({format_gib(plan.memory.total)} estimated "
                f"+ {MARGIN_TEXT}) of {format_gib(target.bytes)} ({target.source})")
    parts = sorted(plan.memory.parts(), key=lambda p: -p[1])[:3]
    fixes = [f"{what} ({format_gib(with_margin(total))})"
             for what, total in _fixes_that_fit(config, plan, target.bytes)]
    raise UserError(
        f"the plan needs about {format_gib(needed)} per rank ({format_gib(plan.memory.total)} "
        f"estimated + {MARGIN_TEXT}), more than the {format_gib(target.bytes)} of "
        f"{target.source}; most of it is "
        + ", ".join(f"{name} {format_gib(size)}" for name, size in parts) + ".",
        fix=("any of: " + "; ".join(fixes) + " (each re-planned with every rule, its need "
             "in brackets)." if fixes else
             "nothing longctx can change alone fits this launch: launch more ranks or lower "
             "`sequence_len` / `micro_batch_size`, then validate again."),
    )


def _replanned(trial: Config, plan: Plan) -> int | None:
    """The estimate of `trial` on the plan's world, or None where a rule refuses it."""
    from longctx_cli.config.plan import build_plan

    try:
        return build_plan(trial, plan.world_size, plan.model, world_source=plan.world_source,
                          assume_gpu=True).memory.total
    except UserError:
        return None


def _fixes_that_fit(config: Config, plan: Plan, limit: int) -> list[tuple[str, int]]:
    """The changes of one key whose re-planned need fits `limit`: the smallest sp
    this launch allows, checkpointing, offload, tiled MLPs, FSDP, the longest row."""
    memory, sp = config.memory, plan.layout.sp
    trials: list[tuple[str, dict[str, object]]] = [
        (f"`sequence_parallel_degree: {d}`", {"sequence_parallel_degree": d})
        for d in range(sp + 1, plan.world_size + 1) if plan.world_size % d == 0
    ]
    if not memory.gradient_checkpointing:
        trials.append(("`gradient_checkpointing: true`", {"gradient_checkpointing": True}))
    if not memory.activation_offloading:
        trials.append(("`activation_offloading: true`", {"activation_offloading": True}))
    if not memory.tiled_mlp:
        trials.append(("`tiled_mlp: true`", {"tiled_mlp": True}))
    if not config.parallel.fsdp and plan.world_size > 1:
        trials.append(("`fsdp: true`", {"fsdp": True}))
    fits: list[tuple[str, int]] = []
    taken_sp = False
    for what, update in trials:
        total = _replanned(config.model_copy(update=update), plan)
        if total is None or with_margin(total) > limit:
            continue
        if "sequence_parallel_degree" in update:
            if taken_sp:
                continue  # the smallest degree that fits, alone
            taken_sp = True
        fits.append((what, total))
    row = _longest_row(config, plan, limit)
    if row is not None:
        fits.append((f"`sequence_len: {row[0]}` (the longest row that fits)", row[1]))
    return fits


def _longest_row(config: Config, plan: Plan, limit: int) -> tuple[int, int] | None:
    """The longest `sequence_len` (a multiple of the layout's) whose need fits, and its
    estimate; None where not even the shortest fits."""
    step = plan.layout.sequence_len_multiple
    if config.data.sequence_len >= 2 * math.lcm(step, 1024):
        step = math.lcm(step, 1024)  # a round length where the row allows one
    low, high, best = 1, config.data.sequence_len // step - 1, None
    while low <= high:  # the estimate grows with the row
        mid = (low + high) // 2
        total = _replanned(config.model_copy(update={"sequence_len": mid * step}), plan)
        if total is not None and with_margin(total) <= limit:
            best, low = (mid * step, total), mid + 1
        else:
            high = mid - 1
    return best
