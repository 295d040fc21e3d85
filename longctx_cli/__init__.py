"""longctx: fine-tune Hugging Face causal LMs on very long sequences with sequence parallelism."""

__version__ = "0.1.0"
