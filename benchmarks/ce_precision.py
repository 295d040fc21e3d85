"""How far float32 cross-entropy is from the float64 value as the vocabulary grows: PyTorch's
`cross_entropy` (what a model's own `forward(labels=)` computes) and longctx's fused loss.

    python benchmarks/ce_precision.py        # under a minute on 2 cores

A linear head of `--hidden` inputs over each vocabulary (Llama's 32,000; SmolLM2's 49,152;
Qwen's 151,936; Gemma 3's 262,144), random hidden states and targets for `--tokens` tokens,
logits spread like a model's (`--logit-std`). For each seed it prints the relative error of
the summed loss against the same sum in float64, for both. This is what exactness bounds
against the model's own float32 training must allow for (docs/families.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import save_record

VOCABULARIES = (32_000, 49_152, 151_936, 262_144)


def errors(vocab: int, hidden: int, tokens: int, logit_std: float, seed: int,
           ) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    from longctx_cli.runtime.loss import lm_loss_sum

    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * logit_std / hidden ** 0.5)
    x = torch.randn(tokens, hidden, generator=g)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with torch.no_grad():
        exact = F.cross_entropy(x.double() @ head.weight.double().T, labels, reduction="sum")
        plain = F.cross_entropy(head(x), labels, reduction="sum")
    fused = lm_loss_sum(head, x.requires_grad_(), labels).detach()  # the training path
    return (float(abs(plain.double() - exact) / exact),
            float(abs(fused.double() - exact) / exact))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--logit-std", type=float, default=3.0)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    rows = {}
    print(f"{'vocabulary':>10} {'float32 cross_entropy':>24} {'fused loss':>22}")
    for vocab in VOCABULARIES:
        runs = [errors(vocab, args.hidden, args.tokens, args.logit_std, s)
                for s in range(args.seeds)]
        plain, fused = [r[0] for r in runs], [r[1] for r in runs]
        rows[vocab] = {"cross_entropy": plain, "fused": fused}
        print(f"{vocab:>10,} {min(plain):>10.1e} - {max(plain):.1e} "
              f"{min(fused):>10.1e} - {max(fused):.1e}   (median {statistics.median(plain):.1e}"
              f" / {statistics.median(fused):.1e})")
    save_record("ce-precision", {"command": " ".join(["benchmarks/ce_precision.py",
                                                      *sys.argv[1:]]),
                                 "hidden": args.hidden, "tokens": args.tokens,
                                 "logit_std": args.logit_std, "rows": rows})


if __name__ == "__main__":
    main()
