"""Joining the torchrun job and the parallel state each rank works in (train and eval)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from longctx_cli.config import Config

# transformers' own bars while a model is read or written: every rank would draw them for
# the same weights, in the middle of the run's log (whose summary names what was saved).
TRANSFORMERS_BARS = ("Loading weights", "Writing model shards")


def quiet_transformers_bars() -> None:
    """Draw none of `TRANSFORMERS_BARS` in this process (other bars, e.g. a download's, stay)."""
    from transformers.utils import logging as hf_logging

    def hook(factory, args, kwargs):
        if kwargs.get("desc") in TRANSFORMERS_BARS:
            kwargs = {**kwargs, "disable": True}
        return factory(*args, **kwargs)

    if hasattr(hf_logging, "set_tqdm_hook"):
        hf_logging.set_tqdm_hook(hook)
    else:  # older transformers: no hook, so no bars of transformers at all on the ranks
        hf_logging.disable_progress_bar()


@contextlib.contextmanager
def process_group_released() -> Iterator[None]:
    """Run a rank's work; however it ends (done, refused, preempted, failed), destroy the
    process group and collect what still holds its groups while the interpreter is alive.

    A Gloo group alive when the process exits is torn down during interpreter finalization,
    where its worker threads can end the process with `std::terminate` ("terminate called
    without an active exception", SIGABRT) after a run that succeeded; `destroy_process_group`
    alone leaves the group alive while a model, a device mesh or the parallel state (often in
    reference cycles) still points at it."""
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def init_distributed(config: Config) -> torch.device:
    """Join the torchrun job; bounded collective timeouts turn a dead peer into an error."""
    quiet_transformers_bars()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = bool(config.model.tf32)  # Axolotl's `tf32`
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=timedelta(seconds=config.run.collective_timeout_s),
        )
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def load_rows(config: Config, tokenizer):
    """Rank 0 builds (or reuses) the cache first; the others then read the entry it used.

    An entry the launcher confirmed (`cache.DATA_CACHE_ENV`) is read directly by a rank
    whose own witness of the inputs matches the launcher's; the others, and every rank
    without one, check the cache in full (`prepare`)."""
    from longctx_cli.data.cache import entry_handed_to_this_rank, read_entry
    from longctx_cli.data.prepare import prepare

    handed = entry_handed_to_this_rank(config)
    prepared = read_entry(handed.path, handed.fingerprint) if handed is not None else None
    if dist.get_rank() == 0 and prepared is None:
        prepared = prepare(config, tokenizer, progress=True)
    # Rank 0's entry, which the others wait for (it may be building it): a rank reads the
    # entry it was handed only when it is that one.
    used = [prepared.path if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(used, src=0)
    if dist.get_rank() != 0 and (prepared is None or str(prepared.path) != used[0]):
        prepared = prepare(config, tokenizer, progress=False)
    return prepared.train, prepared.eval


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """World sums of a few scalars, in float64 so token counts stay exact."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()
