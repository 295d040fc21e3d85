"""`longctx generate`: the greedy continuation of a prompt, computed sequence-parallel.

The decoding itself (`runtime/sampling.py`, shared with GRPO's rollouts) prefills the prompt
by the SP forward the trainer and `longctx eval` use, keeps each rank's keys and values, and
merges the ranks' shards at every new token (`parallel/decode.py`). The tokens are those of
single-process greedy `model.generate` whatever the number of ranks, and a prompt longer than
one device holds is spread over the SP group.

The launcher reads the prompt (file or stdin), checks it against the config and starts the
ranks; rank 0 prints the continuation alone on stdout and writes
`<output_dir>/generate.json` (prompt length, new token ids, text).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longctx_cli.config import Config, load_config
from longctx_cli.errors import UserError

if TYPE_CHECKING:
    from longctx_cli.config.plan import Plan
    from longctx_cli.launcher.launch import EarlyTorchrun


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the model reads a document: its BOS (if the tokenizer has one), text."""
    from longctx_cli.data.formats import bos_prefix, text_ids

    return bos_prefix(tokenizer) + text_ids(tokenizer, text)


def vision_prompt(processor: Any, text: str, base_dir: Path) -> tuple[list[int], Any]:
    """A vision-language run's prompt: a JSON chat record (`{"messages": [...]}` with image
    parts, as in its training data) -> its token ids with the generation prompt, and its
    media (`runtime.vision.VisionInputs`). `processor`: the run's (`load_config_processor`),
    loaded once by the caller, which also reads its tokenizer."""
    import torch

    from longctx_cli.data.vision.tokens import encode_vision_prompt
    from longctx_cli.runtime.batches import media_inputs

    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"the prompt is not a JSON chat record ({e.msg}, line {e.lineno}).",
                        where="--prompt-file",
                        fix='write one record, e.g. {"messages": [{"role": "user", "content": '
                        '[{"type": "image", "path": "a.png"}, {"type": "text", "text": '
                        '"What is this?"}]}]}.') from None
    doc = encode_vision_prompt(record, processor, "--prompt-file", base_dir=base_dir)
    media = None
    if doc.image_grid_thw:  # the stored layout, read back as training reads it
        media = media_inputs(torch.from_numpy(doc.pixel_values), doc.image_grid_thw,
                             doc.media_kinds, doc.second_per_grid_ts)
    return doc.input_ids, media


def run_generate(config_path: Path, checkpoint: Path, prompt_file: Path | None,
                 max_new_tokens: int, nproc_per_node: int | None,
                 overrides: list[str] | None = None, early: EarlyTorchrun | None = None,
                 prompt: str | None = None) -> int:
    """Entry of `longctx generate`; the process exit code. `overrides`: `--key value` config
    overrides, passed on to every rank; `early`: torchrun's agent, started while this
    launcher checks the run (see `EarlyTorchrun`); `prompt`: the prompt's text itself
    (`--prompt`), else it is read from `prompt_file` or stdin."""
    from longctx_cli.launcher.launch import in_torchrun, launch_torchrun, rank_errors
    from longctx_cli.preflight import check_run

    overrides = list(overrides or [])
    if prompt is not None and prompt_file is not None:
        raise UserError("both --prompt and --prompt-file are given.", where="--prompt",
                        fix="give the prompt one way: --prompt TEXT or --prompt-file FILE.")
    config = load_config(config_path, overrides)
    if in_torchrun():
        from longctx_cli.eval.run import import_rank_modules

        import_rank_modules()
        if prompt is not None:
            prompt_file, text = None, prompt
        elif prompt_file is None:
            raise UserError("ranks read the prompt from a file.", where="--prompt-file",
                            fix="pass --prompt-file (or run `longctx generate` itself).")
        with rank_errors(alike_on_every_rank=True):
            config, plan = check_run(config, "generate", overrides=overrides)
        from longctx_cli.runtime.distributed import process_group_released

        with rank_errors(), process_group_released():
            generate_on_ranks(config, plan, checkpoint,
                              text if prompt_file is None else prompt_file.read_text(
                                  encoding="utf-8"), max_new_tokens)
        return 0
    from longctx_cli.data.tokenizer import load_tokenizer
    from longctx_cli.eval.checkpoint_loading import check_intact, checkpoint_kind

    checkpoint_kind(checkpoint)
    check_intact(checkpoint)
    text = prompt if prompt is not None else _read_prompt(prompt_file)
    # Forward only: the SP degree is the machine's (one SP group over the ranks by default).
    config, plan = check_run(config, "generate", nproc_per_node, overrides=overrides)
    if config.trains_images:  # the ranks read a copy: its image paths made absolute
        from longctx_cli.data.tokenizer import load_config_processor
        from longctx_cli.data.vision.records import with_absolute_paths

        base = (prompt_file.parent if prompt_file is not None and str(prompt_file) != "-"
                else Path.cwd())
        with contextlib.suppress(json.JSONDecodeError):
            text = json.dumps(with_absolute_paths(json.loads(text), base.resolve()))
        n = len(vision_prompt(load_config_processor(config), text, base)[0])
    else:
        n = len(prompt_ids(load_tokenizer(config), text))
    limit = config.data.sequence_len
    if n + max_new_tokens > limit:
        raise UserError(
            f"the prompt is {n:,} tokens; with --max-new-tokens {max_new_tokens} the row "
            f"would be {n + max_new_tokens:,}, beyond `sequence_len` = {limit:,} (what the "
            "plan budgets memory for).",
            where="--prompt" if prompt is not None else "--prompt-file",
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
        return launch_torchrun(args, world, world, early=early)


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


def empty_continuation_note(new: list[int], tokenizer: Any) -> str:
    """Why `generate` printed nothing: the tokens it made decode to no text."""
    eos = tokenizer.eos_token_id
    if new and new[0] == eos:
        what = (f"the model's first token was its end-of-sequence token "
                f"({tokenizer.eos_token!r}, id {eos})")
    else:
        shown = ", ".join(map(str, new[:8])) + (", ..." if len(new) > 8 else "")
        what = f"its {len(new)} new token(s) ({shown}) are special or blank tokens"
    return (f"note: the continuation is empty: {what}. A base model that has not learned the "
            "prompt's format often does this; try a longer prompt, or the chat template the "
            "run trained with.")


def generate_on_ranks(config: Config, plan: Plan, checkpoint: Path, text: str,
                      max_new_tokens: int) -> None:
    """Inside torchrun, every rank: greedy decoding after one SP prefill."""
    import torch.distributed as dist

    from longctx_cli.data.tokenizer import load_config_processor, load_tokenizer
    from longctx_cli.data.tokenizer import pad_id as tokenizer_pad_id
    from longctx_cli.eval.checkpoint_loading import load_for_eval
    from longctx_cli.parallel.mesh import build_parallel_state
    from longctx_cli.runtime.distributed import init_distributed
    from longctx_cli.runtime.model import decoder_and_head
    from longctx_cli.runtime.sampling import greedy_tokens

    device = init_distributed(config)
    state = build_parallel_state(plan.layout, device)
    media = None
    if config.trains_images:  # one processor: its tokenizer, and the prompt's images
        processor = load_config_processor(config)
        tokenizer = processor.tokenizer
        prompt, media = vision_prompt(processor, text, Path.cwd())
    else:
        tokenizer = load_tokenizer(config)
        prompt = prompt_ids(tokenizer, text)
    model = load_for_eval(config, checkpoint).to(device)
    decoder, lm_head = decoder_and_head(model, config.trains_images)
    new = greedy_tokens(decoder, lm_head, prompt, max_new_tokens, state,
                        tokenizer_pad_id(tokenizer), device, tokenizer.eos_token_id, media)
    if dist.get_rank() == 0:
        continuation = tokenizer.decode(new, skip_special_tokens=True)
        print(continuation, flush=True)
        if not continuation.strip():  # say why on stderr; stdout stays the continuation
            print(empty_continuation_note(new, tokenizer), file=sys.stderr, flush=True)
        record = {"checkpoint": str(checkpoint), "prompt_tokens": len(prompt),
                  "new_token_ids": new, "text": continuation}
        out = Path(config.output.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "generate.json").write_text(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
