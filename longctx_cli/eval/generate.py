"""`longctx generate`: the greedy continuation of a prompt, computed sequence-parallel.

The prompt is prefilled by the SP forward the trainer and `longctx eval` use (exact against
the model's own forward, see the family matrix), which leaves each rank's keys and values in
a KV cache; every new token is then one decode step whose attention merges the ranks' shards
(`parallel/decode.py`). The tokens are those of single-process greedy `model.generate`
whatever the number of ranks, and a prompt longer than one device holds is spread over the
SP group. Models with windowed or chunked layers decode by one full SP forward per token.

The launcher reads the prompt (file or stdin), checks it against the config and starts the
ranks; rank 0 prints the continuation alone on stdout and writes
`<output_dir>/generate.json` (prompt length, new token ids, text).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from longctx_cli.config import Config, load_config
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from longctx_cli.config.plan import Plan


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the model reads a document: its BOS (if the tokenizer has one), text."""
    from longctx_cli.data.formats import bos_prefix, text_ids

    return bos_prefix(tokenizer) + text_ids(tokenizer, text)


def run_generate(config_path: Path, checkpoint: Path, prompt_file: Path | None,
                 max_new_tokens: int, nproc_per_node: int | None,
                 overrides: list[str] | None = None) -> int:
    """Entry of `longctx generate`; the process exit code. `overrides`: `--key value` config
    overrides, passed on to every rank."""
    from longctx_cli.preflight import check_run
    from longctx_cli.runtime.launch import in_torchrun, launch_torchrun, rank_errors

    overrides = list(overrides or [])
    config = load_config(config_path, overrides)
    if in_torchrun():
        if prompt_file is None:
            raise UserError("ranks read the prompt from a file.", where="--prompt-file",
                            fix="pass --prompt-file (or run `longctx generate` itself).")
        with rank_errors(alike_on_every_rank=True):
            config, plan = check_run(config, "generate", overrides=overrides)
        from longctx_cli.runtime.distributed import process_group_released

        with rank_errors(), process_group_released():
            generate_on_ranks(config, plan, checkpoint, prompt_file.read_text(encoding="utf-8"),
                              max_new_tokens)
        return 0
    from longctx_cli.data.tokenizer import load_tokenizer
    from longctx_cli.eval.checkpoint_loading import check_intact, checkpoint_kind

    checkpoint_kind(checkpoint)
    check_intact(checkpoint)
    text = _read_prompt(prompt_file)
    # Forward only: the SP degree is the machine's (one SP group over the ranks by default).
    config, plan = check_run(config, "generate", nproc_per_node, overrides=overrides)
    n = len(prompt_ids(load_tokenizer(config), text))
    limit = config.sequence_len
    if n + max_new_tokens > limit:
        raise UserError(
            f"the prompt is {n:,} tokens; with --max-new-tokens {max_new_tokens} the row "
            f"would be {n + max_new_tokens:,}, beyond `sequence_len` = {limit:,} (what the "
            "plan budgets memory for).",
            where="--prompt-file",
            fix="shorten the prompt, lower --max-new-tokens, or raise `sequence_len` (e.g. "
            f"`--sequence-len {n + max_new_tokens}` after the config; more ranks for memory).",
        )
    world = plan.world_size
    print(f"prompt: {n:,} tokens; generating up to {max_new_tokens} on {world} rank(s), "
          f"sp {plan.layout.sp}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="longctx-prompt-") as tmp:
        path = Path(tmp) / "prompt.txt"
        path.write_text(text, encoding="utf-8")
        args = ["generate", str(config_path), "--checkpoint", str(checkpoint), "--prompt-file",
                str(path), "--max-new-tokens", str(max_new_tokens), *overrides]
        return launch_torchrun(args, world, world)


def _read_prompt(prompt_file: Path | None) -> str:
    if prompt_file is None or str(prompt_file) == "-":
        if sys.stdin.isatty():
            raise UserError("no prompt: give --prompt-file, or pipe the prompt on stdin.",
                            where="--prompt-file", fix="e.g. `longctx generate my.yaml "
                            "--checkpoint out/final --prompt-file prompt.txt`.")
        text = sys.stdin.read()
    else:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read {str(prompt_file)!r}: {e}.", where="--prompt-file",
                            fix="give a UTF-8 text file.") from None
    if not text.strip():
        raise UserError("the prompt is empty.", where="--prompt-file",
                        fix="write the prompt into the file (or stdin).")
    return text


def generate_on_ranks(config: Config, plan: Plan, checkpoint: Path, text: str,
                      max_new_tokens: int) -> None:
    """Inside torchrun, every rank: greedy decoding, one SP forward per token."""
    import torch.distributed as dist

    from longctx_cli.data.tokenizer import load_tokenizer
    from longctx_cli.data.tokenizer import pad_id as tokenizer_pad_id
    from longctx_cli.eval.checkpoint_loading import load_for_eval
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.runtime.distributed import init_distributed
    from longctx_cli.runtime.model import decoder_and_head

    device = init_distributed(config)
    state = build_parallel_state(plan.layout, device)
    tokenizer = load_tokenizer(config)
    model = load_for_eval(config, checkpoint).to(device)
    decoder, lm_head = decoder_and_head(model)
    prompt = prompt_ids(tokenizer, text)
    new = greedy_tokens(decoder, lm_head, prompt, max_new_tokens, state,
                        tokenizer_pad_id(tokenizer), device, tokenizer.eos_token_id)
    if dist.get_rank() == 0:
        continuation = tokenizer.decode(new, skip_special_tokens=True)
        print(continuation, flush=True)
        record = {"checkpoint": str(checkpoint), "prompt_tokens": len(prompt),
                  "new_token_ids": new, "text": continuation}
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "generate.json").write_text(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def greedy_tokens(decoder, lm_head, prompt: list[int], max_new_tokens: int, state,
                  pad_id: int, device, eos_id: int | None) -> list[int]:
    """Up to `max_new_tokens` greedy ids after `prompt` (stopping after EOS); every rank of
    the SP group returns the same list.

    The prompt is prefilled sequence-parallel into a sharded KV cache and each new token is
    one decode step over it (`parallel/decode.py`); a model with windowed or chunked layers
    decodes by one full SP forward per token instead (the same tokens, slower).
    """
    from longctx_cli.parallel.decode import DecodeUnsupported

    try:
        return _greedy_with_cache(decoder, lm_head, prompt, max_new_tokens, state, pad_id,
                                  device, eos_id)
    except DecodeUnsupported as e:
        if state.sp_rank == 0 and state.dp_rank == 0:
            print(f"decoding by full forwards: {e}", file=sys.stderr, flush=True)
        return _greedy_by_forwards(decoder, lm_head, prompt, max_new_tokens, state, pad_id,
                                   device, eos_id)


def _agree(state, token: int | None, device) -> int:
    """The token SP rank 0 picked, on every rank of the group (`token`: this rank's pick, or
    None where it has none)."""
    import torch
    import torch.distributed as dist

    pick = torch.tensor([-1 if token is None or state.sp_rank != 0 else token],
                        dtype=torch.long, device=device)
    if state.layout.sp > 1:
        dist.all_reduce(pick, op=dist.ReduceOp.MAX, group=state.sp_group)
    return int(pick.item())


def _prefill(decoder, lm_head, tokens: list[int], state, pad_id: int, device, cache=None):
    """One SP forward over `tokens`; (the greedy next token, the sharded batch)."""
    import torch
    import torch.distributed as dist

    from longctx_cli.constants import IGNORE_INDEX
    from longctx_cli.parallel.sharding import shard_batch
    from longctx_cli.runtime.batches import to_device
    from longctx_cli.runtime.model import sp_hidden_states

    row = torch.tensor(tokens, dtype=torch.long)
    batch = to_device(shard_batch(row, torch.arange(row.numel()),
                                  torch.full_like(row, IGNORE_INDEX), state, pad_id), device)
    hidden = sp_hidden_states(decoder, batch, where="--checkpoint", cache=cache)
    last = _local_index(batch.sp_meta.local_ranges, len(tokens) - 1)
    # The rank holding the last position picks; sp rank 0 may not hold it, so pass it on.
    pick = torch.tensor([-1], dtype=torch.long, device=device)
    if last is not None:
        pick[0] = lm_head(hidden[last:last + 1]).argmax(dim=-1)[0]
    if state.layout.sp > 1:
        dist.all_reduce(pick, op=dist.ReduceOp.MAX, group=state.sp_group)
    return int(pick.item()), batch


def _greedy_with_cache(decoder, lm_head, prompt, max_new_tokens, state, pad_id, device,
                       eos_id) -> list[int]:
    import torch
    from transformers import DynamicCache

    from longctx_cli.parallel.decode import DecodeMeta
    from longctx_cli.runtime.model import cache_kwargs

    new: list[int] = []
    with torch.no_grad():
        cache = DynamicCache(config=decoder.config)
        cached = cache_kwargs(decoder, cache)  # the decoder's name for it, read once
        token, batch = _prefill(decoder, lm_head, prompt, state, pad_id, device, cache)
        meta = DecodeMeta.after_prefill(state, batch.sp_meta.local_ranges, len(prompt), device)
        del batch
        new.append(token)
        while len(new) < max_new_tokens and token != eos_id:
            position = len(prompt) + len(new) - 1
            hidden = decoder(input_ids=torch.tensor([[token]], device=device),
                             position_ids=torch.tensor([[position]], device=device),
                             sp_meta=meta, **cached
                             ).last_hidden_state
            token = _agree(state, int(lm_head(hidden[0, -1:]).argmax(dim=-1)[0]), device)
            new.append(token)
            meta.decoded += 1
    return new


def _greedy_by_forwards(decoder, lm_head, prompt, max_new_tokens, state, pad_id, device,
                        eos_id) -> list[int]:
    import torch

    tokens = list(prompt)
    new: list[int] = []
    with torch.no_grad():
        while len(new) < max_new_tokens and (not new or new[-1] != eos_id):
            token, _ = _prefill(decoder, lm_head, tokens, state, pad_id, device)
            tokens.append(token)
            new.append(token)
    return new


def _local_index(ranges: tuple[tuple[int, int], ...], position: int) -> int | None:
    """Where global `position` sits in this rank's local tokens, or None."""
    offset = 0
    for start, end in ranges:
        if start <= position < end:
            return offset + position - start
        offset += end - start
    return None
