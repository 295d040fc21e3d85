"""The peers' side of benchmarks/peers.py: the same training steps through plain Hugging Face
(one process) or DeepSpeed ALST (Ulysses sequence parallelism under torchrun).

It imports nothing of longctx: the ALST runs use the peer's own virtual environment
(`peers.py` builds it), with the same torch and transformers versions as longctx's.

    python peer_worker.py --tool hf --model DIR --row ROW.pt --steps 8 --out OUT.json
    torchrun --nproc-per-node 2 peer_worker.py --tool alst --model DIR --row ROW.pt ...

ALST is used as DeepSpeed documents it for Hugging Face models: `UlyssesSPAttentionHF`
registered over sdpa, `UlyssesSPDataLoaderAdapter` sharding each batch over the SP group,
the loss over each rank's shard summed with `TiledFusedLogitsLoss` (full logits are never
built) and combined over the group by the valid-token count, `deepspeed.initialize` with
torch's AdamW and ZeRO stage 0 or 3. A step is timed from the forward to the end of the
optimizer step, as longctx times its own; the batch is already sharded on the rank.

ALST's further memory savers, as ArcticTraining switches them on (`benchmarks/reach.py`):
`--tiled-mlp` patches `LlamaMLP.forward` with DeepSpeed's `TiledMLP` before the model is
built, ceil(tokens / hidden_size) shards agreed over the ranks (ArcticTraining's
`tiled_mlp_forward_common`); `--checkpointing` is transformers' activation checkpointing
with its default kwargs plus `enable_input_require_grads()` (ArcticTraining's
`HFModelFactory`); `--loss-shards auto` sizes the loss shards to about 1 GiB of float32
logits each (ArcticTraining's `SFTTrainer.loss`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tool", choices=["hf", "alst"], required=True)
    p.add_argument("--model", required=True, help="initial weights (save_pretrained folder)")
    p.add_argument("--row", required=True, help="input_ids/labels/position_ids of the row (.pt)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--max-grad-norm", type=float, required=True)
    p.add_argument("--zero", type=int, default=0, choices=[0, 3])
    p.add_argument("--loss-shards", default="4",
                   help="TiledFusedLogitsLoss shards per rank (ALST): a count, or `auto` for "
                   "ArcticTraining's ~1 GiB of float32 logits per shard")
    p.add_argument("--tiled-mlp", action="store_true", help="ALST's TiledMLP in every layer")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer (transformers'; "
                   "ALST as ArcticTraining does it, plain HF as `gradient_checkpointing_enable`)")
    p.add_argument("--out", required=True)
    return p.parse_args()


def adamw(params, lr: float) -> torch.optim.Optimizer:
    # longctx's adamw_torch with its defaults (betas 0.9/0.999, eps 1e-8, no weight decay).
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def run_hf(args: argparse.Namespace, row: dict) -> dict:
    """Plain transformers, one process: the model's own loss over the whole row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.train()
    if args.checkpointing:  # its one memory feature (reach.py)
        model.gradient_checkpointing_enable()
    optimizer = adamw(model.parameters(), args.lr)
    batch = {k: v.unsqueeze(0) for k, v in row.items()}
    losses, seconds, first_step_at = [], [], time.time()
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
        losses.append(float(loss))
    return {"losses": losses, "seconds": seconds, "first_step_at": first_step_at}


def patch_tiled_mlp() -> None:
    """ArcticTraining's `enable_tiled_mlp_compute` for Llama: before the model is built."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    def tiled_mlp_forward_common(self, x):
        bs, seqlen, hidden = x.shape
        shards = torch.tensor(math.ceil(seqlen / hidden), device=x.device)
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)  # every rank runs as many shards
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return TiledMLP.apply(mlp_forward, self, x, int(shards.item()), compute_params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward_common


def loss_shards(arg: str, tokens: int, vocab: int) -> int:
    """A count, or ArcticTraining's `auto`: about 1 GiB of float32 logits per shard."""
    if arg != "auto":
        return int(arg)
    return max(1, math.ceil(tokens * vocab * 4 / 2**30))


def run_alst(args: argparse.Namespace, row: dict) -> dict:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    sp = dist.get_world_size()
    seq_len = row["input_ids"].numel()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=args.model, core_attn_implementation="sdpa",
        sequence_parallel_size=sp, micro_batch_size=1, seq_length=seq_len,
        seq_length_is_variable=False,
    )
    if args.tiled_mlp:
        patch_tiled_mlp()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.train()  # from_pretrained leaves eval mode, where checkpointing is skipped
    if args.checkpointing:
        model.activation_checkpointing_enable()
        model.enable_input_require_grads()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.max_grad_norm,
        "zero_optimization": {"stage": args.zero},
        "zero_allow_untested_optimizer": True,
        "sequence_parallel_size": sp,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters(),
                                                                        args.lr),
                                           config=ds_config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    # Each rank's loader yields the row; the adapter turns one row per rank into SP shards.
    rows = [{k: v.unsqueeze(0) for k, v in row.items()}] * args.steps
    loader = UlyssesSPDataLoaderAdapter(
        torch.utils.data.DataLoader(rows, batch_size=None),
        sp_rank=mpu.get_sequence_parallel_rank(), sp_group=group, sp_world_size=sp,
        device=torch.device("cpu"),
    )
    module = engine.module
    vocab = module.config.vocab_size

    losses, seconds, first_step_at = [], [], time.time()
    for _ in range(args.steps):
        batch = next(loader)
        shift_labels = batch["shift_labels"]
        started = time.perf_counter()
        good = (shift_labels != -100).sum().to(torch.float32)
        dist.all_reduce(good, group=group)  # the valid tokens of the whole row

        # The tiles' backward runs inside the forward with an incoming gradient of 1, so each
        # tile's loss is already this rank's share of the row's mean.
        def loss_fn(self, x, y, good=good):
            logits = self.lm_head(x).view(-1, vocab).float()
            return torch.nn.functional.cross_entropy(logits, y.view(-1), reduction="sum",
                                                     ignore_index=-100) / good

        hidden = module.model(input_ids=batch["input_ids"],
                              position_ids=batch["position_ids"]).last_hidden_state
        shards = loss_shards(args.loss_shards, shift_labels.numel(), vocab)
        share = TiledFusedLogitsLoss.apply(loss_fn, module, hidden, shift_labels, None,
                                           shards, [module.lm_head.weight], "sum")
        engine.backward(share)
        total = share.detach().clone()
        dist.all_reduce(total, group=group)
        engine.step()
        seconds.append(time.perf_counter() - started)
        losses.append(float(total))
    return {"losses": losses, "seconds": seconds, "first_step_at": first_step_at}


def main() -> None:
    args = parse()
    torch.manual_seed(0)
    row = torch.load(args.row)
    result = run_hf(args, row) if args.tool == "hf" else run_alst(args, row)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
