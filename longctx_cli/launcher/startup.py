"""How long a run takes from the command to its first step, phase by phase.

`longctx train` spends its first seconds in three processes: the launcher (imports, the plan,
the data cache check), torchrun, and the ranks (imports, the plan again, the fidelity probe,
the process group, the data, the model). The launcher hands its clock to the ranks through
the environment (`STARTUP_ENV`); rank 0 reports the whole, from the moment the command's
process was created, in the log and in output_dir/startup.json. Ranks a
user's own torchrun or srun started count from their own creation.

It also decides what a rank need not import (`needs_torchao`, `hide_torchao`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STARTUP_ENV = "LONGCTX_STARTUP"
# When the rank process torchrun started was created, where a warm process runs the rank
# (`launcher.warm_ranks`): the clock counts torchrun's part up to then, not to the warm
# process's own (earlier) creation.
RANK_CREATED_ENV = "LONGCTX_RANK_CREATED"

# Libraries transformers imports whatever the model log warnings at import that say nothing
# about the run: torchao (which transformers imports where it is installed) failing to load
# its kernels for other CPUs/GPUs, torch deprecating how torchao registers its enums, and
# bitsandbytes failing to fetch an optional CPU kernel from the hub (it falls back to its
# own). Silenced at their source, once per process (the CLI and every rank).
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


def quiet_library_loggers() -> None:
    import logging

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def process_created_at() -> float:
    """Wall-clock time at which this process was created (Linux /proc, to ~10 ms); now
    elsewhere."""
    try:
        after_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - after_boot / os.sysconf("SC_CLK_TCK"))


@dataclass
class StartupClock:
    """Named phases since `origin` (epoch seconds); `mark` closes the phase that ran since
    the last mark."""

    origin: float
    phases: list[tuple[str, float]] = field(default_factory=list)
    last: float = 0.0

    def __post_init__(self) -> None:
        self.last = self.last or self.origin

    @classmethod
    def of_this_process(cls) -> StartupClock:
        """The launcher's clock when it started this rank (its phases, then the gap until
        this process existed as "torchrun"), else a clock from this process's creation."""
        created = float(os.environ.get(RANK_CREATED_ENV) or process_created_at())
        handed = os.environ.get(STARTUP_ENV)
        if handed:
            try:
                state = json.loads(handed)
                clock = cls(float(state["origin"]), [tuple(p) for p in state["phases"]],
                            float(state["at"]))
            except (ValueError, KeyError, TypeError):
                return cls(created)
            clock.phases.append(("torchrun", max(0.0, created - clock.last)))
            clock.last = created
            return clock
        return cls(created)

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self.last))
        self.last = now

    def handed_on(self) -> str:
        """This clock for `STARTUP_ENV` in the environment of the processes it starts."""
        return json.dumps({"origin": self.origin, "phases": self.phases, "at": time.time()})

    @property
    def total(self) -> float:
        return self.last - self.origin

    def record(self) -> dict:
        """What output_dir/startup.json holds."""
        return {"seconds": round(self.total, 3), "first_step_at": self.last,
                "phases": {name: round(s, 3) for name, s in self.phases}}

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.phases)
        return f"first step {self.total:.1f} s after the command ({parts})"


# ---- what a rank imports -------------------------------------------------------------------

def _quant_method(fields: Any) -> str | None:
    quant = fields.get("quantization_config") if isinstance(fields, dict) else None
    return str(quant.get("quant_method")).lower() if isinstance(quant, dict) else None


def _checkpoint_config(model_id: str, revision: str | None = None) -> dict | None:
    """A checkpoint's config.json as a dict, from a local folder or the local Hugging Face
    cache (never the network); None when it is not at hand."""
    folder = Path(model_id).expanduser()
    path: Any = folder / "config.json" if folder.is_dir() else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model_id, "config.json", revision=revision)
        except Exception:  # noqa: BLE001 - an id the hub client rejects: not at hand
            return None
        if not isinstance(path, str):
            return None
    try:
        fields = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return fields if isinstance(fields, dict) else None


def needs_torchao(config: Any, optimizer_uses_it: bool) -> bool:
    """Whether a run can use torchao: its optimizer, or a checkpoint quantized with it (or
    one whose config is not at hand, or remote code, which could be either)."""
    if optimizer_uses_it or config.model.trust_remote_code:
        return True
    if config.model.model_config_dict is not None:
        return _quant_method(config.model.model_config_dict) == "torchao"
    model = config.model
    for model_id in {str(m) for m in (model.base_model, model.base_model_config) if m}:
        fields = _checkpoint_config(model_id, **model.revision_kwargs(model_id))
        if fields is None or _quant_method(fields) == "torchao":
            return True
    return False


def hide_torchao() -> bool:
    """Make torchao look absent to this process, before transformers is imported: where it
    is installed, transformers imports it with its model code to offer torchao quantization
    (half a second of every rank's start-up on a 2-core Xeon), which a run that uses neither
    its optimizers nor its quantization never calls. False (nothing done) once transformers
    or torchao is imported: transformers may have taken note of torchao already."""
    if "transformers" in sys.modules or "torchao" in sys.modules:
        return False
    sys.modules["torchao"] = None  # type: ignore[assignment]  # find_spec then says "absent"
    return True
