"""The memory section: what trades compute for memory (recomputation, the chunked loss,
activation offload, tiled MLPs, the host allocator's threshold). The estimate of what a
rank holds is `config/memory_estimate.py`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from longctx_cli.config.sections.base import Section
from longctx_cli.config.units import GIB, memory_size


class MemorySection(Section):
    title = "training"

    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer in backward to save activation memory "
        "(Axolotl's `offload` also turns on activation_offloading).",
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None, description="Passed to transformers (default `{use_reentrant: false}`)."
    )
    chunked_loss: bool = Field(
        False,
        description="For heads the fused loss does not serve (LoRA'd or quantized head, "
        "FSDP2, TP, a logit transform, fp16): lm_head + cross-entropy in token chunks with "
        "recomputation, never materialising the [tokens, vocab] logits. A plain head's loss "
        "is always fused (blocks of logits, no recompute); this sets its block to "
        "`loss_chunk_size` tokens.",
    )
    loss_chunk_size: int = Field(
        4096, ge=1, description="Tokens per chunk (and per fused-loss block) when "
        "`chunked_loss` is on."
    )
    activation_offloading: bool = Field(
        False,
        description="Keep activations saved for backward in host memory (Axolotl's `legacy`, "
        "`disk` and `hidden_states` all mean true here).",
    )
    tiled_mlp: bool = Field(
        False, description="Run each MLP over the local tokens in tiles, recomputed in backward."
    )
    tiled_mlp_tiles: int | None = Field(
        None, ge=1, description="Number of MLP tiles (default: tokens / hidden_size, at least 1)."
    )
    memory_per_rank: int | float | str | None = Field(
        None,
        description="Memory each rank's GPU has (e.g. `80GiB`, `80GB`; a plain number is GiB, "
        "as Axolotl's `gpu_memory_limit`): `validate` refuses a plan whose memory estimate, "
        "with its margin, exceeds it, and names the fixes that fit. `--memory-per-rank` "
        "overrides it; unset, `validate` judges against the GPUs of the machine it runs on, "
        "if it has any.",
    )
    host_mmap_threshold_mib: int | None = Field(
        None, ge=1,
        description="glibc's mmap threshold for every rank, in MiB: blocks from this size up "
        "are mapped on their own and given back when freed, so freed activations do not stay "
        "resident as heap fragments (a CPU rank's memory follows what is alive; each large "
        "block costs fresh pages). Unset: glibc's own, or your MALLOC_MMAP_THRESHOLD_.",
    )

    @field_validator("memory_per_rank")
    @classmethod
    def _memory_size(cls, value: Any) -> Any:
        if value is not None and memory_per_rank_bytes(value) is None:
            raise ValueError("write a size such as `80GiB`, `80GB` or a number of GiB")
        return value

    @property
    def memory_per_rank_bytes(self) -> int | None:
        """`memory_per_rank` in bytes (None: unset)."""
        return None if self.memory_per_rank is None else memory_per_rank_bytes(
            self.memory_per_rank)

    @field_validator("activation_offloading", mode="before")
    @classmethod
    def _offload_modes(cls, value: Any) -> Any:
        # Axolotl's offload flavours all keep saved activations off the GPU.
        return True if value in ("legacy", "disk", "hidden_states") else value

    @model_validator(mode="before")
    @classmethod
    def _checkpointing_offload(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("gradient_checkpointing") in (
            "offload", "offload_disk"
        ):
            data = {**data, "gradient_checkpointing": True}
            data.setdefault("activation_offloading", True)
        return data


def memory_per_rank_bytes(value: int | float | str) -> int | None:
    """Bytes in a `memory_per_rank` (a number is GiB; None: not a size)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value * GIB) if value > 0 else None
    return memory_size(value)


def memory_notes(memory: MemorySection) -> list[str]:
    """Legal but worth knowing."""
    if memory.activation_offloading and not memory.gradient_checkpointing:
        return [
            "activation_offloading without gradient_checkpointing copies every saved tensor "
            "to host memory and back; with checkpointing only each layer's input moves."
        ]
    return []
