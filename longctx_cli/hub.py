"""The Hugging Face hub when there is no network: decide in seconds, say what to do.

Without this, an unreachable hub costs tens of seconds of retries and screens of warnings
per file before the real error. One TCP probe (the one `validate` uses for model configs)
decides; when it fails, only the local cache is tried and a miss is one UserError that
names the model, tokenizer or dataset and how to point at a local copy.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse

from longctx_cli.errors import UserError


@functools.cache
def hub_reachable(timeout_s: float = 2.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the endpoint does not answer within `timeout_s`.

    A cheap TCP probe, once per process, so an offline machine does not wait through the
    hub client's retries.
    """
    if any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
           for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy may reach what a direct connection cannot; let the hub client try
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout_s).close()
    except OSError:
        return False
    return True


def offline_error(what: str, name: str, key: str) -> UserError:
    """`what` (tokenizer / dataset / model) `name` is neither reachable nor cached."""
    kind = "dataset" if what == "dataset" else "model"
    setting = "the entry's `path`" if what == "dataset" else f"`{key}`"
    return UserError(
        f"cannot load the {what} {name!r}: the Hugging Face hub is unreachable (or "
        "HF_HUB_OFFLINE is set) and it is not in the local cache.",
        where=key,
        fix=f"on a machine with network run `hf download {name} --repo-type {kind} "
        f"--local-dir DIR`, copy DIR here and set {setting} to that folder "
        "(or fill the Hugging Face cache and set HF_HUB_OFFLINE=1).",
    )
