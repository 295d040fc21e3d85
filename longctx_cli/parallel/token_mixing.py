"""Exact sequence parallelism and packing for decoder parts that mix tokens outside attention.

Hybrid models put short causal convolutions (LFM2), state-space scans (Mamba2 in Falcon-H1,
Bamba, Granite 4.0-H, Nemotron-H, Zamba2) or linear attention (the gated delta-nets of
Qwen3-Next, Qwen3.5 and OLMo hybrid) next to their attention layers; Mamba, Mamba2 and
Falcon-Mamba have nothing but such scans (no attention layer at all). Under SP a rank holds
only a slice of the row, and in a packed row the model's own forward would run these layers
across document boundaries.

longctx runs each such part so that its output at every local token is what the model's
own forward over that token's document alone gives. Every document is its own batch row,
right-padded with zeros, and the model's own module runs on the batch, with its own kernels
(``causal-conv1d``, ``mamba-ssm``, ``flash-linear-attention`` when installed, PyTorch
otherwise). Causality makes the padding harmless: it comes after every real token. What a
rank's rows hold:

* a scan that can start from a given state, on contiguous or zigzag rows: only this rank's
  tokens; the state at a rank boundary passes from rank to rank (:mod:`.state_relay`);
* a scan on stripe rows (a state would change hands at every token), or one that takes no
  starting state (the Mamba of Jamba, Mamba and Falcon-Mamba): each document's whole prefix
  up to this rank's last token of it, the row's tokens arriving in one all-gather whose
  backward reduce-scatters the gradients to their owners;
* a convolution of kernel ``k``: its pieces with the ``k - 1`` tokens before each (the
  halo), only those arriving from the ranks that hold them.

Parameter gradients are each rank's tokens' share, summed over ranks by the trainer like
every other parameter's. :func:`describe` states the cost for ``validate``. Where the
model's code calls a part without the forward's keyword arguments, :class:`MetaScope`
hands it the row's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .decode import DecodeMeta, DecodeUnsupported
from .sharding import (
    SPMeta,
    all_gather_tensor,
    reduce_scatter_sum,
    refuse_prefixes,
    to_global_order,
)
from .state_relay import Relay, StateCache, recomputing, relay_applies, run_relay


@dataclass(frozen=True)
class MixerKind:
    """How far back a token-mixing part reads: ``window`` tokens (a short convolution,
    ``kernel - 1``) or, with ``window=None``, its whole document (a scan)."""

    what: str  # for messages and validate: "short convolution", "Mamba2 scan", ...
    window: int | None
    # A scan that starts from a given state in a multi-token call (its cache interface) can
    # pass its state between ranks; one that cannot (Jamba's Mamba) always reruns prefixes.
    passes_state: bool = False


def _conv_window(module: nn.Module) -> int:
    return int(module.conv_kernel_size) - 1


# The token-mixing parts longctx runs exactly, by class name (transformers' own classes),
# each with how far back it reads. Every one is tested against the model's own per-document
# training (tests/test_token_mixing.py) and in the family matrix.
# (what it is, its reach: a window for a convolution, None for a scan; whether the scan can
# pass its state between ranks)
_CONV = ("short convolution", _conv_window, False)
_DELTA_NET = ("gated delta-net (conv + linear-attention scan)", None, True)
_MAMBA2 = ("Mamba2 (conv + SSM scan)", None, True)
_MAMBA = ("Mamba (conv + selective scan)", None, False)
COVERED: dict[str, tuple[str, Any, bool]] = {
    "Lfm2ShortConv": _CONV,
    "Lfm2MoeShortConv": _CONV,
    "Lfm3ShortConv": _CONV,
    "Qwen3NextGatedDeltaNet": _DELTA_NET,
    "Qwen3_5GatedDeltaNet": _DELTA_NET,
    "Qwen3_5MoeGatedDeltaNet": _DELTA_NET,
    "OlmoHybridGatedDeltaNet": _DELTA_NET,
    "LaraMiniGatedDeltaNet": _DELTA_NET,
    "KimiLinearDeltaAttention": ("Kimi delta attention (conv + linear-attention scan)", None,
                                 True),
    "FalconH1Mixer": _MAMBA2,
    "BambaMixer": _MAMBA2,
    "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2,
    "Zamba2MambaMixer": _MAMBA2,
    "Mamba2Mixer": _MAMBA2,  # Mamba2 and Codestral Mamba: no attention layer at all
    # Their selective scan takes no starting state in a multi-token call (Mamba and
    # Falcon-Mamba have no attention layer at all).
    "JambaMambaMixer": _MAMBA,
    "MambaMixer": _MAMBA,
    "FalconMambaMixer": _MAMBA,
}


def mixer_kind(module: nn.Module) -> MixerKind | None:
    """The kind of a covered token-mixing part, None for any other module."""
    entry = COVERED.get(type(module).__name__)
    if entry is None:
        return None
    what, window, passes_state = entry
    return MixerKind(what, None if window is None else int(window(module)), passes_state)


# ---- the differentiable exchange ------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    """Every rank's ``[m, ...]`` stacked in rank order, ``[n * m, ...]``; backward sums each
    rank's gradient of a received value onto its sender (reduce-scatter)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, meta: SPMeta) -> torch.Tensor:  # type: ignore[override]
        ctx.meta = meta
        out = part.new_empty((part.shape[0] * meta.ctx.layout.sp, *part.shape[1:]))
        all_gather_tensor(out, part.contiguous(), group=meta.ctx.sp_group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        meta = ctx.meta
        out = grad.new_empty((grad.shape[0] // meta.ctx.layout.sp, *grad.shape[1:]))
        reduce_scatter_sum(out, grad.contiguous(), group=meta.ctx.sp_group)
        return out, None


# ---- which rows a rank runs ---------------------------------------------------------------


@dataclass(frozen=True)
class MixerRows:
    """The batch one rank runs a token-mixing part on, for one row and one reach.

    Row ``i`` of the batch is the global tokens ``starts[i] .. ends[i]``. The hook builds a
    pool of token values: this rank's own tokens, then what the exchange brought (the whole
    row in global order for a scan; for a convolution only the halo tokens other ranks
    ``send``, ``slots`` per rank). Cell ``target[j]`` of the flattened batch gets pool value
    ``source[j]``; ``take`` reads the local tokens back out of the flattened output.
    """

    starts: tuple[int, ...]
    ends: tuple[int, ...]
    width: int
    take: torch.Tensor  # long [local_tokens]
    source: torch.Tensor  # long [tokens in rows]: pool index of each real batch cell
    target: torch.Tensor  # long [tokens in rows]: flat batch cell of each of them
    send: torch.Tensor | None  # long [slots]: local tokens this rank sends (None: all, in order)
    slots: int  # halo values each rank sends (padded to the largest)


def mixer_rows(meta: SPMeta, window: int | None) -> MixerRows:
    """The rows for this rank (built once per row and reach: every layer of it shares them)."""
    return meta.derived(_new_mixer_rows, window)


def _rows_of(segments: Any, window: int | None) -> tuple[list[list[int]], list[tuple]]:
    """Batch rows ``[start, end]`` (global) and where each local piece sits in them."""
    rows: list[list[int]] = []
    where: list[tuple[int, int, int, int]] = []  # (row, global first, global end, local start)
    last_doc = None
    # A segment is a piece of one document held here: local [q_start, q_end) is global
    # [k_end - length, k_end); its document starts at k_start.
    for seg in segments:
        first = seg.k_end - (seg.q_end - seg.q_start)
        if window is None and seg.k_start == last_doc:
            rows[-1][1] = seg.k_end  # one scan per document: later pieces extend its row
        else:
            reach = seg.k_start if window is None else max(seg.k_start, first - window)
            rows.append([reach, seg.k_end])
        last_doc = seg.k_start
        where.append((len(rows) - 1, first, seg.k_end, seg.q_start))
    return rows, where


def _owners(meta: SPMeta) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Per global token: its SP rank and its index there; and every rank's segments."""
    from .mesh import ParallelState
    from .sharding import segments_for, slice_sequence

    layout, total = meta.ctx.layout, meta.total_len
    owner = torch.empty(total, dtype=torch.long)
    index = torch.empty(total, dtype=torch.long)
    segments = []
    for rank in range(meta.ctx.layout.sp):
        held = slice_sequence(torch.arange(total), ParallelState(layout, sp_rank=rank))
        owner[held] = rank
        index[held] = torch.arange(held.numel())
        segments.append(segments_for(meta.cu_host, layout.local_ranges(total, rank)))
    return owner, index, segments


def _new_mixer_rows(meta: SPMeta, window: int | None) -> MixerRows:
    rows, where = _rows_of(meta.segments, window)
    width = max(e - s for s, e in rows)
    take = torch.empty(meta.local_len, dtype=torch.long)
    for row, first, end, q_start in where:
        offset = row * width + first - rows[row][0]
        take[q_start:q_start + end - first] = torch.arange(offset, offset + end - first)
    cells = torch.cat([torch.arange(s, e) for s, e in rows])  # global token of each cell
    target = torch.cat([torch.arange(i * width, i * width + e - s)
                        for i, (s, e) in enumerate(rows)])
    n, me, send, slots = meta.ctx.layout.sp, meta.ctx.sp_rank, None, 0
    if n == 1:
        source = cells
    elif window is None:  # the whole row arrives; own tokens are read from it too
        source = meta.local_len + cells
    else:
        # Halo exchange: every rank works out what each rank needs from each other one (the
        # same arithmetic everywhere), and sends its part of it in one all-gather.
        owner, index, segments = _owners(meta)
        needed = torch.zeros(meta.total_len, dtype=torch.bool)
        for rank in range(n):
            rank_rows, _ = _rows_of(segments[rank], window)
            for a, b in rank_rows:
                span = torch.arange(a, b)
                needed[span[owner[span] != rank]] = True
        given = [needed.nonzero().flatten()[owner[needed] == r] for r in range(n)]
        slots = max(1, max(g.numel() for g in given))
        slot = torch.full((meta.total_len,), -1, dtype=torch.long)
        for r, g in enumerate(given):
            slot[g] = meta.local_len + r * slots + torch.arange(g.numel())
        mine = owner[cells] == me
        source = torch.where(mine, index[cells], slot[cells])
        send = torch.zeros(slots, dtype=torch.long)  # padding re-sends token 0, unread
        send[:given[me].numel()] = index[given[me]]
    device = meta.cu_seqlens.device
    return MixerRows(tuple(s for s, _ in rows), tuple(e for _, e in rows), width,
                     take.to(device), source.to(device), target.to(device),
                     None if send is None else send.to(device), slots)


def token_pool(local: torch.Tensor, meta: SPMeta, rows: MixerRows) -> torch.Tensor:
    """This rank's tokens ``[local, hidden]``, then what the exchange brings (see
    :class:`MixerRows`), differentiably: gradients flow back to the senders."""
    if meta.ctx.layout.sp == 1:
        return local
    if rows.send is None:
        return torch.cat([local, to_global_order(_AllGather.apply(local, meta), meta)])
    return torch.cat([local, _AllGather.apply(local.index_select(0, rows.send), meta)])


# ---- attaching it to a model --------------------------------------------------------------


class MetaScope:
    """The row's SP metadata for the duration of the forward that received it.

    Some models call their token mixers without the forward's keyword arguments (MambaModel
    and FalconMambaModel pass none to their blocks, Jamba's layer none to its Mamba), so
    ``sp_meta`` never reaches the mixer. Hooks on the mixers' enclosing modules (the model's
    own, nothing replaced) hold it: the outermost one called with ``sp_meta`` sets it and
    clears it when its forward ends, even by an exception. A recompute under activation
    checkpointing (in backward, after that forward) replays the last row, whose metadata is
    kept for it until the next forward replaces it.
    """

    def __init__(self) -> None:
        self._meta: Any = None  # set while the forward runs
        self._owner: nn.Module | None = None  # the module whose forward set it
        self._last: Any = None  # the last row's metadata, for a recompute in backward
        self.handles: list[Any] = []

    def enclose(self, module: nn.Module) -> None:
        """Hold the metadata ``module``'s forward is called with (if any) while it runs."""
        self.handles += [module.register_forward_pre_hook(self._enter, with_kwargs=True),
                         module.register_forward_hook(self._exit, always_call=True)]

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        meta = kwargs.get("sp_meta")
        if meta is not None and self._owner is None:
            self._meta, self._owner, self._last = meta, module, meta

    def _exit(self, module: nn.Module, args: tuple, out: Any) -> None:
        if module is self._owner:
            self._meta, self._owner = None, None

    def current(self) -> Any:
        """The metadata of the forward in flight, or of the last one inside a recompute."""
        if self._meta is not None:
            return self._meta
        return self._last if recomputing() else None


class TokenMixerSP:
    """Forward hooks that make one covered part run on document rows (see module doc).

    The pre-hook replaces the part's input by the batch of rows and remembers how to read
    the local tokens back; the forward hook does that. Nothing of the model is replaced:
    parameter names, checkpoints and adapters see the model's own module.
    """

    def __init__(self, module: nn.Module, kind: MixerKind, scope: MetaScope):
        self.kind = kind
        self.name = type(module).__name__
        # The rows of the call in flight. One slot: a module's forward never nests, and a
        # recompute that activation checkpointing stops early just leaves it to be replaced.
        self._rows: MixerRows | None = None
        self._relay = Relay()  # states received this row (scans that pass state)
        self._relayed: torch.Tensor | None = None  # the output computed by state passing
        # The row's layout for a part the model's code calls without the forward's keyword
        # arguments (Jamba's Mamba, every Mamba / Falcon-Mamba layer).
        self._scope = scope
        self.handles = (
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after, with_kwargs=True),
        )

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        meta = kwargs.get("sp_meta")
        if meta is None:  # called without the forward's keyword arguments
            meta = self._scope.current()
        if isinstance(meta, DecodeMeta):
            # Its state is not kept across a sharded prefill: the caller decodes by full
            # forwards instead (the same tokens).
            raise DecodeUnsupported(f"{self.name} mixes tokens outside attention")
        if not isinstance(meta, SPMeta):
            raise RuntimeError(
                f"{self.name} mixes tokens outside attention and runs only on longctx "
                "batches: call the model with sp_meta= (a sharded row)."
            )
        # A whole-row forward keeps no state for decoding: a model's default cache would
        # record this batch of rows, not the sequence (decode steps are refused above).
        for name in ("cache", "past_key_values", "cache_params"):
            kwargs.pop(name, None)
        if kwargs.get("attention_mask") is not None:
            raise RuntimeError(f"{self.name}: longctx builds document boundaries itself; "
                               "attention_mask must be None.")
        args = list(args)
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[0] != 1 or hidden.shape[1] != meta.local_len:
            raise ValueError(f"{self.name}: expected this rank's one row of {meta.local_len} "
                             f"tokens, got {tuple(hidden.shape[:2])}")
        refuse_prefixes(meta, f"{self.name} (a token mixer with a state, not attention)")
        meta.token_mixer_calls += 1
        if self.kind.passes_state and relay_applies(meta):
            # A scan on contiguous or zigzag rows: its state passes from rank to rank; the
            # module's own call (its output replaced in _after) gets one token.
            others = {k: v for k, v in kwargs.items() if k not in ("sp_meta", "hidden_states")}
            self._relayed = run_relay(module, hidden[0], meta, self._relay, others)
            self._rows = None
            if args:
                args[0] = hidden[:, :1]
            else:
                kwargs["hidden_states"] = hidden[:, :1]
            return tuple(args), {k: v for k, v in kwargs.items() if k != "sp_meta"}
        rows = mixer_rows(meta, self.kind.window)
        pool = token_pool(hidden[0], meta, rows)
        cells = pool.new_zeros((len(rows.starts) * rows.width, pool.shape[-1]))
        cells = cells.index_copy(0, rows.target, pool.index_select(0, rows.source))
        batch = cells.unflatten(0, (len(rows.starts), rows.width))
        self._rows = rows
        if args:
            args[0] = batch
        else:
            kwargs["hidden_states"] = batch
        # The part's kernels take only their own arguments (transformers filters them).
        kwargs = {k: v for k, v in kwargs.items() if k != "sp_meta"}
        return tuple(args), kwargs

    def _after(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> torch.Tensor:
        if self._relayed is not None:
            relayed, self._relayed = self._relayed, None
            return relayed
        rows, self._rows = self._rows, None
        if rows is None:
            raise RuntimeError(f"{self.name}: forward hook without its pre-hook")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{self.name} returned {type(out).__name__}, not a tensor")
        return out.flatten(0, 1).index_select(0, rows.take).unsqueeze(0)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def covered_mixers(model: nn.Module) -> list[tuple[str, nn.Module, MixerKind]]:
    """``(qualified name, module, kind)`` of every covered token-mixing part of ``model``."""
    return [(name, m, kind) for name, m in model.named_modules()
            if (kind := mixer_kind(m)) is not None]


def attach_token_mixing(model: nn.Module) -> list[TokenMixerSP]:
    """Hook every covered token-mixing part of ``model``; [] for pure-attention models."""
    mixers = covered_mixers(model)
    if not mixers:
        return []
    scope = MetaScope()
    parents = {name.rpartition(".")[0] for name, _, _ in mixers}
    for name, module in model.named_modules():  # the root and every module above a part
        if not name or any(p == name or p.startswith(f"{name}.") for p in parents):
            scope.enclose(module)
    return [TokenMixerSP(m, kind, scope) for _, m, kind in mixers]


def state_bytes(module: nn.Module, hidden: int, bytes_per_value: int) -> int:
    """Bytes of the state a covered scan hands to the next rank per document boundary: its
    conv state and recurrent state, shaped by its own forward on the meta device (the
    recurrent state counted in float32, the dtype the scans keep it in)."""
    cache = StateCache(None, None)
    with torch.device("meta"):
        module(torch.empty(1, 4, hidden, device="meta"), cache=cache)
    conv = 0 if cache.conv_out is None else cache.conv_out.numel() * bytes_per_value
    return conv + (0 if cache.recurrent_out is None else cache.recurrent_out.numel() * 4)


def describe(model: nn.Module, sp: int, sharding: str, row_tokens: int, hidden: int,
             bytes_per_value: int) -> str | None:
    """What ``validate`` says of a model's covered token-mixing layers (``model`` built on
    the meta device): which they are and what they add per step on one rank. None for a
    model without any."""
    mixers = covered_mixers(model)
    if not mixers:
        return None
    found: dict[str, int] = {}
    for _, module, _ in mixers:
        found[type(module).__name__] = found.get(type(module).__name__, 0) + 1
    layers = ", ".join(f"{n} x {cls} ({COVERED[cls][0]})" for cls, n in found.items())
    if sp == 1:
        return f"{layers}: run per document of the packed row (no communication at sp 1)."
    scan_kinds = [(m, kind) for _, m, kind in mixers if kind.window is None]
    convs = len(mixers) - len(scan_kinds)
    relayed = [m for m, kind in scan_kinds if kind.passes_state and sharding != "stripe"]
    rerun = len(scan_kinds) - len(relayed)
    mib = row_tokens * hidden * bytes_per_value / 2**20
    parts = []
    if rerun:
        why = ("a stripe row would hand it over at every token" if sharding == "stripe"
               else "the layer takes no starting state")
        instead = ("; a contiguous or zigzag `sp_sharding` passes the state instead"
                   if sharding == "stripe" and all(k.passes_state for _, k in scan_kinds)
                   else "")
        parts.append(
            f"the {rerun} scan layer(s) each gather their input over the SP group ({mib:.1f} "
            "MiB received per layer per rank in forward, the same reduce-scattered in "
            f"backward) and pass no state between ranks ({why}): every rank reruns the "
            "prefix of each document it holds part of, so these layers' work and activations "
            f"do not shrink with sp{instead}")
    if relayed:
        kib = sum(state_bytes(m, hidden, bytes_per_value) for m in relayed) / 2**10
        parts.append(
            f"the {len(relayed)} scan layer(s) pass their state from rank to rank ({kib:.1f} "
            "KiB over all of them per document boundary, sent forward and its gradient "
            "back): each rank scans only its own tokens, one rank after another along the row")
    if convs:
        parts.append(f"the {convs} convolution layer(s) receive only a halo of kernel - 1 "
                     "tokens per piece of a document from the rank before it")
    return f"{layers}: " + "; ".join(parts) + "."
