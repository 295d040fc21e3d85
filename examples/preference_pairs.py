"""Write the preference pairs of examples/tiny_preference.yaml (no downloads).

Each pair has a long prompt whose first sentence says how to answer (in capital or in small
letters), then filler text, then a question; the chosen answer follows the instruction and
the rejected one is the same word in the other case. To prefer the chosen answer a model
must carry one fact from the start of a long prompt to its end, so held-out reward accuracy
is at chance (about 50%) until it does. Records are Axolotl's `chatml.intel` shape.

    python examples/preference_pairs.py examples/data/preference_pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# Each instruction ends in a character that occurs nowhere else in the data, so the fact to
# carry is one token a tiny model can find by content from anywhere in the prompt.
INSTRUCTIONS = {"upper": "Answer in capital letters ^", "lower": "Answer in small letters ~"}
FILLER = ["The river runs past the old mill.", "A cart rolls down the lane.",
          "Bees hum over the clover.", "The baker opens the shop at dawn.",
          "Rain taps on the tin roof.", "Two crows argue on the fence.",
          "The clock in the square strikes the hour.", "Smoke curls from the chimney."]
WORDS = ["amber", "silver", "violet", "copper", "scarlet", "indigo", "olive", "ivory",
         "crimson", "teal", "bronze", "coral", "azure", "ochre", "jade", "slate"]


def pair(rng: random.Random, filler_sentences: int) -> dict[str, str]:
    case = rng.choice(sorted(INSTRUCTIONS))
    filler = " ".join(rng.choice(FILLER) for _ in range(filler_sentences))
    word = rng.choice(WORDS)
    right, wrong = (word.upper(), word) if case == "upper" else (word, word.upper())
    return {"question": f"{INSTRUCTIONS[case]} {filler} Name a colour.",
            "chosen": right, "rejected": wrong}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--min-sentences", type=int, default=4)
    parser.add_argument("--max-sentences", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for _ in range(args.pairs):
            n = rng.randint(args.min_sentences, args.max_sentences)
            f.write(json.dumps(pair(rng, n)) + "\n")
    print(f"wrote {args.pairs} pairs to {args.out}")


if __name__ == "__main__":
    main()
