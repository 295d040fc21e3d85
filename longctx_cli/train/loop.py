"""The training run, top to bottom: setup, the loop over optimizer steps, the hand-off.

Runs inside every rank of a torchrun job. Each concern keeps its own cadence in its own
module and the loop only calls it: the objective (objectives/) and the step (step.py), which
rows a step reads (schedule.py), reports (metrics.py), evaluation (evaluation.py), stop rules
(stopping.py) and checkpoints and the final export (checkpointer.py).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longctx_cli.config import Config
from longctx_cli.config.plan import Plan
from longctx_cli.data.stream import PackedStream
from longctx_cli.data.tokenizer import pad_id as tokenizer_pad_id
from longctx_cli.data.tokenizer import run_tokenizer
from longctx_cli.launcher.startup import StartupClock
from longctx_cli.parallel.mesh import ParallelState, build_parallel_state
from longctx_cli.runtime.distributed import init_distributed, load_rows
from longctx_cli.runtime.head import decoder_of
from longctx_cli.runtime.model import build_model, decoder_and_head, unwrap
from longctx_cli.train.checkpointer import Checkpointer
from longctx_cli.train.evaluation import Evaluator
from longctx_cli.train.metrics import Metrics
from longctx_cli.train.objectives import Objective, PreparedRows
from longctx_cli.train.objectives.causal_lm import CausalLm
from longctx_cli.train.objectives.grpo import Grpo
from longctx_cli.train.objectives.kto import Kto, KtoLoss
from longctx_cli.train.objectives.preference import Preference
from longctx_cli.train.objectives.reward_training import RewardLoss, RewardTraining
from longctx_cli.train.optim import is_plateau, make_optimizer, make_scheduler
from longctx_cli.train.precision import Precision, setup_precision
from longctx_cli.train.preemption import Preempted, PreemptionSignals, Progress
from longctx_cli.train.preference import PreferenceLoss, reference_table
from longctx_cli.train.schedule import DataPosition, steps_per_batch
from longctx_cli.train.step import NonFiniteError, optimizer_step
from longctx_cli.train.stopping import EARLY_STOPPING, LOSS_WATCHDOG, Stopper, nonfinite_error
from longctx_cli.train.summary import gather_peak_memory, summary_lines


def setup_model(config: Config, plan: Plan, state: ParallelState
                ) -> tuple[torch.nn.Module, Precision, bool]:
    """The model on its device, its precision, and whether FSDP2 syncs its gradients (its
    own reduce-scatter) instead of the step's `sum_gradients`."""
    model = build_model(config, state, plan.model.transformers_config())
    if not config.lora.quantized:  # bitsandbytes placed those already
        model.to(state.device)
    use_fsdp = config.parallel.fsdp and dist.get_world_size() > 1 and state.fsdp_mesh is not None
    precision = setup_precision(model, config.model.dtype, state.device,
                                sharded_grads=use_fsdp or state.layout.tp > 1)
    return model, precision, use_fsdp


def grpo_reference(config: Config, plan: Plan, state: ParallelState) -> torch.nn.Module | None:
    """GRPO's reference model where switching the adapter off does not give it (a full
    fine-tune, a continued adapter): a frozen copy of the initial model; else None."""
    if not config.trl.beta or (config.lora.adapter is not None and not config.lora.lora_model_dir):
        return None
    reference, _, _ = setup_model(config, plan, state)
    reference.requires_grad_(False)
    return reference.eval()


def leave_process_group() -> None:
    """Every rank leaves together, after its last collective: a rank that exits while another
    still talks to the group, or with the group alive, can abort at exit."""
    dist.barrier()
    dist.destroy_process_group()


def close_run(metrics: Metrics, progress: Progress, end_trackers: bool) -> None:
    """End the bar, the metric files and the heartbeat thread (and, with `end_trackers`, the
    wandb run), then leave the process group: how a run that stops early ends."""
    metrics.close()
    progress.close()
    if end_trackers:
        metrics.finish()
    leave_process_group()


def pick_objective(config: Config, plan: Plan, state: ParallelState, model: torch.nn.Module,
                   tokenizer, pad_id: int, data: DataPosition, train_rows, eval_rows,
                   is_main: bool) -> tuple[Objective, PreferenceLoss | None]:
    """The run's objective (`train/objectives/`), and its preference loss for evaluation
    (None unless `rl:` is one of the DPO family)."""
    rows = PreparedRows(data, config, state, pad_id)
    if config.objective.reward_model:  # a classifier: its decoder and `score`, no lm_head
        base = unwrap(model)
        # TRL: the head pools at the last token that is not the pad token; saved with it.
        base.config.get_text_config().pad_token_id = pad_id
        return RewardTraining(state, decoder_of(base), base.score,
                              RewardLoss(config.objective.center_rewards_coefficient), pad_id,
                              rows), None
    decoder, lm_head = decoder_and_head(model, config.trains_images)
    if config.objective.rl == "grpo":
        generations = data.steps_per_epoch // steps_per_batch(config, state.layout.dp)
        return Grpo(config, state, model, decoder, lm_head, tokenizer, train_rows, generations,
                    grpo_reference(config, plan, state), pad_id), None
    if config.objective.rl == "kto":
        return Kto(config, state, model, decoder, lm_head, KtoLoss.from_config(config), rows), None
    preference = PreferenceLoss.from_config(config)  # None: the causal-LM loss
    if preference is None:
        return CausalLm(config, state, decoder, lm_head, rows), None
    # Before a resume: a precomputed reference is the initial model's.
    splits = {"train": train_rows, **({"eval": eval_rows} if eval_rows is not None else {})}
    preference = reference_table(model, splits, config, state, pad_id, preference,
                                 say=lambda line: is_main and print(line, flush=True))
    return Preference(config, state, model, decoder, lm_head, preference, rows), preference


@dataclass
class Run:
    """What a rank trains with, once set up (`setup_run`)."""

    state: ParallelState
    model: torch.nn.Module
    precision: Precision
    use_fsdp: bool
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: DataPosition
    objective: Objective
    checkpointer: Checkpointer
    evaluator: Evaluator
    metrics: Metrics
    saved_with: Any  # what final/ saves beside the weights (a VLM's processor)
    start_step: int


def setup_run(config: Config, plan: Plan, probe: str, clock: StartupClock) -> Run:
    """The process group, the data, the model, its objective and optimizer, the resumed
    checkpoint, evaluation and metrics of this rank, each phase marked on `clock`."""
    device = init_distributed(config)
    state = build_parallel_state(plan.layout, device)
    clock.mark("process group")
    is_main = dist.get_rank() == 0
    torch.manual_seed(config.training.seed)
    random.seed(config.training.seed)
    if is_main:  # what the ranks run: the same Layout `validate` printed
        print(f"layout: {plan.layout.describe()} ({plan.layout.kernel_reason})\n"
              f"fidelity probe: {probe}", flush=True)
    # A vision-language run reads its tokenizer from the processor, and saves the processor
    # beside the weights (`saved_with`).
    tokenizer, saved_with = run_tokenizer(config)
    pad_id = tokenizer_pad_id(tokenizer)
    # pretraining_dataset: rows come from a stream packed on the fly, not from the cache.
    stream = PackedStream(config, tokenizer) if config.data.pretraining_dataset else None
    train_rows, eval_rows = (None, None) if stream else load_rows(config, tokenizer)
    clock.mark("data")

    model, precision, use_fsdp = setup_model(config, plan, state)
    if config.trains_images and config.model.tokenizer_use_mistral_common:
        from longctx_cli.data.vision.mistral import check_model_agrees

        check_model_agrees(tokenizer, model.config)  # its image tokens are the model's
    clock.mark("model")
    data = DataPosition(config, state.layout.dp, train_rows, stream)
    objective, preference = pick_objective(config, plan, state, model, tokenizer, pad_id, data,
                                           train_rows, eval_rows, is_main)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(config, params)
    scheduler = make_scheduler(config, optimizer, data.num_steps)
    checkpointer = Checkpointer(config, data, model, optimizer, scheduler)
    evaluator = Evaluator(config, state, model, preference, eval_rows, pad_id, scheduler,
                          data.steps_per_epoch, data.num_steps)
    start_step = checkpointer.resume()
    metrics = Metrics(config, model, data.num_steps, start_step, is_main)
    if checkpointer.resumed_from is not None:
        metrics.write(f"resumed from {checkpointer.resumed_from} at step {start_step}")
    clock.mark("optimizer, checkpoint, metrics")
    metrics.startup(clock, Path(config.output.output_dir))
    return Run(state, model, precision, use_fsdp, params, optimizer, scheduler, data,
               objective, checkpointer, evaluator, metrics, saved_with, start_step)


def hand_off(config: Config, run: Run, end_step: int, run_started: float) -> None:
    """After the loop: the last checkpoint, final/ and the summary, then leave the group."""
    final = run.checkpointer.finish(end_step, run.saved_with)
    peaks = gather_peak_memory(run.state.device)
    run.metrics.finish(final)
    if dist.get_rank() == 0:
        lines = summary_lines(time.perf_counter() - run_started, end_step - run.start_step,
                              run.metrics.tokens, peaks, run.state.device,
                              Path(config.output.output_dir), final)
        print("\n".join(lines), flush=True)
    leave_process_group()


def train(config: Config, plan: Plan, probe: str, clock: StartupClock | None = None) -> None:
    """The run on this rank, under the plan `preflight.check_run` built; `probe`: its verdict;
    `clock`: the startup phases so far (rank 0 reports them at the first step)."""
    run = setup_run(config, plan, probe, clock or StartupClock.of_this_process())
    data, checkpointer, metrics, optimizer = run.data, run.checkpointer, run.metrics, run.optimizer
    stopper = Stopper(config)
    end_step = data.num_steps  # unless a stop rule ends the run early
    run_started = time.perf_counter()  # for the summary at the end
    preemption = PreemptionSignals(config.run.preemption_signals)
    progress = Progress(Path(config.output.output_dir), dist.get_rank())  # read by the launcher
    for step in range(run.start_step, data.num_steps):
        lr = optimizer.param_groups[0]["lr"]
        started = time.perf_counter()
        try:
            batches = run.objective.micro_batches(step, run.use_fsdp, run.precision)
            result = optimizer_step(run.objective, batches, run.model, run.params, optimizer,
                                    config, run.state, run.use_fsdp, run.precision)
        except NonFiniteError as e:
            raise nonfinite_error(step, e, checkpointer.last) from None
        if not is_plateau(config):  # a plateau schedule steps on the eval loss instead
            run.scheduler.step()
        seconds = time.perf_counter() - started
        eval_loss = run.evaluator.maybe_eval(step)
        stop = stopper.check(result.loss, eval_loss)
        metrics.log(step, result, lr, seconds, eval_loss, stop, run.evaluator.metrics)
        checkpointer.maybe_save(step, metrics)
        progress.step_done(step + 1)
        signal_name = preemption.agreed(run.state.device) if step + 1 < data.num_steps else None
        if signal_name is not None:  # every rank saw it at this step: save, then exit 75
            saved = checkpointer.preempt(step, metrics, signal_name)
            close_run(metrics, progress, end_trackers=False)  # wandb resumes the same run
            raise Preempted(step + 1, saved, signal_name)
        if stop == LOSS_WATCHDOG:
            close_run(metrics, progress, end_trackers=True)
            raise stopper.watchdog_error(step, checkpointer.last)
        if stop == EARLY_STOPPING:
            end_step = step + 1
            metrics.write(stopper.early_stopping_line(step))
            break
    preemption.restore()  # a signal from here on ends the run as usual
    progress.close()
    metrics.close()
    hand_off(config, run, end_step, run_started)
