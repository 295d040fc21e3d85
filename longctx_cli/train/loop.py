"""The training loop, top to bottom: setup, loop, step, log, save.

Runs inside every rank of a torchrun job. The loss of an optimizer step is the single-device
mean over every valid target token of the step: each rank sums CE over its own shard, the
divisor is the exact valid-token count over the SP group, the DP group and the accumulation
window, and gradients are summed over the world.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from longctx_cli.config import Config
from longctx_cli.config.plan import wandb_enabled
from longctx_cli.constants import IGNORE_INDEX
from longctx_cli.data.stream import PackedStream
from longctx_cli.data.tokenizer import load_tokenizer
from longctx_cli.data.tokenizer import pad_id as tokenizer_pad_id
from longctx_cli.errors import UserError
from longctx_cli.parallel.sharding import ShardedBatch, shard_batch
from longctx_cli.runtime.batches import collate, micro_batches, step_row_indices, to_device
from longctx_cli.runtime.distributed import (
    RankContext,
    init_distributed,
    init_parallel,
    load_rows,
    rank_context,
)
from longctx_cli.runtime.memory import activation_offload
from longctx_cli.runtime.model import (
    build_model,
    decoder_and_head,
    load_base_model,
    model_config_of,
    sp_hidden_states,
)
from longctx_cli.train.checkpoint import (
    export_final,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from longctx_cli.train.fidelity import run_probe
from longctx_cli.train.loss import lm_loss_sum, valid_token_count
from longctx_cli.train.optim import (
    EarlyStopping,
    LossWatchdog,
    WandbLog,
    eval_interval,
    is_plateau,
    make_optimizer,
    make_scheduler,
    save_interval,
)
from longctx_cli.train.precision import Precision, setup_precision
from longctx_cli.train.summary import gather_peak_memory, summary_lines


@dataclass
class StepResult:
    loss: float
    tokens: int
    grad_norm: float
    skipped: bool


# ---------------------------------------------------------------------------------------
# setup helpers


def rows_per_step(config: Config, dp_size: int) -> int:
    return dp_size * config.micro_batch_size * config.gradient_accumulation_steps


def total_steps(config: Config, num_rows: int, dp_size: int) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps); the last partial step of an epoch is dropped."""
    per_step = rows_per_step(config, dp_size)
    steps_per_epoch = num_rows // per_step
    if steps_per_epoch == 0:
        raise UserError(
            f"the training set has {num_rows} packed rows but one optimizer step needs "
            f"{per_step} (dp {dp_size} x micro_batch_size {config.micro_batch_size} x "
            f"gradient_accumulation_steps {config.gradient_accumulation_steps}).",
            where="datasets",
            fix="add data, or lower micro_batch_size / gradient_accumulation_steps.",
        )
    if config.max_steps is not None:
        return steps_per_epoch, config.max_steps
    return steps_per_epoch, max(1, math.ceil(config.num_epochs * steps_per_epoch))


# ---------------------------------------------------------------------------------------
# streamed data (pretraining_dataset): the stream position travels in the trainer state


def stream_step_rows(stream: PackedStream, per_step: int):
    """The next step's rows; every rank reads the same stream and keeps its own slice."""
    from datasets import Dataset

    return Dataset.from_list(stream.next_rows(per_step)), list(range(per_step))


def data_state(stream: PackedStream | None) -> dict:
    return {"data": {"stream": stream.state_dict()}} if stream is not None else {}


def restore_stream(stream: PackedStream, trainer_state: dict, path: Path) -> None:
    saved = trainer_state.get("data", {}).get("stream")
    if saved is None:
        raise UserError(
            f"{path} has no stream position, so the streamed data cannot resume where it "
            "stopped.",
            where="resume_from_checkpoint",
            fix="resume from a checkpoint of a `pretraining_dataset` run, or start afresh.",
        )
    stream.load_state_dict(saved)


# ---------------------------------------------------------------------------------------
# the step


def forward_loss_sum(decoder, lm_head, batch: ShardedBatch, config: Config) -> torch.Tensor:
    hidden = sp_hidden_states(decoder, batch)
    chunk = config.loss_chunk_size if config.chunked_loss else None
    if batch.sp_meta.ctx.tp is not None:  # vocab-parallel CE over the TP group
        from longctx_cli.parallel.tensor_parallel import tp_loss_sum

        return tp_loss_sum(lm_head, hidden, batch.shift_labels, batch.sp_meta.ctx.tp, chunk)
    return lm_loss_sum(lm_head, hidden, batch.shift_labels, chunk)


def check_fidelity(config: Config) -> str:
    """Run the fidelity probe on the run's model config (UserError on a difference);
    returns the line the start-up log prints."""
    if not config.fidelity_probe:
        return "skipped (`fidelity_probe: false`): exactness against the model is not checked"
    return run_probe(model_config_of(config), config.trust_remote_code).summary()


def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Sum gradients over the world in one flat buffer per dtype (the loss is pre-divided)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def nonfinite_ranks(local_value: float, device) -> list[int]:
    """Ranks whose local value is NaN/inf (a collective: every rank calls it)."""
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(not math.isfinite(local_value))
    dist.all_reduce(flags)
    return [r for r, bad in enumerate(flags.tolist()) if bad]


def train_step(
    model, decoder, lm_head, params, optimizer, batches: list[ShardedBatch], config: Config,
    device, use_fsdp: bool, precision: Precision | None = None,
) -> StepResult:
    precision = precision or Precision(device.type)
    local_count = sum(valid_token_count(b.shift_labels) for b in batches)
    (global_count,) = all_reduce_sum([local_count], device)
    divisor = max(global_count, 1.0)
    # FSDP2 averages gradients over its mesh (the world, or dp x cp with TP, whose own sums
    # DTensor does); the loss is already normalised by the global token count, so scale it
    # up to turn that average into the sum we need.
    tp = batches[0].sp_meta.ctx.tp
    replicas = dist.get_world_size() // (tp.size if tp is not None else 1)
    backward_divisor = divisor / replicas if use_fsdp else divisor
    local_loss = 0.0
    for i, batch in enumerate(batches):
        if use_fsdp:
            # Reduce-scatter only after the last micro-batch of the window.
            model.set_requires_gradient_sync(i == len(batches) - 1)
        with activation_offload(config.activation_offloading):
            with precision.autocast():
                loss_sum = forward_loss_sum(decoder, lm_head, batch, config)
            precision.scale(loss_sum / backward_divisor).backward()
        local_loss += loss_sum.item()
    if not use_fsdp and tp is not None:
        from longctx_cli.parallel.tensor_parallel import reduce_tp_gradients

        reduce_tp_gradients(params, tp.replica_group)
    elif not use_fsdp and dist.get_world_size() > 1:
        reduce_gradients(params)
    bad = nonfinite_ranks(local_loss, device)
    (loss_sum_global,) = all_reduce_sum([local_loss], device)
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else float("inf")
    precision.unscale(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = bool(bad) or not math.isfinite(grad_norm)
    if skipped and config.on_nonfinite == "stop" and not (
        not bad and precision.overflowed(grad_norm)  # fp16 loss scaling backs off instead
    ):
        if bad:
            raise NonFiniteError(f"the loss on rank(s) {bad}")
        name = first_nonfinite_grad(model)
        raise NonFiniteError(f"the gradient of `{name}`" if name else "the gradient norm")
    if not skipped:
        precision.step(optimizer)
    precision.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum_global / divisor, int(global_count), grad_norm, skipped)


def first_nonfinite_grad(model: torch.nn.Module) -> str | None:
    """Name of the first parameter whose (local part of the) gradient is NaN or infinite."""
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2 shards
        if not bool(torch.isfinite(local).all()):
            return name
    return None


class NonFiniteError(Exception):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


@torch.no_grad()
def evaluate_loss(decoder, lm_head, rows, config: Config, where: RankContext) -> float:
    """Token-weighted eval loss over all ranks; every rank runs the same number of forwards."""
    dp_rank, dp_size, device = where.dp_rank, where.dp_size, where.device
    per_rank = math.ceil(len(rows) / dp_size)
    loss_sum, count = 0.0, 0
    for i in range(per_rank):
        index = dp_rank + i * dp_size
        real = index < len(rows)
        row = collate(rows.select([index if real else 0]))
        batch = to_device(shard_batch(*row, where.sp_ctx, where.pad_id), device)
        if not real:  # keep collectives in step, contribute nothing
            batch.shift_labels.fill_(IGNORE_INDEX)
        loss_sum += forward_loss_sum(decoder, lm_head, batch, config).item()
        count += valid_token_count(batch.shift_labels)
    total_loss, total_count = all_reduce_sum([loss_sum, count], device)
    return total_loss / total_count if total_count else float("nan")


# ---------------------------------------------------------------------------------------
# logging


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


# ---------------------------------------------------------------------------------------
# the run


def train(config: Config) -> None:
    # ---- setup ------------------------------------------------------------------------
    device = init_distributed(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel = init_parallel(config, device)
    dp_size = parallel.dp_size
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    output_dir = Path(config.output_dir)

    # Before any data or weights: refuse a family longctx would not train exactly. Every
    # rank runs the (cheap, deterministic) probe, so all of them stop together on a refusal.
    probe = check_fidelity(config)
    if rank == 0:
        print(f"fidelity probe: {probe}", flush=True)

    tokenizer = load_tokenizer(config)
    where = rank_context(parallel, tokenizer_pad_id(tokenizer), device)
    # pretraining_dataset: rows come from a stream packed on the fly, not from the cache.
    stream = PackedStream(config, tokenizer) if config.pretraining_dataset else None
    train_rows, eval_rows = (None, None) if stream else load_rows(config, tokenizer)

    model = build_model(config, fsdp_mesh=parallel.world_mesh if config.fsdp else None,
                        tp=parallel.tp)
    if not (config.load_in_4bit or config.load_in_8bit):  # bitsandbytes placed those already
        model.to(device)
    use_fsdp = config.fsdp and world > 1 and parallel.world_mesh is not None
    precision = setup_precision(model, config.dtype, device,
                                sharded_grads=use_fsdp or parallel.tp is not None)
    decoder, lm_head = decoder_and_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    if stream is not None:
        steps_per_epoch = num_steps = config.max_steps
    else:
        steps_per_epoch, num_steps = total_steps(config, len(train_rows), dp_size)
    scheduler = make_scheduler(config, optimizer, num_steps)
    save_every = save_interval(config, steps_per_epoch, num_steps)
    eval_every = eval_interval(config, steps_per_epoch, num_steps)
    early_stop = EarlyStopping(config.early_stopping_patience)
    watchdog = LossWatchdog(config.loss_watchdog_threshold, config.loss_watchdog_patience)

    start_step = 0
    resume_path = resolve_resume(config.resume_from_checkpoint, output_dir)
    if resume_path is not None:
        trainer_state = load_checkpoint(resume_path, model, optimizer, scheduler)
        start_step = trainer_state["step"]
        if stream is not None:
            restore_stream(stream, trainer_state, resume_path)
    metrics = MetricsLog(output_dir, rank == 0, config.use_tensorboard, start_step)
    tracker = WandbLog(config, rank == 0 and wandb_enabled(config), output_dir, model)
    progress = tqdm(
        # disable=None: a bar on a terminal only; logs and pipes get the log lines below.
        total=num_steps, initial=start_step, disable=True if rank != 0 else None,
        desc="train", unit="step",
        dynamic_ncols=True,
    )
    if rank == 0 and resume_path is not None:
        progress.write(f"resumed from {resume_path} at step {start_step}")

    # ---- loop -------------------------------------------------------------------------
    per_step = rows_per_step(config, dp_size)
    last_checkpoint = resume_path
    run_started, run_tokens = time.perf_counter(), 0  # for the summary at the end
    for step in range(start_step, num_steps):
        if stream is not None:
            rows, indices = stream_step_rows(stream, per_step)
        else:
            rows = train_rows
            indices = step_row_indices(step, steps_per_epoch, per_step, len(train_rows),
                                       config.seed)
        batches = micro_batches(rows, indices, config, where)
        lr = optimizer.param_groups[0]["lr"]
        started = time.perf_counter()
        try:
            result = train_step(
                model, decoder, lm_head, params, optimizer, batches, config, device, use_fsdp,
                precision,
            )
        except NonFiniteError as e:
            kept = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else (
                "no checkpoint was written yet")
            raise UserError(
                f"step {step + 1}: {e.what} is NaN or infinite; training stopped and {kept}.",
                where="on_nonfinite",
                fix="lower learning_rate, raise warmup_steps, check the data, or set "
                "`on_nonfinite: skip` to drop such steps.",
            ) from None
        if not is_plateau(config):
            scheduler.step()
        seconds = time.perf_counter() - started
        run_tokens += result.tokens

        # ---- log ----------------------------------------------------------------------
        record = {
            "step": step + 1,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "tokens": result.tokens,
            "tokens_per_sec": result.tokens / seconds if seconds > 0 else 0.0,
        }
        if result.skipped:
            record["skipped"] = True
        stop = None
        if eval_every and eval_rows is not None and (step + 1) % eval_every == 0:
            record["eval_loss"] = evaluate_loss(
                decoder, lm_head, eval_rows, config, where
            )
            if is_plateau(config):
                scheduler.step(record["eval_loss"])
            if early_stop.should_stop(record["eval_loss"]):
                stop = record["stopped"] = "early_stopping"
        if watchdog.tripped(result.loss):
            stop = record["stopped"] = "loss_watchdog"
        metrics.write(record)
        tracker.log(record)
        progress.update(1)
        progress.set_postfix(
            loss=f"{result.loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_sec']:.0f}"
        )
        if rank == 0 and ((step + 1) % config.logging_steps == 0 or step + 1 == num_steps):
            extra = f" eval_loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""
            progress.write(
                f"step {step + 1}/{num_steps} loss {result.loss:.4f} lr {lr:.2e} "
                f"grad_norm {result.grad_norm:.3f} tokens/s {record['tokens_per_sec']:.0f}{extra}"
            )

        # ---- save ---------------------------------------------------------------------
        if save_every and (step + 1) % save_every == 0 and step + 1 < num_steps:
            last_checkpoint = save_checkpoint(
                output_dir, step + 1, model, optimizer, scheduler,
                {"step": step + 1, "epoch": (step + 1) / steps_per_epoch,
                 **data_state(stream)},
                keep=config.save_total_limit,
            )
            if rank == 0:
                tracker.artifact(last_checkpoint, f"checkpoint-{step + 1}")
        if stop == "loss_watchdog":
            progress.close()
            metrics.close()
            tracker.finish()
            raise UserError(
                f"step {step + 1}: the training loss stayed above {config.loss_watchdog_threshold}"
                f" for {config.loss_watchdog_patience} steps in a row; training stopped "
                f"(last checkpoint: {last_checkpoint or 'none'}).",
                where="loss_watchdog_threshold",
                fix="lower learning_rate or raise warmup, check the data, or raise/remove "
                "loss_watchdog_threshold.",
            )
        if stop == "early_stopping":
            if rank == 0:
                progress.write(f"early stopping at step {step + 1}: eval loss did not improve "
                               f"for {config.early_stopping_patience} evaluations")
            num_steps = step + 1
            break

    # ---- finish -----------------------------------------------------------------------
    progress.close()
    metrics.close()
    if save_every:
        save_checkpoint(
            output_dir, num_steps, model, optimizer, scheduler,
            {"step": num_steps, "epoch": num_steps / steps_per_epoch, **data_state(stream)},
            keep=config.save_total_limit,
        )
    base_saver = None
    if config.adapter is not None and config.model_config_dict is not None:
        # A random-init base exists nowhere else: ship it beside the adapter (unquantized).
        def base_saver(path: Path) -> None:
            load_base_model(config, "sdpa", quantize=False).save_pretrained(
                path, safe_serialization=True
            )
    final = export_final(model, tokenizer, output_dir / "final", config.adapter is not None,
                         base_saver)
    peaks = gather_peak_memory(device)
    if rank == 0:
        tracker.artifact(final, "final")
    tracker.finish()
    if rank == 0:
        lines = summary_lines(time.perf_counter() - run_started, num_steps - start_step,
                              run_tokens, peaks, device, output_dir, final)
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()



