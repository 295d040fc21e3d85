"""State passing for the scans of hybrid models: each rank runs only its own tokens and hands
the layer's state at its boundary to the rank that holds the next tokens.

A covered scan layer (`token_mixing.COVERED`) continues from a given state through its own
cache interface: transformers' Mamba2 and gated delta-net modules read a conv state and a
recurrent state from ``cache`` in a multi-token forward (``get_conv_state``,
``get_recurrent_state``: the chunked-prefill path) and write the final ones back
(``update_conv_state``, ``update_recurrent_state``). longctx hands each call a
:class:`StateCache` holding the state received from the previous rank and sends on what the
module wrote. So the model's own code, with its own kernels, computes every token once.

The row is a chain of *links* in global order: the ``N`` contiguous slices, or the ``2N``
zigzag chunks (rank ``r`` holds links ``r`` and ``2N-1-r``). A rank runs its links in chain
order: it receives the state of the link before (when a document crosses into it), runs the
module on the link's document pieces as one right-padded batch (row 0 starts from the
received state, the others from zero: documents start fresh), and sends the state of the
piece that continues into the next link (run as its own call, unpadded, so its final state
is exact). Forward is therefore sequential along the chain: the scan layers take as long as
on one rank, with ``1/N`` of the activations.

Backward runs the chain in reverse: :class:`_SendState` receives the gradient of the state
it sent from the next rank, :class:`_RecvState` sends the gradient of the state it received
to the previous one. Every rank's autograd runs a layer's nodes in the same order, and the
last link needs nothing, so the chain unwinds without a deadlock. Under activation
checkpointing the recomputed forward reuses the states received the first time and sends
nothing (backward always runs the nodes of the first forward).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .sharding import SPMeta

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 12  # int64 slots: dtype code, ndim, up to 10 dims


@dataclass(frozen=True)
class Call:
    """One module call of a rank: batch row ``i`` is local tokens ``pieces[i]``; row 0 starts
    from the state of SP rank ``state_from`` (None: from zero); the state after the single
    row goes to SP rank ``state_to`` (None: nowhere)."""

    pieces: tuple[tuple[int, int], ...]
    state_from: int | None
    state_to: int | None


def relay_applies(meta: SPMeta) -> bool:
    """State passing runs on contiguous and zigzag rows whose links hold at least 2 tokens
    (a one-token call would take the modules' decode path). Stripe rows hand a state over
    at every token: they take the prefix path."""
    ctx = meta.ctx
    links = ctx.layout.sp * (2 if ctx.layout.sharding == "zigzag" else 1)
    return (ctx.layout.sp > 1 and ctx.layout.sharding in ("contiguous", "zigzag")
            and meta.total_len // links >= 2)


def relay_calls(meta: SPMeta) -> tuple[Call, ...]:
    """This rank's calls for one row, in chain order (built once per row)."""
    return meta.derived(_new_relay_calls)


def _links(meta: SPMeta) -> list[tuple[int, int, int]]:
    """``(start, end, owner)`` of every link, in global order."""
    ctx, total = meta.ctx, meta.total_len
    n = ctx.layout.sp
    if ctx.layout.sharding == "contiguous":
        size = total // n
        return [(r * size, (r + 1) * size, r) for r in range(n)]
    size = total // (2 * n)
    return [(c * size, (c + 1) * size, c if c < n else 2 * n - 1 - c) for c in range(2 * n)]


def _new_relay_calls(meta: SPMeta) -> tuple[Call, ...]:
    me, cu = meta.ctx.sp_rank, meta.cu_host
    links = _links(meta)
    calls: list[Call] = []
    local = 0  # links of this rank lie in local storage in chain order
    for index, (start, end, owner) in enumerate(links):
        if owner != me:
            continue
        pieces = [(s.q_start, s.q_end) for s in meta.segments
                  if local <= s.q_start < local + end - start]
        first_doc = cu[bisect_right(cu, start) - 1]  # start of the document at `start`
        last_doc_end = cu[bisect_right(cu, end - 1)]  # end of the document at `end - 1`
        state_from = links[index - 1][2] if first_doc < start else None
        state_to = links[index + 1][2] if last_doc_end > end else None
        if state_to is not None and len(pieces) > 1:
            calls.append(Call(tuple(pieces[:-1]), state_from, None))
            calls.append(Call((pieces[-1],), None, state_to))
        else:
            calls.append(Call(tuple(pieces), state_from, state_to))
        local += end - start
    return tuple(calls)


class StateCache:
    """What a covered module reads its starting state from and writes its final state to
    (the part of transformers' cache interface those modules use in a multi-token forward)."""

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None):
        self.conv_in, self.recurrent_in = conv, recurrent
        self.conv_out: torch.Tensor | None = None
        self.recurrent_out: torch.Tensor | None = None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv_in

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent_in

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # no per-token states kept for speculative decoding (transformers >= 5.25)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs: Any) -> torch.Tensor:
        full = conv_states if self.conv_in is None else torch.cat(
            [self.conv_in.to(conv_states.dtype), conv_states], dim=-1)
        width = conv_kernel_size or full.shape[-1]
        if full.shape[-1] < width:  # a piece shorter than the kernel: zeros before it
            full = torch.nn.functional.pad(full, (width - full.shape[-1], 0))
        self.conv_out = full[..., -width:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self.recurrent_out = recurrent_states
        return recurrent_states


class Relay:
    """The states one covered layer received in the current row's forward, kept for a
    recompute under activation checkpointing."""

    def __init__(self) -> None:
        self.received: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def recomputing() -> bool:
    """True inside backward: activation checkpointing is recomputing a forward."""
    return torch._C._current_graph_task_id() != -1


def _peer(meta: SPMeta, sp_rank: int) -> int:
    return dist.get_global_rank(meta.ctx.sp_group, sp_rank)


def _send_tensor(t: torch.Tensor, dst: int) -> None:
    header = torch.zeros(_HEADER, dtype=torch.long)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2:2 + t.dim()] = torch.tensor(t.shape)
    dist.send(header.to(t.device), dst)
    dist.send(t.contiguous(), dst)


def _recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.recv(header, src)
    header = header.tolist()
    out = torch.empty(header[2:2 + header[1]], dtype=_DTYPES[header[0]], device=device)
    dist.recv(out, src)
    return out


class _RecvState(torch.autograd.Function):
    """The (conv, recurrent) state from SP rank ``src``; backward sends their gradients
    back. ``anchor`` (this rank's layer input) only ties the node into the graph."""

    @staticmethod
    def forward(ctx, anchor, meta: SPMeta, src: int, relay: Relay, key: int):  # type: ignore[override]
        if recomputing() and key in relay.received:
            conv, recurrent = relay.received[key]
        else:
            peer = _peer(meta, src)
            conv = _recv_tensor(peer, anchor.device)
            recurrent = _recv_tensor(peer, anchor.device)
            relay.received[key] = (conv, recurrent)
        ctx.peer = _peer(meta, src)
        ctx.like = (conv, recurrent)
        return conv.clone(), recurrent.clone()

    @staticmethod
    def backward(ctx, d_conv, d_recurrent):  # type: ignore[override]
        for grad, like in zip((d_conv, d_recurrent), ctx.like, strict=True):
            dist.send((torch.zeros_like(like) if grad is None else grad).contiguous(),
                      ctx.peer)
        return None, None, None, None, None


class _SendState(torch.autograd.Function):
    """Sends the (conv, recurrent) state to SP rank ``dst``; returns a zero the caller adds
    to the layer's output, so backward reaches this node and receives their gradients."""

    @staticmethod
    def forward(ctx, conv, recurrent, meta: SPMeta, dst: int):  # type: ignore[override]
        ctx.peer = _peer(meta, dst)
        ctx.shapes = [(t.shape, t.dtype) for t in (conv, recurrent)]
        if not recomputing():
            _send_tensor(conv.detach(), ctx.peer)
            _send_tensor(recurrent.detach(), ctx.peer)
        return conv.new_zeros(())

    @staticmethod
    def backward(ctx, d_zero):  # type: ignore[override]
        grads = []
        for shape, dtype in ctx.shapes:
            grad = torch.empty(shape, dtype=dtype, device=d_zero.device)
            dist.recv(grad, ctx.peer)
            grads.append(grad)
        return grads[0], grads[1], None, None


def run_relay(module: torch.nn.Module, local: torch.Tensor, meta: SPMeta, relay: Relay,
              kwargs: dict[str, Any]) -> torch.Tensor:
    """The module's output ``[1, local, out]`` at this rank's tokens, computed link by link
    with the states passed along the chain (module doc). ``kwargs``: the module's other
    arguments (no cache, no mask)."""
    outputs = []
    relay.received = {} if not recomputing() else relay.received
    me = meta.ctx.sp_rank
    carried: tuple[torch.Tensor, torch.Tensor] | None = None  # zigzag: link N-1 to link N
    for key, call in enumerate(relay_calls(meta)):
        lengths = [b - a for a, b in call.pieces]
        width = max(max(lengths), 2 if call.state_from is not None else 1)
        rows = [torch.nn.functional.pad(local[a:b], (0, 0, 0, width - (b - a)))
                for a, b in call.pieces]
        batch = torch.stack(rows)
        cache = None
        if call.state_from is not None or call.state_to is not None:
            conv = recurrent = None
            if call.state_from == me:  # the previous link is this rank's own
                conv, recurrent = carried
            elif call.state_from is not None:
                conv, recurrent = _RecvState.apply(local, meta, call.state_from, relay, key)
            if call.state_from is not None:
                if len(rows) > 1:  # only row 0 continues a document; the others start fresh
                    conv = torch.cat([conv, conv.new_zeros((len(rows) - 1, *conv.shape[1:]))])
                    recurrent = torch.cat([recurrent, recurrent.new_zeros(
                        (len(rows) - 1, *recurrent.shape[1:]))])
            cache = StateCache(conv, recurrent)
        out = module.forward(batch, cache=cache, **kwargs)
        if call.state_to is not None:
            if cache.conv_out is None or cache.recurrent_out is None:
                raise RuntimeError(f"{type(module).__name__} did not write its final state to "
                                   "the cache; it cannot pass state between ranks")
            if call.state_to == me:
                carried = (cache.conv_out, cache.recurrent_out)
            else:
                out = out + _SendState.apply(cache.conv_out, cache.recurrent_out, meta,
                                             call.state_to)
        outputs.extend(out[i, :n] for i, n in enumerate(lengths))
    return torch.cat(outputs).unsqueeze(0)
