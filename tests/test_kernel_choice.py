"""The attention kernel is decided once, from facts: the machine (CUDA, compute capability,
whether flash-attn 2 and ring-flash-attn really import), the dtype, the model's head dim and
attention features (softcap, sinks, window) and the layout. `validate` (build_plan) and the
ranks (`layout_for`, what `init_parallel` calls) hold the same Layout for every row."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import pytest

from longctx_cli.config import config_from_dict
from longctx_cli.config.model_shape import read_model_config
from longctx_cli.config.plan import build_plan, layout_for
from longctx_cli.errors import UserError
from longctx_cli.kernel_choice import (
    FA4_MODULE,
    FLASH_ATTN_MODULE,
    ModelAttention,
    Platform,
    choose_kernel,
    fa4_import,
    flash_kernels_import,
)
from tests.test_flash_adapter import STANDIN

CPU = Platform(cuda=False, ring_flash_attn=False)
H100 = Platform(cuda=True, ring_flash_attn=True, capability=(9, 0))
H100_BARE = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0))
A100 = Platform(cuda=True, ring_flash_attn=True, capability=(8, 0))
T4 = Platform(cuda=True, ring_flash_attn=True, capability=(7, 5))
V100_BARE = Platform(cuda=True, ring_flash_attn=False, capability=(7, 0))
# cuDNN and flash-attn 4 facts: torch.backends.cudnn.version() numbers 9.10.2 as 91002.
H100_CUDNN = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0),
                      cudnn_version=91002, fa4=False)
H100_CUDNN_9_8 = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0),
                          cudnn_version=90800)
H100_CUDNN_8 = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0),
                        cudnn_version=8907)
A100_CUDNN = Platform(cuda=True, ring_flash_attn=False, capability=(8, 0),
                      cudnn_version=91002)
H100_FA4 = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0), fa4=True)
B200_FA4 = Platform(cuda=True, ring_flash_attn=False, capability=(10, 0), fa4=True)

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "head_dim": 64, "vocab_size": 128}
GEMMA2 = {**LLAMA, "model_type": "gemma2", "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0, "sliding_window": 64}
GPT_OSS = {**LLAMA, "model_type": "gpt_oss", "num_local_experts": 4,
           "num_experts_per_tok": 2, "sliding_window": 64}
MISTRAL_SWA = {**LLAMA, "model_type": "mistral", "sliding_window": 64}

RING2 = {"sequence_parallel_degree": 2, "ring_attn_func": "varlen_llama3"}
DEFAULT2 = {"sequence_parallel_degree": 2}  # batch_stripe (layout.default_ring)
UNPACKED = {"sample_packing": False}
ZIGZAG2 = {"sequence_parallel_degree": 2, "sp_sharding": "zigzag"}

# name -> (platform, dtype, model, layout keys, expected auto kernel, word in the reason)
ROWS: dict[str, tuple[Platform, str, dict, dict, str, str]] = {
    "cpu": (CPU, "bfloat16", LLAMA, RING2, "torch", "no CUDA"),
    "h100_flash": (H100, "bfloat16", LLAMA, RING2, "flash", "installed"),
    "h100_no_packages": (H100_BARE, "bfloat16", LLAMA, RING2, "torch_flash", "import"),
    "a100_flash_fp16": (A100, "float16", LLAMA, RING2, "flash", "installed"),
    "zigzag_llama3": (H100, "bfloat16", LLAMA, ZIGZAG2, "torch_flash", "zigzag"),
    "batch_zigzag": (H100, "bfloat16", LLAMA, {**RING2, **UNPACKED,
                                               "ring_attn_func": "batch_zigzag"},
                     "flash", "installed"),
    "batch_ring_fp16": (H100, "float16", LLAMA, {**RING2, "ring_attn_func": "batch_ring"},
                        "torch_flash", "dq in bf16"),
    "batch_ring_bf16": (H100, "bfloat16", LLAMA, {**RING2, **UNPACKED,
                                                  "ring_attn_func": "batch_ring"},
                        "flash", "installed"),
    "t4": (T4, "float16", LLAMA, RING2, "torch", "compute capability is 7.5"),
    "v100_bare": (V100_BARE, "float16", LLAMA, RING2, "torch", "compute capability is 7.0"),
    "fp32": (H100, "float32", LLAMA, RING2, "torch", "bf16/fp16"),
    "head_dim_100": (H100, "bfloat16", {**LLAMA, "head_dim": 100}, RING2, "torch",
                     "head_dim 100"),
    "head_dim_320": (H100, "bfloat16", {**LLAMA, "head_dim": 320}, RING2, "torch",
                     "head_dim 320"),
    "softcap_ring": (H100, "bfloat16", GEMMA2, RING2, "torch_flash", "softcap"),
    "softcap_one_rank": (H100, "bfloat16", GEMMA2, {}, "flash", "installed"),
    "sinks": (H100, "bfloat16", GPT_OSS, RING2, "torch_flash", "sinks"),
    "window_llama3": (H100, "bfloat16", MISTRAL_SWA, RING2, "flash", "installed"),
    "default_packed": (H100, "bfloat16", LLAMA, DEFAULT2, "torch_flash", "packed rows"),
    "default_unpacked": (H100, "bfloat16", LLAMA, {**DEFAULT2, **UNPACKED}, "flash",
                         "installed"),
    "default_no_packages": (H100_BARE, "bfloat16", LLAMA, DEFAULT2, "torch_flash", "import"),
    "window_p2p": (H100, "bfloat16", MISTRAL_SWA, {**RING2, "ring_attn_func": "batch_zigzag"},
                   "torch_flash", "sliding window"),
    "ulysses_zigzag": (H100, "bfloat16", LLAMA, {"sequence_parallel_degree": 4,
                                                 "sequence_parallel_mode": "ulysses",
                                                 "sp_sharding": "zigzag"}, "flash", "installed"),
    "hybrid_zigzag": (H100, "bfloat16", LLAMA, {"sequence_parallel_degree": 4,
                                                "sequence_parallel_mode": "hybrid",
                                                "ulysses_degree": 2, "sp_sharding": "zigzag"},
                      "torch_flash", "zigzag"),
}


def _config(dtype: str, model: dict, layout: dict, kernel: str = "auto") -> Any:
    return config_from_dict({"model_config": model, "tokenizer": "byte", "dtype": dtype,
                             "sequence_len": 256, "attention_kernel": kernel, **layout})


@pytest.mark.parametrize("name", ROWS)
def test_validate_and_the_ranks_agree_on_the_kernel(name: str) -> None:
    platform, dtype, model, layout, kernel, why = ROWS[name]
    config = _config(dtype, model, layout)
    world = config.parallel.sequence_parallel_degree
    planned = build_plan(config, world, read_model_config(config), platform=platform).layout
    ranks = layout_for(config, world, platform, "the torchrun world", read_model_config(config))
    assert planned == ranks
    assert (planned.kernel, ranks.kernel_reason) == (kernel, planned.kernel_reason)
    assert why in planned.kernel_reason, planned.kernel_reason


@pytest.mark.parametrize(("requested", "platform", "dtype", "model", "words"), [
    ("flash", CPU, "bfloat16", LLAMA, "no CUDA GPU"),
    ("flash", H100_BARE, "bfloat16", LLAMA, "do not import"),
    ("flash", H100, "bfloat16", GPT_OSS, "sinks"),
    ("flash", H100, "float16", {**LLAMA, "head_dim": 100}, "head_dim 100"),
    ("torch_flash", T4, "float16", LLAMA, "compute capability is 7.5"),
    ("torch_flash", H100, "float32", LLAMA, "bf16/fp16"),
    ("cudnn", CPU, "bfloat16", LLAMA, "no CUDA GPU"),
    ("cudnn", A100_CUDNN, "bfloat16", LLAMA, "compute capability is 8.0"),
    ("cudnn", H100_CUDNN_8, "bfloat16", LLAMA, "cuDNN 8.9.7"),
    ("cudnn", H100_CUDNN, "float32", LLAMA, "bf16/fp16"),
    ("cudnn", H100_CUDNN_9_8, "bfloat16", {**LLAMA, "head_dim": 256}, "head_dim 256"),
    ("cudnn", H100_CUDNN, "bfloat16", MISTRAL_SWA, "sliding window"),
    ("cudnn", H100_CUDNN, "bfloat16", GEMMA2, "softcaps"),
    ("fa4", H100_CUDNN, "bfloat16", LLAMA, "flash-attn 4 is not usable"),
    ("fa4", T4, "float16", LLAMA, "flash-attn 4 is not usable"),
    ("fa4", H100_FA4, "bfloat16", GEMMA2, "softcaps"),
    ("fa4", B200_FA4, "bfloat16", {**LLAMA, "head_dim": 192}, "head_dim 192"),
])
def test_an_explicit_kernel_that_cannot_run_is_refused_in_one_paragraph(
    requested: str, platform: Platform, dtype: str, model: dict, words: str
) -> None:
    config = _config(dtype, model, RING2, kernel=requested)
    with pytest.raises(UserError) as exc:
        build_plan(config, 2, read_model_config(config), platform=platform)
    text = str(exc.value)
    assert text.startswith("attention_kernel: ") and words in text and "Fix: " in text
    assert "\n" not in text


def test_explicit_torch_always_runs() -> None:
    pick = choose_kernel("torch", platform=T4, dtype="float16",
                         model=ModelAttention(head_dim=100, softcap=True, sinks=True))
    assert pick.kernel == "torch" and "tiled" in pick.reason


def test_flash_detection_imports_the_modules_it_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    # ring-flash-attn 0.1.8's package __init__ imports a transformers 4 adapter that fails
    # under transformers 5: its function modules still import (the stand-in is flash-attn 2).
    monkeypatch.syspath_prepend(STANDIN)
    for name in [m for m in sys.modules if m.startswith(("flash_attn", "ring_flash_attn"))]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(Exception):  # noqa: B017 - whatever the adapter raises
        importlib.import_module("ring_flash_attn")
    for name in [m for m in sys.modules if m.startswith("ring_flash_attn")]:
        monkeypatch.delitem(sys.modules, name)
    assert flash_kernels_import() is None
    # flash-attn 4 installs only the `flash_attn.cute` namespace under the same name:
    # find_spec("flash_attn") succeeds, the flash-attn 2 interface does not import.
    for name in [m for m in sys.modules if m.startswith(("flash_attn", "ring_flash_attn"))]:
        monkeypatch.delitem(sys.modules, name)
    namespace = types.ModuleType("flash_attn")
    namespace.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    why = flash_kernels_import()
    assert why is not None and FLASH_ATTN_MODULE in why


def test_cudnn_runs_where_eligible_and_validate_prints_the_facts() -> None:
    config = _config("bfloat16", {**LLAMA, "head_dim": 256}, RING2, kernel="cudnn")
    planned = build_plan(config, 2, read_model_config(config), platform=H100_CUDNN).layout
    ranks = layout_for(config, 2, H100_CUDNN, "the torchrun world", read_model_config(config))
    assert planned == ranks and planned.kernel == "cudnn"
    for fact in ("sm90", "cuDNN 9.10.2", "bfloat16", "head dim 256 <= 256", "not yet measured"):
        assert fact in planned.kernel_reason, planned.kernel_reason


def test_auto_keeps_torch_flash_where_cudnn_is_eligible_but_unmeasured() -> None:
    pick = choose_kernel("auto", platform=H100_CUDNN, dtype="bfloat16",
                         model=ModelAttention(head_dim=128))
    assert pick.kernel == "torch_flash" and "not measured faster" in pick.reason
    pick = choose_kernel("auto", platform=A100_CUDNN, dtype="bfloat16",
                         model=ModelAttention(head_dim=128))
    assert pick.kernel == "torch_flash" and "cuDNN" not in pick.reason
    for platform in (H100_FA4, B200_FA4):  # never fa4 either
        assert choose_kernel("auto", platform=platform, dtype="bfloat16").kernel != "fa4"


def test_fa4_runs_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_kernel("fa4", platform=B200_FA4, dtype="bfloat16",
                         model=ModelAttention(head_dim=256)).kernel == "fa4"
    # Not asked yet (fa4=None): the import is tried when `fa4` is requested.
    asked = Platform(cuda=True, ring_flash_attn=False, capability=(9, 0))
    module = types.ModuleType(FA4_MODULE)
    monkeypatch.setitem(sys.modules, FA4_MODULE, module)
    assert FA4_MODULE in fa4_import() and "_flash_attn_fwd" in fa4_import()
    module._flash_attn_fwd = module._flash_attn_bwd = lambda *a, **k: None
    assert fa4_import() is None
    assert choose_kernel("fa4", platform=asked, dtype="float16").kernel == "fa4"
