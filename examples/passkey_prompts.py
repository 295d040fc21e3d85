"""Write the prompts of examples/tiny_grpo.yaml: passkey questions at lengths the
Quickstart's SFT run never trained on (no downloads).

Each record is the prompt of a passkey sample (`longctx_cli.data.passkey`, the generator the
SFT data and `longctx eval` use), cut right before the key, and the key itself, which the
reward function `rewards.passkey_digits` reads as the `key` column.

    python examples/passkey_prompts.py examples/data/passkey_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from longctx_cli.data.passkey import DEFAULT_DEPTHS, make_passkey_sample
from longctx_cli.data.tokenizer import byte_tokenizer

LENGTHS = (272, 288, 304, 320)  # the SFT example trained on 176-256 tokens


def records(count: int, seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[dict]:
    tok = byte_tokenizer()
    rng = random.Random(seed)
    out = []
    for i in range(count):
        depth = DEFAULT_DEPTHS[i % len(DEFAULT_DEPTHS)]
        sample = make_passkey_sample(tok, lengths[i % len(lengths)], depth, 5, rng)
        prompt = tok.decode(sample.prompt_ids, skip_special_tokens=True)
        out.append({"prompt": prompt, "key": sample.key, "depth": depth,
                    "length": len(sample)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for record in records(args.count, args.seed):
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
