"""Each rank's shard copied to a peer's host memory after every step (``checkpoint.peer_copies``).

In a layout whose shards have no replica (FSDP without a second data-parallel group, PP stages
without DP, TP), a lost rank's state exists nowhere else: without a copy the run restores the
newest checkpoint and redoes the steps since. With peer copies every rank sends the blocks it
owns (``reshard.local_pieces(owned_by=...)``: the union over ranks is the state, once) to one
peer, on another node when there is one (``peer_ring``), and the survivors rebuild a lost rank's
blocks from its copy (``Membership._share_state_as_pieces``: copies are one more kind of source).

The invariant that makes the recovery redo nothing: **a step commits only once every rank's
copy of the state it made is whole at its peer**, and the copies and snapshots of an older
state are dropped only once a newer one is confirmed. A rank copies its blocks into a snapshot
buffer of its own right after its optimizer step (the one memory copy on the step's path) and
sends it over the group's ``Channel`` (gloo, a process group of two per pair, a thread of its
own); the peer receives it into its own memory on a concurrency group of its own (``hold_copy``,
whose return is the receipt), while this rank computes the next step. Before that next step's
agreement (``_agree``'s all-gather) the rank waits for the receipt, so the agreement confirms
every rank's copy of the state before it: that step is kept (``lease_results``) and committed
only then. The lease's last step waits for its own copy and confirms it with one more
collective before its report (a step a call, as the tests run, is so synchronous). Whatever
dies, the committed state is whole among the survivors: their live state, the copies they hold
for the lost, and their own snapshots (a survivor ahead of the committed state goes back to its
snapshot, since its copy may have been on the lost rank); a member about to be killed while it
still answers hands its copies over first (``Membership.rescue``). A copy is held only once
every byte of it arrived (a receive that fails holds nothing), never in part. Losing a rank and
its peer together loses that copy: the checkpoint is the fallback. A process without a group
(no store for the channel) moves its copies as Ray objects instead (``ray.put``, Ray's object
transfer, the peer's copy in): the same protocol at 4-6x the channel's CPU a copy
(``benchmarks/peer_copies.py --sections transport``), which on a host whose cores all train is
what a copy costs the step.

Memory, per rank: the copies it holds for others (one rank's with a balanced ring) and its own
snapshots, in its own memory; two of each in a lease (the newest state's arriving while the one
before waits for its confirmation), one of each at its end. A copy or snapshot that is dropped
lends its buffer to the next one (``_Arrays``): a new array of hundreds of MB costs a page
fault per page on its first write, several times the copy itself.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import ray
import torch
import torch.distributed as dist

from raytrain_sys.parallel.reshard import Piece


def wanted(setting: int, degrees: dict[str, int]) -> bool:
    """Whether a layout keeps peer copies: ``checkpoint.peer_copies`` 1 on, 0 off, -1 (auto) on
    when some state has no replica: sharded (fsdp, tp or pp > 1) without a second
    data-parallel group."""
    if setting >= 0:
        return bool(setting)
    sharded = degrees.get("fsdp", 1) > 1 or degrees.get("tp", 1) > 1 or degrees.get("pp", 1) > 1
    return sharded and degrees.get("dp", 1) == 1


# Tensors of optimizer state per parameter tensor (AdamW and LAMB: two moments; LARS: momentum).
STATES_PER_PARAM = {"adamw": 2, "lamb": 2, "lars": 1}


def copy_bytes(param_bytes: int, optimizer: str) -> int:
    """A rank's copy, estimated before its first step (optimizer state is made at the first):
    its parameters' blocks and their optimizer state."""
    return param_bytes * (1 + STATES_PER_PARAM.get(optimizer, 2))


# What peer copies take of a rank's copy on its node, at most: two copies held for its peer
# and two snapshots of its own (within a lease), all in the processes' memory (the channel's
# copies go through no object store). Auto mode keeps them within HOST_SHARE of the memory the
# node has available when the group forms.
COPIES_HELD = 4
HOST_SHARE = 0.5


def room(copy_bytes: int, ranks_on_node: int, available_bytes: int) -> bool:
    """Whether a node has the memory for its ranks' peer copies (auto mode)."""
    return COPIES_HELD * copy_bytes * ranks_on_node <= HOST_SHARE * available_bytes


def peer_ring(nodes: list[str]) -> list[int]:
    """The peer of each rank (``nodes[r]``: rank r's node): a rank on another node whenever
    there is one, so that losing any one node loses no rank together with its copy; of those,
    the one holding the fewest copies so far, then the nearest after it in the ring of ranks
    ordered by node. Balanced nodes give every rank exactly one copy to hold. On one node the
    peer is the next rank (a process lost, not the node)."""
    n = len(nodes)
    if n < 2:
        return [0] * n
    order = sorted(range(n), key=lambda r: (nodes[r], r))
    position = {r: i for i, r in enumerate(order)}
    load = [0] * n
    peers = [0] * n
    for r in order:
        others = [p for p in range(n) if p != r and nodes[p] != nodes[r]] or [p for p in range(n) if p != r]
        p = min(others, key=lambda q: (load[q], (position[q] - position[r]) % n))
        peers[r] = p
        load[p] += 1
    return peers


def to_wire(pieces: dict[str, Piece]) -> dict[str, tuple]:
    """Pieces as flat byte arrays (numpy: Ray puts those in the object store with one memory
    copy and reads them back without one, where a tensor is pickled) with their dtype, shape and
    place; a piece under several keys (tied parameters) is one array."""
    arrays: dict[int, Any] = {}
    out = {}
    for key, p in pieces.items():
        if id(p.data) not in arrays:
            arrays[id(p.data)] = p.data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[key] = (str(p.data.dtype).removeprefix("torch."), tuple(p.data.shape), p.global_shape, p.offset,
                    arrays[id(p.data)])
    return out


def from_wire(wire: dict[str, tuple], copy: bool = True,
              take: Callable[[np.ndarray], np.ndarray] | None = None) -> dict[str, Piece]:
    """``to_wire``'s pieces back, copied into this process's memory (the arrays Ray hands out
    are views of the object store, whose object the sender owns: it may die), each into the
    array ``take(array)`` gives if given (of its size); ``copy=False`` reads them in place (an
    object this process owns: read only, for a rebuild's cuts)."""
    tensors: dict[int, torch.Tensor] = {}
    out = {}
    for key, (dtype, shape, global_shape, offset, array) in wire.items():
        if id(array) not in tensors:
            mine = array
            if copy:
                mine = take(array) if take is not None else np.empty(array.nbytes, np.uint8)
                np.copyto(mine, array)
            with warnings.catch_warnings():  # read only in place: the cuts copy, nothing writes
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(mine)
            tensors[id(array)] = data.view(getattr(torch, dtype)).reshape(shape)
        out[key] = Piece(tuple(global_shape), tuple(offset), tensors[id(array)])
    return out


class _Arrays:
    """The byte arrays of dropped copies, lent to the next copies of the same sizes (the copies
    a peer holds are the same arrays step after step). An array is lent only when nothing reads
    it any more (no tensor made from it is alive); at most one copy's arrays are kept idle, and
    none across generations (another layout, other sizes)."""

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}
        self.per_copy: dict[int, int] = {}  # nbytes -> how many arrays of that size a copy has

    def take(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes, [])
        for i in range(len(free)):
            if _unread(free[i]):
                return free.pop(i)
        return np.empty(nbytes, np.uint8)

    def give(self, arrays: list[np.ndarray]) -> None:
        for array in arrays:
            free = self._free.setdefault(array.nbytes, [])
            free.append(array)
            while len(free) > self.per_copy.get(array.nbytes, 0):
                idle = [i for i in range(len(free)) if _unread(free[i])]
                if not idle:
                    break
                del free[idle[0]]

    def clear(self) -> None:
        self._free.clear()


def _unread(array: np.ndarray) -> bool:
    """Nothing but the pool refers to ``array`` (the list's reference, and the call's)."""
    return sys.getrefcount(array) <= 3


def flat_layout(wire: dict[str, tuple]) -> tuple[dict[str, tuple], list[tuple[int, Any]], int]:
    """``to_wire``'s pieces laid end to end in one byte buffer: each key's (dtype, shape, global
    shape, offset, start, nbytes), the (start, array) of each array once, and the total."""
    starts: dict[int, int] = {}
    arrays, total, meta = [], 0, {}
    for key, (dtype, shape, global_shape, offset, array) in wire.items():
        if id(array) not in starts:
            starts[id(array)] = total
            arrays.append((total, array))
            total += array.nbytes
        meta[key] = (dtype, shape, global_shape, offset, starts[id(array)], array.nbytes)
    return meta, arrays, total


def wire_of(meta: dict[str, tuple], flat: np.ndarray) -> dict[str, tuple]:
    """``flat_layout``'s meta over a buffer, as ``to_wire``'s pieces (views of the buffer)."""
    views: dict[int, np.ndarray] = {}
    out = {}
    for key, (dtype, shape, global_shape, offset, start, nbytes) in meta.items():
        if start not in views:
            views[start] = flat[start:start + nbytes]
        out[key] = (dtype, shape, global_shape, offset, views[start])
    return out


class Channel:
    """The bytes of copies between the ranks of one group, over gloo: a process group of two for
    each (sender, holder) pair, made on its first copy by both ends (the sender's thread, the
    holder's call) through the group's store, so no member waits for any other to make them
    (each on a store client of its own: one waiting for its other end holds no other up).
    A rank's sends go one at a time in a thread of their own, beside its step. Gloo moves a
    copy with about a fifth of the CPU of Ray's object transfer (``benchmarks/peer_copies.py
    --sections transport``), which on a host whose cores all train is the copy's cost."""

    def __init__(self, store, rank: int, generation: int, timeout_s: float):
        self.rank, self.timeout = rank, timedelta(seconds=timeout_s)
        self._store = dist.PrefixStore(f"peer_copies/{generation}", store)
        self._groups: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="peer-copy-send")

    def _group(self, source: int, holder: int):
        with self._lock:
            group = self._groups.get((source, holder))
        if group is None:
            # A store client of its own (clone): a client's ops go one at a time, and the
            # other end's group may be made meanwhile through this process's other thread.
            store = dist.PrefixStore(f"{source}->{holder}", self._store.clone())
            group = dist.ProcessGroupGloo(store, 0 if self.rank == source else 1, 2, self.timeout)
            with self._lock:
                self._groups[(source, holder)] = group
        return group

    def send(self, holder: int, flat: np.ndarray) -> Future:
        tensor = torch.from_numpy(flat)
        return self._sender.submit(lambda: self._group(self.rank, holder).send([tensor], 1, 0).wait())

    def recv(self, source: int, flat: np.ndarray) -> None:
        self._group(source, self.rank).recv([torch.from_numpy(flat)], 0, 0).wait()

    def close(self) -> None:
        self._sender.shutdown(wait=False)


def default_store():
    """The store of this process's default group (None: no group)."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


class PeerCopies:
    """A worker's side: where its copy goes (``set_peer``), sending it (``send``), its own newest
    snapshots (the buffer each copy moves from, or its object in this node's store, kept until a
    newer step is agreed), and the copies it holds for others (``hold``, by (generation, source
    rank) and step), dropped as newer steps are agreed (``agreed``)."""

    def __init__(self):
        self.peer = None  # the peer's actor handle, None: no copies in this layout
        self.peer_rank = -1
        self.generation = -1
        self.sent_step = -1  # newest step of this rank's own state its peer holds whole
        self.sent_bytes = 0
        self.copy_s = 0.0  # seconds this rank's steps spent sending their copies (to the receipt)
        self._own: dict[int, Any] = {}  # step -> reference to this rank's snapshot (its copy's object)
        self._receipt: tuple[int, Any] | None = None  # (step, the peer's receipt) of the copy in flight
        self._wire: tuple[dict, dict] | None = None  # (pieces, to_wire(pieces)) of the last send: views
        self.channel: Channel | None = None  # the copies' bytes over gloo (None: through Ray's objects)
        self._sending: Future | None = None  # the channel's send of the copy in flight
        self._own_arrays = _Arrays()  # this rank's snapshot buffers (channel), lent as the held ones
        self._sizes: dict[int, int] = {}  # source rank -> bytes of its copies (channel), this generation
        self._held: dict[tuple[int, int], dict[int, Any]] = {}
        self._lent: dict[tuple[int, int, int], list] = {}  # (generation, source, step) -> its arrays
        self._arrays = _Arrays()
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.peer is not None

    def set_peer(self, peer, peer_rank: int, generation: int, rank: int = -1,
                 timeout_s: float = 60.0) -> None:
        """This rank's peer in ``generation`` (None: no copies); the next step sends one. With a
        process group (``rank`` in it) the copies' bytes go over gloo (``Channel``), else as
        objects through Ray (a process without a group)."""
        self.peer, self.peer_rank, self.generation, self.sent_step = peer, peer_rank, generation, -1
        self._receipt = self._wire = self._sending = None
        self._sizes = {}
        if self.channel is not None:
            self.channel.close()
        store = default_store() if peer is not None and rank >= 0 else None
        self.channel = Channel(store, rank, generation, timeout_s) if store is not None else None

    def send(self, rank: int, step: int, pieces: dict) -> None:
        """Copy ``pieces`` (this rank's owned blocks at ``step``) to the peer; ``wait`` for its
        receipt. The snapshot is kept until a newer step is agreed: a survivor ahead of the
        committed step goes back to it."""
        if self._wire is not None and self._wire[0] is pieces:
            wire = self._wire[1]  # the same views as the step before (the worker's _owned_pieces)
        else:
            wire = to_wire(pieces)
            # Its arrays are views of the pieces' memory only where no .contiguous() copied them.
            views = all(p.data.is_contiguous() and p.data.device.type == "cpu" for p in pieces.values())
            self._wire = (pieces, wire) if views else None
        if self.channel is not None:
            self._send_by_channel(rank, step, wire)
            return
        ref = ray.put(wire)  # the one memory copy on the step's path
        with self._lock:
            self._own[step] = (self.generation, rank, ref)
        self.sent_bytes = sum(a.nbytes for a in {id(w[4]): w[4] for w in wire.values()}.values())
        self._receipt = (step, self.peer.hold_copy.remote(self.generation, rank, step, ref))

    def _send_by_channel(self, rank: int, step: int, wire: dict) -> None:
        """The snapshot copied into a buffer of this rank's (the one memory copy on the step's
        path: the state goes on changing while the bytes move), sent to the peer over the
        channel; the peer's ``hold_copy`` receives it and is the receipt."""
        meta, arrays, total = flat_layout(wire)
        with self._lock:
            self._own_arrays.per_copy = {total: 1}
            flat = self._own_arrays.take(total)
        for start, array in arrays:
            np.copyto(flat[start:start + array.nbytes], array)
        with self._lock:
            self._own[step] = (self.generation, rank, (meta, flat))
        self.sent_bytes = total
        self._sending = self.channel.send(self.peer_rank, flat)
        self._receipt = (step, self.peer.hold_copy.remote(self.generation, rank, step, ("channel", meta)))

    def wait(self, timeout_s: float) -> None:
        """Return once the peer holds the copy sent last whole. Raises what its receipt raised
        (e.g. the peer died) as a plain error: this rank is healthy, and the Supervisor tells a
        member's failed step from a dead member by the exception's type."""
        if self._receipt is None:
            return
        step, ref = self._receipt
        try:
            ray.get(ref, timeout=timeout_s)
            if self._sending is not None:  # done with the receipt: the peer has every byte
                self._sending.result(timeout=timeout_s)
        except (ray.exceptions.RayError, RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"the copy of step {step} to peer rank {self.peer_rank} failed: "
                               f"{type(exc).__name__}") from None
        self._receipt, self._sending, self.sent_step = None, None, step

    def hold(self, generation: int, source: int, step: int, wire) -> int:
        """Keep a whole copy (the call's argument arrived whole; ``from_wire`` copies it into
        this process; ("channel", meta): received whole over the channel) beside the older
        ones, until ``agreed``. Returns the bytes held."""
        if isinstance(wire, tuple) and wire[0] == "channel":
            return self._hold_from_channel(generation, source, step, wire[1])
        arrays = {id(w[4]): w[4] for w in wire.values()}
        with self._lock:
            self._arrays.per_copy = dict(Counter(a.nbytes for a in arrays.values()))
            taken = {i: self._arrays.take(a.nbytes) for i, a in arrays.items()}
        pieces = from_wire(wire, take=lambda array: taken[id(array)])
        return self._keep(generation, source, step, pieces, list(taken.values()))

    def _hold_from_channel(self, generation: int, source: int, step: int, meta: dict) -> int:
        channel = self.channel
        if channel is None or self.generation != generation:
            raise RuntimeError(f"no channel of generation {generation} for rank {source}'s copy")
        total = max((m[4] + m[5] for m in meta.values()), default=0)
        with self._lock:
            self._sizes[source] = total  # a buffer idle for each source's copy at most
            self._arrays.per_copy = dict(Counter(self._sizes.values()))
            flat = self._arrays.take(total)
        channel.recv(source, flat)  # raises if the sender goes: nothing is held then
        return self._keep(generation, source, step, from_wire(wire_of(meta, flat), copy=False), [flat])

    def _keep(self, generation: int, source: int, step: int, pieces: dict, arrays: list) -> int:
        """Hold a whole copy, its arrays lent back to the pool once it is dropped; the bytes held."""
        with self._lock:
            self._held.setdefault((generation, source), {})[step] = pieces
            self._lent[(generation, source, step)] = arrays
            return self.held_bytes()

    def agreed(self, step: int, generation: int) -> None:
        """Step ``step`` of ``generation`` is agreed: every rank's copy of it is whole at its
        peer. Copies and snapshots of older steps, and of older generations, are not needed."""
        with self._lock:
            if any(key[0] < generation for key in self._held):
                self._arrays.clear()  # a new layout: other sizes
            for key in list(self._held):
                if key[0] < generation:
                    del self._held[key]
                    self._lent = {k: v for k, v in self._lent.items() if k[:2] != key}
                    continue
                for s in [s for s in self._held[key] if s < step]:
                    del self._held[key][s]
                    self._arrays.give(self._lent.pop((*key, s), []))
            for s in [s for s, (g, _, _) in self._own.items() if s < step or g < generation]:
                own = self._own.pop(s)[2]
                if isinstance(own, tuple):  # the channel's: its buffer, lent to the next snapshot
                    self._own_arrays.give([own[1]])

    def held(self) -> list[tuple[str, int, int, int]]:
        """("held", generation, source rank, step) of every copy held for another rank, and
        ("own", generation, rank, step) of this rank's own snapshots."""
        with self._lock:
            return sorted([("held", g, src, s) for (g, src), steps in self._held.items() for s in steps]
                          + [("own", g, r, s) for s, (g, r, _) in self._own.items()])

    def pieces(self, kind: str, generation: int, source: int, step: int) -> dict:
        with self._lock:
            if kind == "own":
                own = self._own[step][2]
            else:
                return self._held[(generation, source)][step]
        if isinstance(own, tuple):  # the channel's: (meta, buffer) in this process
            return from_wire(wire_of(*own), copy=False)
        return from_wire(ray.get(own), copy=False)

    def held_bytes(self) -> int:
        seen = {id(p): p for steps in self._held.values() for pieces in steps.values() for p in pieces.values()}
        return sum(p.data.numel() * p.data.element_size() for p in seen.values())
