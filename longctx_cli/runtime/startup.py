"""How long a run takes from the command to its first step, phase by phase.

`longctx train` spends its first seconds in three processes: the launcher (imports, the plan,
the data cache check), torchrun, and the ranks (imports, the plan again, the fidelity probe,
the process group, the data, the model). The launcher hands its clock to the ranks through
the environment (`STARTUP_ENV`); rank 0 reports the whole, from the moment the command's
process was created, in the log and in output_dir/startup.json. Ranks a
user's own torchrun or srun started count from their own creation.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

STARTUP_ENV = "LONGCTX_STARTUP"


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
        created = process_created_at()
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
