"""The smallest sequence_parallel_degree whose memory estimate fits a per-rank budget.

Nothing here imports `torch.distributed`; torch is imported only inside functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from longctx_cli.config.memory_estimate import estimate_memory
from longctx_cli.config.plan import Plan, layout_for
from longctx_cli.config.schema import Config
from longctx_cli.config.sections.parallel import check_heads, check_sequence_len
from longctx_cli.config.shape import ModelShape
from longctx_cli.config.units import GIB, format_gib
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    pass

# ---- smallest sp that fits --------------------------------------------------------------

_SIZE_UNITS = {
    "b": 1, "kib": 1024, "mib": 1024**2, "gib": GIB, "tib": 1024**4,
    "k": 1024, "m": 1024**2, "g": GIB, "t": 1024**4,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_memory_size(text: str) -> int:
    """Bytes in "80GiB", "80G" (binary), "80GB" (decimal), "512MiB" or a plain byte count."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):] or "b"
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _SIZE_UNITS or value <= 0:
        raise UserError(
            f"--memory-per-rank {text!r} is not a memory size.",
            fix="write a number and a unit, e.g. `80GiB`, `24GB` or `512MiB`.",
        )
    return int(value * _SIZE_UNITS[unit])


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
    best, tried = smallest_fitting_sp(
        config, plan.model, plan.world_size, memory_per_rank, plan.host_is_device,
        plan.memory.score_tiles > 0,
    )
    lines = [f"memory per rank {format_gib(memory_per_rank)}:"]
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
