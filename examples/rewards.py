"""The reward function of examples/tiny_grpo.yaml, with TRL's signature.

    trl:
      reward_funcs: [rewards.passkey_digits]

`longctx` imports `rewards` from the config's folder. Each call gets the prompts, the
completions (text), their token ids and every other column of the prompt records as lists;
here the `key` column holds each prompt's pass key.
"""

from __future__ import annotations


def passkey_digits(completions: list[str], key: list[str], **kwargs) -> list[float]:
    """1.0 for the whole key closed by `]`; else half the share of the key's digits the
    completion gets right, in place (a completion with extra digits loses the excess)."""
    rewards = []
    for completion, answer in zip(completions, key, strict=True):
        said = completion.split("]")[0].strip()
        if said == answer and "]" in completion:
            rewards.append(1.0)
            continue
        right = sum(a == b for a, b in zip(said, answer, strict=False))
        rewards.append(0.5 * max(0, right - max(0, len(said) - len(answer))) / len(answer))
    return rewards
