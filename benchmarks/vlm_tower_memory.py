"""The vision tower's memory per rank under longctx's split by images, against the plan's estimate.

    python benchmarks/vlm_tower_memory.py [--layers 4] [--sides 448 ...] [--dtypes float32 bfloat16]

Builds a Qwen2.5-VL vision tower with Qwen2.5-VL-7B's `vision_config` (hidden 1280,
intermediate 3420, 16 heads, patch 14, spatial merge 2, temporal patch 2, window 112) but
only `--layers` layers (its full-attention layers scaled: the 7B's last of every 8), from
transformers' own class, random weights, SDPA attention (what longctx loads the tower with),
on this machine's CPU. A row of images (default: eight 448x448, 1024 patches each) with
random pixels. For sp 1, 2 and 4, each rank's images are `split_images(patches, sp)[rank]`,
as `VisionLanguageForward._encode_split` takes them; the ranks run one after another in this
process (no process group: the tower never sees one) and each runs the tower's forward with
gradients on, as a trained tower does. Per rank it measures:

- saved: the bytes autograd keeps for backward during that forward
  (`torch.autograd.graph.saved_tensors_hooks`, each storage once, parameters excluded), by
  part (patch embedding, the layers, the merger, the rest);
- retained and peak: the net bytes allocated when the forward returns (saved tensors plus
  the output features) and the most live at once during it, from the profiler's allocation
  events (`profile_memory=True`), above the bytes live when it began.

The rank that matters is the one with the most: the table gives the max over ranks. sp 1 is
also what a "whole tower on every rank" design (every rank encodes all the row's images, as
ms-swift and veRL do) holds on each rank at any sp. Beside each, the plan's estimate for the
same rank: `VisionTower.activation_bytes` (what `longctx validate` prints as the tower's
activations) for that rank's patches. The first dtype is measured once more with the
tower frozen (`freeze_mm_modules`: none of its weights trains). Memory is deterministic (it
does not depend on the pixels or the machine's load), so one run is enough. Prints a
table and writes `benchmarks/results/vlm-tower-memory-<date>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path
from typing import Any

from common import RESULTS, markdown_table, shown, write_results

from benchmarks.vlm_example import machine_line

# Qwen2.5-VL-7B-Instruct's vision_config (depth 32, full attention in layers 7, 15, 23, 31).
REAL_DEPTH = 32
REAL_FULL_ATTENTION = (7, 15, 23, 31)
VISION_7B = {"hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
             "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
             "window_size": 112, "out_hidden_size": 3584, "hidden_act": "silu",
             "in_channels": 3, "tokens_per_second": 2}
SPS = (1, 2, 4)
MIB = 2**20


def full_attention_layers(layers: int) -> list[int]:
    """The 7B's full-attention layers scaled to `layers`: the last of every 8, and the last
    layer (the 7B's 7, 15, 23, 31; [3] at 4 layers)."""
    every = REAL_DEPTH // len(REAL_FULL_ATTENTION)
    return [i for i in range(layers) if (i + 1) % every == 0 or i == layers - 1]


def qwen25_vl_config(layers: int) -> Any:
    """A Qwen2.5-VL config: the 7B's tower at `layers` layers, a tiny text part (unused)."""
    from transformers import Qwen2_5_VLConfig

    vision = {**VISION_7B, "depth": layers, "fullatt_block_indexes": full_attention_layers(layers)}
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
            "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]}}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text)


def build_tower(layers: int, dtype: Any) -> Any:
    """transformers' Qwen2.5-VL vision model at the 7B's width, `layers` deep, SDPA."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    vision = qwen25_vl_config(layers).vision_config
    vision._attn_implementation = "sdpa"  # longctx loads the tower with SDPA (runtime/model.py)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision, dtype=dtype)
    return tower.train()


def row_of_images(sides: list[int], patch: int, temporal: int, seed: int = 0
                  ) -> tuple[Any, Any, list[int]]:
    """Random pixel patches of square images of `sides` pixels (one frame each, repeated
    over the temporal patch as the processor does): `[patches, 3 * temporal * patch**2]`,
    the grids `[images, 3]` and the patches of each image."""
    import torch

    grids = torch.tensor([[1, side // patch, side // patch] for side in sides])
    counts = [int(g.prod()) for g in grids]
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(sum(counts), 3 * temporal * patch * patch, generator=generator)
    return pixels, grids, counts


def _allocation_curve(prof: Any) -> tuple[int, int]:
    """(peak, net at the end) of the bytes the profiled region allocated, from its
    allocation and free events in order."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, live


def measure_forward(tower: Any, pixels: Any, grids: Any) -> dict[str, Any]:
    """One forward of `tower` on `pixels` with gradients on: what autograd saves for
    backward (each storage once, parameters excluded), by part, and the profiler's peak
    and net allocation above the start."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    params = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    saved: dict[int, tuple[int, str]] = {}
    part = ["rest"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in saved:
            saved[ptr] = (storage.nbytes(), part[0])
        return t

    def enter(name: str) -> Any:
        return lambda module, args: part.__setitem__(0, name)

    def leave(module: Any, args: Any, out: Any) -> None:
        part[0] = "rest"

    handles = [tower.patch_embed.register_forward_pre_hook(enter("patch_embed")),
               tower.merger.register_forward_pre_hook(enter("merger"))]
    handles += [block.register_forward_pre_hook(enter("layers")) for block in tower.blocks]
    handles += [m.register_forward_hook(leave) for m in (tower.patch_embed, tower.merger,
                                                          *tower.blocks)]
    started = time.perf_counter()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = tower(pixels, grid_thw=grids)
            features = out.pooler_output
            del out
    finally:
        for handle in handles:
            handle.remove()
    seconds = time.perf_counter() - started
    peak, net = _allocation_curve(prof)
    inputs = pixels.untyped_storage().nbytes()  # live before the forward, saved by it
    by_part: dict[str, int] = {}
    for nbytes, name in saved.values():
        by_part[name] = by_part.get(name, 0) + nbytes
    result = {"patches": int(pixels.shape[0]), "images": int(grids.shape[0]),
              "saved_bytes": sum(by_part.values()), "saved_by_part": by_part,
              "saved_storages": len(saved), "pixel_bytes": inputs,
              "retained_bytes": net + inputs, "peak_bytes": peak + inputs,
              "feature_bytes": features.numel() * features.element_size(),
              "requires_grad": bool(features.requires_grad), "seconds": round(seconds, 2)}
    del features
    return result


def measure_sps(tower: Any, plan: Any, pixels: Any, grids: Any, counts: list[int],
                dtype_bytes: int, sps: tuple[int, ...]) -> list[dict[str, Any]]:
    """Each rank of each sp in `sps`, measured, with the plan's estimate for its patches;
    per sp the max over ranks."""
    from longctx_cli.runtime.vision import split_images

    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    image_tokens = sum(counts) // tower.config.spatial_merge_size**2
    rows = []
    for sp in sps:
        ranks = []
        for rank, (first, last) in enumerate(split_images(counts, sp)):
            if first == last:
                ranks.append({"rank": rank, "images": 0, "patches": 0, "saved_bytes": 0,
                              "retained_bytes": 0, "peak_bytes": 0, "estimate_bytes": 0,
                              "note": "no image: runs one blank patch, keeps nothing"})
                continue
            # The rank's own copy of its images' pixels (a view would share the row's storage).
            part = pixels[offsets[first]:offsets[last]].clone()
            measured = measure_forward(tower, part, grids[first:last])
            measured.update(rank=rank, first_image=first, last_image=last,
                            estimate_bytes=plan.activation_bytes(measured["patches"],
                                                                 dtype_bytes))
            ranks.append(measured)
            print(f"  sp {sp} rank {rank}: images {first}-{last - 1}, {measured['patches']} "
                  f"patches, saved {_mib(measured['saved_bytes'])}, peak "
                  f"{_mib(measured['peak_bytes'])}, {measured['seconds']:.1f} s", flush=True)
        rows.append({
            "sp": sp, "ranks": ranks, "max_patches": max(r["patches"] for r in ranks),
            "saved_bytes": max(r["saved_bytes"] for r in ranks),
            "retained_bytes": max(r["retained_bytes"] for r in ranks),
            "peak_bytes": max(r["peak_bytes"] for r in ranks),
            "estimate_bytes": max(r["estimate_bytes"] for r in ranks),
            # What validate prints for a row of these image tokens: ceil(tokens * merge^2 / sp).
            "plan_row_estimate_bytes": plan.activation_bytes(
                plan.patches_per_rank(image_tokens, sp), dtype_bytes),
        })
    return rows


def run(layers: int, sides: list[int], dtypes: list[str], sps: tuple[int, ...] = SPS
        ) -> dict[str, Any]:
    """Every rank of every sp, measured and estimated, per dtype; then a frozen tower
    (`freeze_mm_modules`) in the first dtype."""
    import torch

    from longctx_cli.config.sections.vision import SAVED_PER_HIDDEN, VisionTower
    from longctx_cli.config.units import DTYPE_BYTES

    plan = VisionTower.of(qwen25_vl_config(layers))
    assert plan is not None
    by_dtype, frozen, parameters, counts = [], [], 0, []
    for dtype_name in dtypes:
        torch.manual_seed(0)
        b = DTYPE_BYTES[dtype_name]
        tower = build_tower(layers, getattr(torch, dtype_name))
        vision = tower.config
        parameters = sum(p.numel() for p in tower.parameters())
        pixels, grids, counts = row_of_images(sides, vision.patch_size,
                                              vision.temporal_patch_size)
        pixels = pixels.to(getattr(torch, dtype_name))
        print(f"{dtype_name}:", flush=True)
        rows = measure_sps(tower, plan, pixels, grids, counts, b, sps)
        layer_saved = rows[0]["ranks"][0]["saved_by_part"].get("layers", 0)
        by_dtype.append({
            "dtype": dtype_name, "dtype_bytes": b, "rows": rows,
            "measured_saved_per_hidden_in_layers": round(
                layer_saved / (sum(counts) * vision.hidden_size * layers * b), 2)})
        if not frozen:
            tower.requires_grad_(False)
            print(f"{dtype_name}, frozen tower:", flush=True)
            frozen = [{"dtype": dtype_name, "rows": measure_sps(tower, plan, pixels, grids,
                                                               counts, b, sps)}]
        del tower
    return {
        "benchmark": "vlm_tower_memory", "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "load_average": round(os.getloadavg()[0], 2),
        "torch": torch.__version__, "transformers": _transformers_version(),
        "tower": {"class": "Qwen2_5_VisionTransformerPretrainedModel", "layers": layers,
                  "real_layers": REAL_DEPTH,
                  "fullatt_block_indexes": full_attention_layers(layers), **VISION_7B,
                  "attn_implementation": "sdpa", "parameters": parameters},
        "saved_per_hidden": SAVED_PER_HIDDEN,
        "images": {"sides": sides, "patches": counts},
        "runs": 1, "by_dtype": by_dtype, "frozen": frozen,
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


def table(data: dict) -> str:
    """The measurement as a Markdown table (printed, and written into docs/vlm.md by
    figures.py): per dtype and sp, the busiest rank."""
    frozen = {(f["dtype"], r["sp"]): r for f in data["frozen"] for r in f["rows"]}
    rows = []
    for run in data["by_dtype"]:
        whole = run["rows"][0]
        for r in run["rows"]:
            cold = frozen.get((run["dtype"], r["sp"]))
            rows.append([run["dtype"], r["sp"], f"{r['max_patches']:,}", _mib(r["saved_bytes"]),
                         _mib(r["peak_bytes"]), _mib(r["estimate_bytes"]),
                         f"{r['estimate_bytes'] / r['saved_bytes']:.2f}x",
                         _mib(whole["saved_bytes"]),
                         f"{_mib(cold['saved_bytes'])}, {_mib(cold['peak_bytes'])}" if cold
                         else "-"])
    return markdown_table(
        ["dtype", "sp", "patches on the busiest rank", "saved for backward", "peak in forward",
         "the plan's estimate", "estimate / saved", "every rank encodes every image (saved)",
         "frozen tower: saved, peak"], rows, right=range(1, 9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sides", type=int, nargs="+", default=[448] * 8,
                        help="each image's side in pixels (square images)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                        default=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    data = run(args.layers, args.sides, args.dtypes)
    data["seconds"] = round(time.perf_counter() - started, 1)
    print(f"\n{summary(data)}\n")
    print(table(data))
    for run_ in data["by_dtype"]:
        print(f"{run_['dtype']}: values saved per patch, hidden unit and layer, measured in "
              f"the layers: {run_['measured_saved_per_hidden_in_layers']} (the plan: "
              f"{data['saved_per_hidden']})")
    path = write_results(args.out or RESULTS / f"vlm-tower-memory-{data['date']}.json", data)
    print(f"wrote {shown(path)}")


def summary(data: dict) -> str:
    """What was measured, in one sentence."""
    tower, images = data["tower"], data["images"]
    sides = sorted(set(images["sides"]))
    return (f"Qwen2.5-VL-7B's tower (hidden {tower['hidden_size']}, intermediate "
            f"{tower['intermediate_size']}, {tower['num_heads']} heads) at {tower['layers']} "
            f"of its {tower['real_layers']} layers (full attention in "
            f"{tower['fullatt_block_indexes']}), SDPA, forward with gradients on; a row of "
            f"{len(images['sides'])} images of "
            f"{', '.join(f'{s}x{s}' for s in sides)} ({sum(images['patches']):,} patches); "
            f"one run (memory is deterministic).")


if __name__ == "__main__":
    main()
