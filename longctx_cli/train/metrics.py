"""What a run reports as it goes, all from rank 0: `metrics.jsonl` (+ TensorBoard), Weights &
Biases, the progress bar, and a log line every `logging_steps`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from longctx_cli.config import Config
from longctx_cli.errors import UserError
from longctx_cli.launcher.startup import StartupClock
from longctx_cli.train.step import StepResult

ACCURACY = "rewards/accuracies"  # the preference metric the progress bar shows

class MetricsLog:
    """metrics.jsonl (+ TensorBoard) on rank 0; appends so a resumed run continues the file."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool, start_step: int):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def _truncate_after(self, step: int) -> None:
        """Drop lines from steps after a resumed checkpoint: they will be recomputed."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write
            if isinstance(record, dict) and record.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbLog:
    """Rank 0's Weights & Biases run (the real `wandb` library); a no-op when off."""

    def __init__(self, config: Config, enabled: bool, output_dir: Path,
                 model: torch.nn.Module):
        self.run = None
        self.log_model = config.output.wandb_log_model
        if not enabled:
            return
        try:
            import wandb
        except ImportError:
            raise UserError(
                "Weights & Biases logging is on (`wandb_project`) but `wandb` is not installed.",
                where="wandb_project",
                fix="`pip install 'longctx[wandb]'`, or remove wandb_project / set "
                "`use_wandb: false`.",
            ) from None
        self.wandb = wandb
        output_dir.mkdir(parents=True, exist_ok=True)
        output = config.output
        self.run = wandb.init(
            project=output.wandb_project, entity=output.wandb_entity, name=output.wandb_name,
            id=output.wandb_run_id, resume="allow" if output.wandb_run_id else None,
            mode=output.wandb_mode, dir=str(output_dir),
            config=config.flat_dump(mode="json", by_alias=True),
        )
        if output.wandb_watch not in (None, "false"):
            self.run.watch(model, log=output.wandb_watch, log_freq=output.logging_steps)

    def log(self, record: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def artifact(self, path: Path, name: str) -> None:
        if self.run is None or self.log_model in (None, "false"):
            return
        artifact = self.wandb.Artifact(name=name, type="model")
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


class Metrics:
    """Every report of a run; the other ranks hold one too, whose parts are all no-ops."""

    def __init__(self, config: Config, model: torch.nn.Module, num_steps: int,
                 start_step: int, is_main: bool):
        output_dir = Path(config.output.output_dir)
        self.is_main, self.num_steps = is_main, num_steps
        self.logging_steps = config.output.logging_steps
        self.tokens = 0  # target tokens trained by this process, for the summary
        self.file = MetricsLog(output_dir, is_main, config.output.use_tensorboard, start_step)
        self.tracker = WandbLog(config, is_main and config.output.wandb_enabled, output_dir,
                                 model)
        self.progress = tqdm(
            # disable=None: a bar on a terminal only; logs and pipes get the log lines below.
            total=num_steps, initial=start_step, disable=True if not is_main else None,
            desc="train", unit="step",
            dynamic_ncols=True,
        )

    def write(self, line: str) -> None:
        """A line of the run's log (rank 0), printed without tearing the progress bar."""
        if self.is_main:
            self.progress.write(line)

    def log(self, step: int, result: StepResult, lr: float, seconds: float,
            eval_loss: float | None = None, stopped: str | None = None,
            eval_metrics: dict[str, float] | None = None) -> None:
        """Report optimizer step `step` (0-based): the record, the bar and the log line
        (a preference run adds TRL's metrics, and their `eval_` twins at eval steps)."""
        self.tokens += result.tokens
        record = {
            "step": step + 1,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens": result.tokens,
            "tokens_per_sec": result.tokens / seconds if seconds > 0 else 0.0,
        }
        record.update(result.metrics)
        if result.skipped:
            record["skipped"] = True
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
            record.update(eval_metrics or {})
        if stopped is not None:
            record["stopped"] = stopped
        self.file.write(record)
        self.tracker.log(record)
        self.progress.update(1)
        accuracy = {"acc": f"{result.metrics[ACCURACY]:.2f}"} if ACCURACY in result.metrics else {}
        if "reward" in result.metrics:  # rl: grpo
            accuracy["reward"] = f"{result.metrics['reward']:.3f}"
        self.progress.set_postfix(
            loss=f"{result.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_sec']:.0f}",
            **accuracy,
        )
        if (step + 1) % self.logging_steps == 0 or step + 1 == self.num_steps:
            shown = result.metrics if result.shown is None else {
                k: result.metrics[k] for k in result.shown if k in result.metrics}
            extra = "".join(f" {k} {v:.4f}" for k, v in shown.items())
            extra += f" eval_loss {eval_loss:.4f}" if eval_loss is not None else ""
            extra += "".join(f" {k} {v:.4f}" for k, v in (eval_metrics or {}).items()
                             if eval_loss is not None)
            self.write(
                f"step {step + 1}/{self.num_steps} loss {result.loss:.4f} lr {lr:.2e} "
                f"grad_norm {result.grad_norm:.3f} tokens/s {record['tokens_per_sec']:.0f}{extra}"
            )

    def startup(self, clock: StartupClock, output_dir: Path) -> None:
        """The time from the command to the first step, by phase: a log line and
        output_dir/startup.json."""
        if self.is_main:
            (output_dir / "startup.json").write_text(json.dumps(clock.record(), indent=1))
            self.write(clock.line())

    def artifact(self, path: Path, name: str) -> None:
        """A saved model as a wandb artifact (with `wandb_log_model`; rank 0 only)."""
        if self.is_main:
            self.tracker.artifact(path, name)

    def close(self) -> None:
        """End the bar and the metric files (before the final save and export)."""
        self.progress.close()
        self.file.close()

    def finish(self, final: Path | None = None) -> None:
        """End the wandb run, after logging the exported model (if the run got that far)."""
        if final is not None:
            self.artifact(final, "final")
        self.tracker.finish()
