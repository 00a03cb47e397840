"""A torch.distributed backend named "weft": `import weftcc.torch`, then
`torch.distributed.init_process_group("weft")` under torchrun (env://, tcp:// or file://).

The process group is a Python subclass of `torch.distributed.ProcessGroup` (PyTorch returns such
a group from a backend's creator as is; DDP runs on it). Each group owns one weftcc communicator,
made from a unique id that the group's rank 0 publishes in the store torch hands the creator,
and one worker thread that runs its operations in call order: a call with `async_op=False` runs
on the calling thread when nothing is queued, an asynchronous one on the worker. Point to point
follows NCCL: single sends and receives are collected until one of their `Work`s is waited on
(or asked for its future or completion) or the next collective is called on any weft group,
then run in order, each on its own; a `batch_isend_irecv` batch runs as one weftcc group. The
groups still open at the interpreter's exit are shut down. CUDA tensors (all_reduce, broadcast,
reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single with equal splits) are
enqueued on torch's current CUDA stream through the C ABI's device path, with
ProcessGroupNCCL's semantics (see `_CudaWork`); other calls on CUDA tensors raise a clear error.
docs/python.md lists every ProcessGroup method with its status.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import errors
from .communicator import Communicator, DataType, PreMulSum, ReduceOp, get_unique_id, group

BACKEND = "weft"
_UID_KEY = "weftcc/unique_id"

_TYPES = {
    torch.int8: DataType.INT8,
    torch.uint8: DataType.UINT8,
    torch.int32: DataType.INT32,
    torch.int64: DataType.INT64,
    torch.float16: DataType.FLOAT16,
    torch.bfloat16: DataType.BFLOAT16,
    torch.float32: DataType.FLOAT32,
    torch.float64: DataType.FLOAT64,
    # Moved as bytes; reduced only by MIN/MAX (and BAND/BOR, which are those on booleans).
    torch.bool: DataType.UINT8,
}
for _name, _code in (("uint32", DataType.UINT32), ("uint64", DataType.UINT64)):
    if hasattr(torch, _name):
        _TYPES[getattr(torch, _name)] = _code
# Complex numbers as their (real, imaginary) floats: moved, summed and averaged.
_COMPLEX = {torch.complex64: DataType.FLOAT32, torch.complex128: DataType.FLOAT64}
# Types weftcc has no kernels for, moved as their bytes (never reduced).
_BYTES = {
    t
    for t in (
        torch.int16,
        getattr(torch, "uint16", None),
        torch.complex32,
        *(getattr(torch, n) for n in dir(torch) if n.startswith("float8_")),
    )
    if isinstance(t, torch.dtype)
}

_T = dist.ReduceOp.RedOpType
_OPS = {
    _T.SUM: ReduceOp.SUM,
    _T.PRODUCT: ReduceOp.PROD,
    _T.MIN: ReduceOp.MIN,
    _T.MAX: ReduceOp.MAX,
    _T.AVG: ReduceOp.AVG,
}
# Bitwise reductions weftcc has no kernels for (run as a gather and a local fold).
_BITWISE = {_T.BAND: torch.bitwise_and, _T.BOR: torch.bitwise_or, _T.BXOR: torch.bitwise_xor}
# On booleans, MIN/MAX are logical and/or.
_BOOL_OPS = {_T.MIN: ReduceOp.MIN, _T.BAND: ReduceOp.MIN, _T.MAX: ReduceOp.MAX, _T.BOR: ReduceOp.MAX}


def _unsupported(call: str, why: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"weft backend: {call}: {why}")


# The calls that take CUDA tensors (the others raise naming them).
_CUDA_CALLS = (
    "all_reduce, broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor, "
    "all_to_all_single (equal splits)"
)


def _dtype(call: str, t: torch.Tensor, cuda: bool = False) -> int:
    if t.device.type == "cuda" and not cuda:
        raise _unsupported(call, f"a CUDA tensor: on CUDA tensors the weft backend runs {_CUDA_CALLS}")
    if t.device.type not in ("cpu", "cuda"):
        raise _unsupported(
            call, f"a {t.device.type} tensor: the weft torch backend runs on CPU and CUDA tensors"
        )
    if t.is_sparse:
        raise _unsupported(call, "sparse tensors are not supported")
    if t.is_conj():
        raise _unsupported(call, "a conjugate view (call resolve_conj() first)")
    code = _TYPES.get(t.dtype, _COMPLEX.get(t.dtype))
    if code is None and t.dtype in _BYTES:
        code = DataType.UINT8
    if code is None:
        raise _unsupported(call, f"dtype {t.dtype} is not a weftcc type")
    return int(code)


def _on_cuda(call: str, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the call's tensors are CUDA tensors (all of them, on one device) rather than CPU
    ones; a mix raises."""
    kinds = {t.device.type for t in tensors}
    if kinds != {"cuda"}:
        return False
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise _unsupported(call, f"tensors on {sorted(map(str, devices))}: one device per call")
    return True


def _n(t: torch.Tensor) -> int:
    """`t`'s elements as weftcc counts them (complex: 2 floats; byte-moved types: bytes)."""
    if t.dtype in _COMPLEX:
        return 2 * t.numel()
    if t.dtype in _BYTES:
        return t.numel() * t.element_size()
    return t.numel()


def _premul_factor(op) -> Optional[float]:
    """PREMUL_SUM's factor (a number or a one-element tensor), None where torch hides it."""
    factor = getattr(op, "factor", None)
    if factor is None and hasattr(op, "__getstate__"):
        state = op.__getstate__()
        factor = state[1] if isinstance(state, tuple) and len(state) > 1 else None
    if isinstance(factor, torch.Tensor):
        factor = factor.item()
    return None if factor is None else float(factor)


def _op(call: str, op, t: torch.Tensor):
    kind = getattr(op, "op", op)  # a ReduceOp holds its RedOpType
    name = getattr(kind, "name", kind)
    if t.dtype in _BYTES:
        raise _unsupported(call, f"reduction {name} on {t.dtype} (weftcc moves this type, never reduces it)")
    if t.dtype in _COMPLEX and kind not in (_T.SUM, _T.AVG, _T.PREMUL_SUM):
        raise _unsupported(call, f"reduction {name} on {t.dtype} (complex: SUM, AVG, PREMUL_SUM)")
    if kind == _T.PREMUL_SUM and (t.dtype.is_floating_point or t.dtype in _COMPLEX):
        factor = _premul_factor(op)
        if factor is not None:
            return PreMulSum(factor)
    table = _BOOL_OPS if t.dtype == torch.bool else _OPS
    ours = table.get(kind)
    if ours is None:
        have = "MIN, MAX, BAND, BOR on bool" if t.dtype == torch.bool else "SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM"
        raise _unsupported(call, f"reduction {name} on {t.dtype} (weftcc has {have})")
    return ours


def _seconds(timeout) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return s if s > 0 else None


class _Dense:
    """A contiguous stand-in for a tensor an operation writes: the tensor itself, or a copy
    written back with `done()`."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.buf = t if t.is_contiguous() else t.contiguous()

    @property
    def ptr(self) -> int:
        return self.buf.data_ptr()

    def done(self) -> None:
        if self.buf is not self.tensor:
            self.tensor.copy_(self.buf)


def _run_group(comm: Communicator, posts) -> None:
    """Runs `(send, tensor, peer, dtype)` posts as one weftcc group: sends from contiguous
    copies kept alive until the group ran, receives through `_Dense` written back after."""
    keep, written = [], []
    with group():
        for send, t, peer, dtype in posts:
            if send:
                src = t.contiguous()
                keep.append(src)
                comm.raw_send(src.data_ptr(), _n(src), dtype, peer)
            else:
                d = _Dense(t)
                written.append(d)
                comm.raw_recv(d.ptr, _n(d.buf), dtype, peer)
    for d in written:
        d.done()


class WeftWork(dist.Work):
    """One operation of a weft process group; `wait()` raises the operation's weftcc error.

    An operation run on the calling thread is complete when its Work is made; the completion
    event and the torch Future are created only when someone needs them (a few µs each)."""

    def __init__(self, pg: "ProcessGroupWeft", call: str, outputs: List[torch.Tensor]):
        super().__init__()
        self._pg = pg
        self._call = call
        self._outputs = outputs
        self._lock = threading.Lock()
        self._finished = False
        self._event: Optional[threading.Event] = None  # set by the executor when queued
        self._exc: Optional[BaseException] = None
        self._future = None  # what get_future() hands out
        self._source = None  # the future this work settles (`_future` follows it)
        self._p2p = False

    def _finish(self, exc: Optional[BaseException]) -> None:
        with self._lock:
            self._exc = exc
            self._finished = True
            source = self._source
        if self._event is not None:
            self._event.set()
        if source is not None:
            _settle(source, self._outputs, exc)

    def _progress(self) -> None:
        if self._p2p and not self._finished:
            self._pg._flush_p2p()

    def wait(self, timeout=None) -> bool:
        self._progress()
        if not self._finished:
            seconds = _seconds(timeout)
            if self._event is None or not self._event.wait(seconds):
                raise errors.Timeout(
                    f"weft backend: {self._call} did not complete within {seconds} s"
                )
        if self._exc is not None:
            raise self._exc
        return True

    def get_future(self):
        self._progress()
        with self._lock:
            if self._future is None:
                self._source = self._new_future()
                self._future = self._source.then(_unwrap)
                if self._finished:
                    _settle(self._source, self._outputs, self._exc)
            return self._future

    def _new_future(self):
        return torch.futures.Future()

    def is_completed(self) -> bool:
        self._progress()
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._exc is None

    def exception(self):
        return self._exc

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        pass


class _CudaWork(WeftWork):
    """An operation on CUDA tensors, with ProcessGroupNCCL's ordering semantics: enqueued on the
    caller's current stream itself (ProcessGroupNCCL uses an internal stream that waits for it,
    so there later compute may overlap the collective; here it follows it), in call order with the
    group's other operations (on the calling thread when nothing is queued, else by the
    group's worker, on the same stream). `wait()` and `synchronize()` make the caller's current
    stream wait for the operation (the host waits only until it is enqueued); `is_completed()`
    asks the GPU; the future is CUDA-aware (its value is ready on the stream that uses it). The
    tensors are kept (and `record_stream`ed) until the operation completed."""

    def __init__(self, pg: "ProcessGroupWeft", call: str, outputs, keep, stream):
        super().__init__(pg, call, outputs)
        self._keep = list(keep)
        self._stream = stream
        self._end = None  # a torch.cuda.Event recorded after the operation was enqueued

    def _finish(self, exc: Optional[BaseException]) -> None:
        # The future's value is marked ready on the operation's stream.
        with torch.cuda.stream(self._stream):
            super()._finish(exc)

    def _new_future(self):
        return torch.futures.Future(devices=[self._stream.device])

    def get_future(self):
        with torch.cuda.stream(self._stream):
            return super().get_future()

    def wait(self, timeout=None) -> bool:
        super().wait(timeout)  # enqueued (or its error raised)
        if self._end is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._end)
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if not self._finished:
            return False
        done = self._exc is not None or self._end is None or self._end.query()
        if done:
            self._keep = []
        return done

    def is_success(self) -> bool:
        return self.is_completed() and self._exc is None


class _Failed:
    """A failed operation's exception, carried to `_unwrap`."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def _settle(source, outputs, exc) -> None:
    source.set_result(outputs if exc is None else _Failed(exc))


def _unwrap(source):
    """The value of a work's future: its outputs, or its exception raised. Raised here, in a
    callback, the future completes with an error that torch's C++ side sees as one (DDP's
    reducer); `Future.set_exception` would complete it with the exception as its value."""
    value = source.value()
    if isinstance(value, _Failed):
        raise value.exc
    return value


class _Executor:
    """Runs a group's jobs in submission order: on the calling thread when nothing is queued
    and the caller will wait anyway, else on one worker thread."""

    def __init__(self, name: str):
        self._cond = threading.Condition()
        self._jobs: deque = deque()
        self._inflight = 0  # queued or running
        # Reentrant: a job submitted from the worker itself (a future's callback issuing an
        # operation) runs there and then.
        self._run_lock = threading.RLock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], works: Sequence[WeftWork], inline: bool) -> None:
        with self._cond:
            if self._closed:
                raise errors.InvalidUsage("weft backend: the process group was shut down")
            self._inflight += 1
            on_worker = threading.current_thread() is self._thread
            if not (on_worker or (inline and self._inflight == 1)):
                for w in works:
                    if w._event is None:
                        w._event = threading.Event()
                self._jobs.append((job, works))
                self._cond.notify()
                return
        try:
            self._run(job, works)
        finally:
            with self._cond:
                self._inflight -= 1

    def _run(self, job: Callable[[], None], works: Sequence[WeftWork]) -> None:
        with self._run_lock:
            try:
                job()
            except BaseException as e:  # delivered by wait(), on every work of the job
                for w in works:
                    w._finish(e)
                return
        for w in works:
            w._finish(None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, works = self._jobs.popleft()
            try:
                self._run(job, works)
            except BaseException:  # a completion callback's failure must not stop the worker
                pass
            finally:
                with self._cond:
                    self._inflight -= 1

    def close(self) -> None:
        """Runs what is queued, then stops the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()


class ProcessGroupWeft(dist.ProcessGroup):
    """A torch.distributed process group on one weftcc communicator (see the module's doc).

    Argument checks run on the calling thread (a bad call raises there, before anything is
    sent); the operation itself, contiguous copies included, runs as a job in call order, so an
    asynchronous operation sees what the operations before it wrote."""

    def __init__(self, comm: Communicator, rank: int, size: int, store=None, salt: str = ""):
        super().__init__(rank, size)
        self._comm = comm
        self._store = store  # torch's store for this group (monitored_barrier, splits)
        # Names this communicator in the store's keys, so a group made again on the same store
        # (after destroy_process_group) never meets this one's keys.
        self._salt = salt
        self._splits = 0
        self._monitored = 0
        self._exec = _Executor(f"weft-pg-r{rank}")
        self._p2p_lock = threading.Lock()
        self._p2p: list = []
        self._closed = False
        self._group_name = ""
        self._group_desc = ""
        self._batch: Optional[list] = None  # a coalesced batch's sends and receives
        self._batch_works: Optional[List[WeftWork]] = None  # and its other operations
        _LIVE.add(self)

    # --- creation and life ---------------------------------------------------------------

    @classmethod
    def create(cls, store, rank: int, size: int, timeout: timedelta) -> "ProcessGroupWeft":
        """The creator torch calls: rank 0 starts the bootstrap and publishes its unique id in
        the group's store; every rank then joins. A set WEFT_TIMEOUT wins over torch's timeout
        (which torch always passes: 30 minutes unless given)."""
        if rank == 0:
            uid = get_unique_id()
            store.set(_UID_KEY, uid)
        else:
            uid = store.get(_UID_KEY).decode()
        seconds = None if os.environ.get("WEFT_TIMEOUT") else _seconds(timeout)
        comm = Communicator.from_unique_id(uid, rank, size, timeout=seconds)
        if rank == 0:
            # Every rank has joined (creation returns only then): a later group on the same
            # store prefix (after destroy_process_group) must not find this id.
            try:
                store.delete_key(_UID_KEY)
            except Exception:
                pass
        return cls(comm, rank, size, store, salt=uid)

    def getBackendName(self) -> str:
        return BACKEND

    # torch keeps a group's name and description in its C++ backends, of which a Python group
    # has none: they live here (DeviceMesh and the functional collectives find groups by name).
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def name(self) -> str:
        return BACKEND

    def _get_backend(self, device=None) -> "ProcessGroupWeft":
        # The group is its own backend for every device (torch asks, e.g. in
        # batch_isend_irecv, whether the device's backend coalesces: it does not; sends and
        # receives are collected until waited on instead).
        return self

    # torch's coalescing manager (`batch_isend_irecv`; coalesced collectives) brackets a batch
    # with `_start_coalescing` / `_end_coalescing`: the batch's sends and receives run as one
    # weftcc group, as NCCL runs them as one group.
    supports_coalescing = True

    def _start_coalescing(self, device=None) -> None:
        if self._batch is not None:
            self._abandon_batch(errors.InvalidUsage("weft backend: a coalesced batch was never ended"))
        _flush_all_p2p()  # sends and receives posted before the batch go first
        self._batch, self._batch_works = [], []

    def _end_coalescing(self, device=None) -> WeftWork:
        """Queues the batch's sends and receives as one group; the Work returned completes
        after everything the batch started and raises the first error among them."""
        if self._batch is None:
            raise errors.InvalidUsage("weft backend: coalescing ended without a start")
        ops, started = self._batch, self._batch_works + [op[4] for op in self._batch]
        self._batch = self._batch_works = None
        if ops:
            self._submit_group(ops)

        def job() -> None:
            for w in started:
                if w._exc is not None:
                    raise w._exc

        return self._submit("coalesced operations", None, [], job)

    supports_splitting = True

    @property
    def _device_types(self) -> List[torch.device]:
        # torch asks a group which devices its backends serve (split_group, monitored_barrier).
        return [torch.device("cpu")]

    def get_group_store(self):
        return self._store

    def comm_split_count(self) -> int:
        return self._splits

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """`torch.distributed.split_group`'s step on this group: every rank of it calls, each
        with the list of its new group's ranks (of this group), or a list it is not in to
        stay out (then None). One weftcc split: no new bootstrap."""
        self._splits += 1
        members = [int(r) for r in ranks]
        me = self.rank()
        mine = me in members
        color = min(members) if mine and members else None
        made: list = []
        # In call order with this group's other operations (a queued one must not meet the
        # split on another rank).
        work = self._submit(
            "split_group", None, [], lambda: made.append(self._comm.split(color, members.index(me) if mine else 0))
        )
        work.wait()
        comm = made[0]
        if comm is None:
            return None
        store = None
        if self._store is not None:
            store = dist.PrefixStore(f"weft-split/{group_name}/", self._store)
        pg = ProcessGroupWeft(comm, comm.rank, comm.size, store, salt=f"{self._salt}/split{self._splits}")
        pg._set_group_name(group_name or "")
        pg._set_group_desc(group_desc or "")
        return pg

    def eager_connect_single_device(self, device=None) -> None:
        """Connections are made when the communicator is (torch asks with a bound device)."""

    def perform_nocolor_split(self, device=None) -> None:
        """A non-member's part in `new_group` with a bound device: nothing (members make their
        group from its store, not by a split)."""

    @property
    def comm(self) -> Communicator:
        """The group's weftcc communicator."""
        return self._comm

    def abort(self) -> None:
        self._comm.abort()

    def shutdown(self) -> None:
        """Ends the group: sends and receives never waited on fail (they are not run: their
        peers may never post theirs), queued operations finish, the communicator closes."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        with self._p2p_lock:
            ops, self._p2p = self._p2p + (self._batch or []), []
            self._batch = self._batch_works = None
            _WITH_P2P.discard(self)
        for op in ops:
            op[4]._finish(
                errors.InvalidUsage(
                    f"weft backend: {op[4]._call} to/from rank {op[2]} was never waited on "
                    "before the process group was shut down"
                )
            )
        self._exec.close()
        self._comm.close()

    # --- plumbing --------------------------------------------------------------------------

    def _submit(self, call: str, opts, outputs, job: Callable[[], None]) -> WeftWork:
        # Sends and receives posted before this call, on any weft group, go first: a peer may
        # be waiting for them before it reaches this collective.
        _flush_all_p2p()
        work = WeftWork(self, call, outputs)
        inline = not getattr(opts, "asyncOp", True)
        self._exec.submit(job, [work], inline)
        if self._batch_works is not None:
            self._batch_works.append(work)
        return work

    def _submit_cuda(
        self, call: str, opts, outputs, keep, enqueue: Callable[[int], None]
    ) -> WeftWork:
        """Queues `enqueue(stream)` (the C ABI's calls with the caller's current CUDA stream,
        as an integer `cudaStream_t`) like any operation of the group, then records the
        operation's end on that stream (`_CudaWork`)."""
        _flush_all_p2p()
        stream = torch.cuda.current_stream(keep[0].device)
        for t in keep:
            t.record_stream(stream)  # the caching allocator keeps them until the stream passed
        work = _CudaWork(self, call, outputs, keep, stream)

        def job() -> None:
            with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                enqueue(stream.cuda_stream)
                end = torch.cuda.Event()
                end.record(stream)
                work._end = end

        # Inline when nothing is queued: enqueued before the call returns, as NCCL does.
        self._exec.submit(job, [work], True)
        if self._batch_works is not None:
            self._batch_works.append(work)
        return work

    def _cuda_in_place(self, call: str, opts, t: torch.Tensor, run) -> WeftWork:
        """`run(address, count, stream)` on CUDA tensor `t` (through a contiguous copy made and
        written back on the stream if need be)."""

        def enqueue(stream: int) -> None:
            d = _Dense(t)
            run(d.ptr, _n(d.buf), stream)
            d.done()

        return self._submit_cuda(call, opts, [t], [t], enqueue)

    def _cuda_into(self, call: str, opts, out: torch.Tensor, inp: torch.Tensor, run) -> WeftWork:
        """`run(input address, output address, output count, stream)` from CUDA tensor `inp`
        into `out` (contiguous copies made, and written back, on the stream)."""

        def enqueue(stream: int) -> None:
            src = inp.contiguous()
            d = _Dense(out)
            run(src.data_ptr(), d.ptr, _n(src), _n(d.buf), stream)
            d.done()

        return self._submit_cuda(call, opts, [out], [out, inp], enqueue)

    def _p2p_op(self, call: str, tensors, peer: int, tag: int, send: bool) -> WeftWork:
        try:
            return self._post(call, tensors, peer, tag, send)
        except BaseException as e:
            # torch's coalescing manager never ends a batch whose op raised: end it here.
            self._abandon_batch(e)
            raise

    def _abandon_batch(self, exc: BaseException) -> None:
        """Fails an open coalesced batch's sends and receives (never run) and closes it."""
        with self._p2p_lock:
            ops, self._batch, self._batch_works = self._batch or [], None, None
        for op in ops:
            op[4]._finish(exc)

    def _post(self, call: str, tensors, peer: int, tag: int, send: bool) -> WeftWork:
        if len(tensors) != 1:
            raise _unsupported(call, f"{len(tensors)} tensors (one per call is supported)")
        if tag != 0:
            raise _unsupported(
                call, f"tag {tag}: weftcc matches a pair's messages in order, without tags"
            )
        t = tensors[0]
        dtype = _dtype(call, t)
        work = WeftWork(self, call, [t])
        work._p2p = True
        work._event = threading.Event()
        with self._p2p_lock:
            if self._closed:
                raise errors.InvalidUsage("weft backend: the process group was shut down")
            if self._batch is None:
                self._p2p.append((send, t, int(peer), dtype, work))
                _WITH_P2P.add(self)
            else:
                self._batch.append((send, t, int(peer), dtype, work))
        return work

    def _flush_p2p(self) -> None:
        """Runs the collected sends and receives, queued behind the operations before them,
        each as a weftcc group of its own, in the order they were posted: torch, as NCCL,
        matches single messages in order whatever was posted with them (a pipeline stage sends
        four micro-batches that its peer receives one by one), while weftcc matches a group's
        messages with the peer's group as a whole. Exchanges that must progress together are
        posted together: `batch_isend_irecv` runs its batch as one group (`_end_coalescing`)."""
        with self._p2p_lock:
            ops, self._p2p = self._p2p, []
            _WITH_P2P.discard(self)
        for op in ops:
            self._submit_group([op])

    def _submit_group(self, ops) -> None:
        """Queues `ops` (send, tensor, peer, dtype, work) as one weftcc group."""
        comm = self._comm

        def job() -> None:
            _run_group(comm, [(send, t, peer, dtype) for send, t, peer, dtype, _ in ops])

        works = [op[4] for op in ops]
        try:
            self._exec.submit(job, works, inline=False)
        except errors.WeftError as e:  # shut down meanwhile
            for w in works:
                w._finish(e)

    def _one(self, call: str, tensors) -> torch.Tensor:
        if len(tensors) != 1:
            raise _unsupported(call, f"{len(tensors)} tensors per process (one is supported)")
        return tensors[0]

    def _in_place(self, t: torch.Tensor, run: Callable[[int, int], None]) -> Callable[[], None]:
        """A job running `run(address, count)` on `t` (through a contiguous copy if need be,
        made when the job runs)."""

        def job() -> None:
            d = _Dense(t)
            run(d.ptr, _n(d.buf))
            d.done()

        return job

    # --- collectives -----------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        call = "all_reduce"
        t = self._one(call, tensors)
        red = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if _on_cuda(call, [t]):
            dtype, op, comm = _dtype(call, t, cuda=True), _op(call, red, t), self._comm
            return self._cuda_in_place(
                call, opts, t, lambda p, n, s: comm.raw_all_reduce(p, p, n, dtype, op, cuda_stream=s)
            )
        dtype = _dtype(call, t)
        kind = getattr(red, "op", red)
        if kind in _BITWISE and not t.is_floating_point() and not (t.dtype == torch.bool and kind in _BOOL_OPS):
            return self._submit(call, opts, [t], self._bitwise_all_reduce(call, t, kind))
        op = _op(call, red, t)
        comm = self._comm
        job = self._in_place(t, lambda p, n: comm.raw_all_reduce(p, p, n, dtype, op))
        return self._submit(call, opts, [t], job)

    def _bitwise_all_reduce(self, call: str, t: torch.Tensor, kind) -> Callable[[], None]:
        """BAND, BOR, BXOR on integers (and BXOR on bool), which weftcc has no kernels for:
        every rank's tensor gathered, then folded in rank order (n times the memory)."""
        if t.dtype in _BYTES or t.dtype in _COMPLEX:
            raise _unsupported(call, f"reduction {kind.name} on {t.dtype}")
        flat = torch.empty(self.size() * t.numel(), dtype=t.dtype)
        gather = self._gather_into(call, flat, t)  # its contiguous copy made when the job runs
        fold = _BITWISE[kind]

        def job() -> None:
            gather()
            parts = flat.split(t.numel()) if t.numel() else [flat] * self.size()
            out = parts[0].clone()
            for part in parts[1:]:
                out = fold(out, part)
            t.copy_(out.view_as(t))

        return job

    def allreduce_coalesced(self, tensors, opts=None):
        call = "all_reduce_coalesced"
        red = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        comm = self._comm
        jobs = []
        for t in tensors:
            dtype, op = _dtype(call, t), _op(call, red, t)
            jobs.append(
                self._in_place(t, lambda p, n, dt=dtype, o=op: comm.raw_all_reduce(p, p, n, dt, o))
            )
        return self._submit(call, opts, list(tensors), lambda: [j() for j in jobs])

    def broadcast(self, tensors, opts):
        call = "broadcast"
        t = self._one(call, tensors)
        root = opts.rootRank
        comm = self._comm
        if _on_cuda(call, [t]):
            dtype = _dtype(call, t, cuda=True)
            return self._cuda_in_place(
                call, opts, t, lambda p, n, s: comm.raw_broadcast(p, p, n, dtype, root, cuda_stream=s)
            )
        dtype = _dtype(call, t)
        job = self._in_place(t, lambda p, n: comm.raw_broadcast(p, p, n, dtype, root))
        return self._submit(call, opts, [t], job)

    def reduce(self, tensors, opts):
        call = "reduce"
        t = self._one(call, tensors)
        op = _op(call, opts.reduceOp, t)
        root = opts.rootRank
        comm = self._comm
        if _on_cuda(call, [t]):
            dtype = _dtype(call, t, cuda=True)
            return self._cuda_in_place(
                call, opts, t, lambda p, n, s: comm.raw_reduce(p, p, n, dtype, op, root, cuda_stream=s)
            )
        dtype = _dtype(call, t)
        job = self._in_place(t, lambda p, n: comm.raw_reduce(p, p, n, dtype, op, root))
        return self._submit(call, opts, [t], job)

    def _gather_into(self, call: str, out: torch.Tensor, inp: torch.Tensor) -> Callable[[], None]:
        dtype = _dtype(call, inp)
        if out.dtype != inp.dtype or out.numel() != inp.numel() * self.size():
            raise _unsupported(
                call,
                f"output of {out.numel()} {out.dtype} is not {self.size()} x the input's "
                f"{inp.numel()} {inp.dtype}",
            )
        comm = self._comm

        def job() -> None:
            src = inp.contiguous()
            d = _Dense(out)
            comm.raw_all_gather(src.data_ptr(), d.ptr, _n(src), dtype)
            d.done()

        return job

    def _allgather_base(self, output, input, opts=None):
        call = "all_gather_into_tensor"
        if _on_cuda(call, [output, input]):
            dtype = _dtype(call, input, cuda=True)
            if output.dtype != input.dtype or output.numel() != input.numel() * self.size():
                raise _unsupported(call, f"output of {output.numel()} is not {self.size()} x {input.numel()}")
            comm = self._comm
            return self._cuda_into(
                call, opts, output, input,
                lambda i, o, n, _m, s: comm.raw_all_gather(i, o, n, dtype, cuda_stream=s),
            )
        return self._submit(call, opts, [output], self._gather_into(call, output, input))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        call = "all_gather_into_tensor_coalesced"
        jobs = [self._gather_into(call, o, i) for o, i in zip(outputs, inputs)]
        return self._submit(call, opts, list(outputs), lambda: [j() for j in jobs])

    def allgather(self, output_lists, input_list, opts=None):
        call = "all_gather"
        inp = self._one(call, input_list)
        outs = self._one(call, output_lists)
        if len(outs) != self.size():
            raise _unsupported(call, f"{len(outs)} output tensors for {self.size()} ranks")
        for o in outs:
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise _unsupported(call, "output tensors differ from the input in size or dtype")
        flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
        gather = self._gather_into(call, flat, inp)

        def job() -> None:
            gather()
            for o, part in zip(outs, flat.split(inp.numel())):
                o.copy_(part.view_as(o))

        return self._submit(call, opts, list(outs), job)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        raise _unsupported("all_gather_coalesced", "not supported (use all_gather per tensor)")

    def _scatter_into(
        self, call: str, out: torch.Tensor, inp: Callable[[], torch.Tensor], numel: int, dtype_of: torch.Tensor, op
    ) -> Callable[[], None]:
        """A reduce-scatter job of `inp()` (made when the job runs: `numel` elements, of
        `dtype_of`'s dtype) into `out`."""
        dtype = _dtype(call, dtype_of)
        if out.dtype != dtype_of.dtype or out.numel() * self.size() != numel:
            raise _unsupported(
                call,
                f"input of {numel} {dtype_of.dtype} is not {self.size()} x the output's "
                f"{out.numel()} {out.dtype}",
            )
        o = _op(call, op, dtype_of)
        comm = self._comm

        def job() -> None:
            src = inp().contiguous()
            d = _Dense(out)
            comm.raw_reduce_scatter(src.data_ptr(), d.ptr, _n(d.buf), dtype, o)
            d.done()

        return job

    def _reduce_scatter_base(self, output, input, opts=None):
        call = "reduce_scatter_tensor"
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if _on_cuda(call, [output, input]):
            dtype, o = _dtype(call, input, cuda=True), _op(call, op, input)
            if output.dtype != input.dtype or output.numel() * self.size() != input.numel():
                raise _unsupported(call, f"input of {input.numel()} is not {self.size()} x {output.numel()}")
            comm = self._comm
            return self._cuda_into(
                call, opts, output, input,
                lambda i, out, _n, m, s: comm.raw_reduce_scatter(i, out, m, dtype, o, cuda_stream=s),
            )
        job = self._scatter_into(call, output, lambda: input, input.numel(), input, op)
        return self._submit(call, opts, [output], job)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        call = "reduce_scatter_tensor_coalesced"
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        jobs = [
            self._scatter_into(call, o, lambda i=i: i, i.numel(), i, op) for o, i in zip(outputs, inputs)
        ]
        return self._submit(call, opts, list(outputs), lambda: [j() for j in jobs])

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        call = "reduce_scatter"
        out = self._one(call, output_tensors)
        ins = list(self._one(call, input_lists))
        if len(ins) != self.size():
            raise _unsupported(call, f"{len(ins)} input tensors for {self.size()} ranks")
        for i in ins:
            if i.numel() != out.numel() or i.dtype != out.dtype:
                raise _unsupported(call, "input tensors differ from the output in size or dtype")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        job = self._scatter_into(
            call, out, lambda: torch.cat([i.reshape(-1) for i in ins]), out.numel() * self.size(), out, op
        )
        return self._submit(call, opts, [out], job)

    def _exchange(
        self,
        call: str,
        sends: Dict[int, torch.Tensor],
        recvs: Dict[int, torch.Tensor],
        own: Optional[Tuple[torch.Tensor, torch.Tensor]],
        dtype: int,
    ) -> Callable[[], None]:
        """One group of sends and receives, every message posted by role (zero-size ones
        too, so the peers' sizes are compared), plus this rank's own block copied (`own`:
        source, destination; checked here to match)."""
        if own is not None and own[0].numel() != own[1].numel():
            raise _unsupported(
                call, f"this rank's own block: {own[0].numel()} elements into {own[1].numel()}"
            )
        comm = self._comm
        posts = []
        for peer in range(self.size()):
            if peer in sends:
                posts.append((True, sends[peer], peer, dtype))
            if peer in recvs:
                posts.append((False, recvs[peer], peer, dtype))

        def job() -> None:
            _run_group(comm, posts)
            if own is not None:
                own[1].copy_(own[0].reshape(own[1].shape))

        return job

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        call = "all_to_all_single"
        n, me = self.size(), self.rank()
        if output.dtype != input.dtype:
            raise _unsupported(call, f"output {output.dtype}, input {input.dtype}")
        if _on_cuda(call, [output, input]) and not output_split_sizes and not input_split_sizes:
            dtype = _dtype(call, input, cuda=True)
            if input.numel() % n or output.numel() != input.numel():
                raise _unsupported(call, f"{input.numel()} input / {output.numel()} output elements for {n} ranks")
            comm = self._comm
            return self._cuda_into(
                call, opts, output, input,
                lambda i, o, c, _m, s: comm.raw_all_to_all(i, o, c // n, dtype, cuda_stream=s),
            )
        dtype = _dtype(call, input)
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % n or output.numel() != input.numel():
                raise _unsupported(
                    call, f"{input.numel()} input / {output.numel()} output elements for {n} ranks"
                )
            comm = self._comm

            def job() -> None:
                src = input.contiguous()
                d = _Dense(output)
                comm.raw_all_to_all(src.data_ptr(), d.ptr, _n(src) // n, dtype)
                d.done()

            return self._submit(call, opts, [output], job)

        def blocks(t: torch.Tensor, splits) -> List[torch.Tensor]:
            rows = t.shape[0] if t.dim() else 1
            splits = list(splits) if splits else [rows // n] * n
            if len(splits) != n or sum(splits) != rows:
                raise _unsupported(call, f"split sizes {splits} for {rows} rows and {n} ranks")
            return list(t.split(splits)) if t.dim() else [t]

        outs = blocks(output, output_split_sizes)
        ins = blocks(input, input_split_sizes)
        others = [q for q in range(n) if q != me]
        job = self._exchange(
            call, {q: ins[q] for q in others}, {q: outs[q] for q in others}, (ins[me], outs[me]), dtype
        )
        return self._submit(call, opts, [output], job)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        call = "all_to_all"
        n, me = self.size(), self.rank()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise _unsupported(call, f"lists of {len(output_tensors)}/{len(input_tensors)} for {n} ranks")
        dtype = _dtype(call, input_tensors[0])
        for t in list(output_tensors) + list(input_tensors):
            if _dtype(call, t) != dtype:
                raise _unsupported(call, "tensors of different dtypes")
        others = [q for q in range(n) if q != me]
        job = self._exchange(
            call,
            {q: input_tensors[q] for q in others},
            {q: output_tensors[q] for q in others},
            (input_tensors[me], output_tensors[me]),
            dtype,
        )
        return self._submit(call, opts, list(output_tensors), job)

    def _rooted(self, call, opts, lists, tensors, root_sends):
        """A gather (`root_sends` False: `lists` holds the outputs, `tensors` the input) or a
        scatter (`lists` the inputs, `tensors` the output): the root moves `lists[0][q]` from or
        to every other rank q and its own block between its tensor and `lists[0][root]`; every
        other rank moves its tensor to or from the root."""
        mine = self._one(call, tensors)
        dtype = _dtype(call, mine)
        per_rank = list(lists[0]) if lists else []
        root, me, n = opts.rootRank, self.rank(), self.size()
        if me == root:
            if len(per_rank) != n:
                side = "input" if root_sends else "output"
                raise _unsupported(call, f"{len(per_rank)} {side} tensors on the root for {n} ranks")
            peers = {q: per_rank[q] for q in range(n) if q != me}
            own = (per_rank[me], mine) if root_sends else (mine, per_rank[me])
        else:
            peers, own = {root: mine}, None
        sending = (me == root) == root_sends
        job = self._exchange(call, peers if sending else {}, {} if sending else peers, own, dtype)
        return self._submit(call, opts, [mine] if root_sends else per_rank, job)

    def gather(self, output_lists, input_list, opts):
        return self._rooted("gather", opts, output_lists, input_list, root_sends=False)

    def gather_single(self, output, input, opts):
        call = "gather"
        root, me, n = opts.rootRank, self.rank(), self.size()
        outs = []
        if me == root:
            if not output.is_contiguous():
                raise _unsupported(call, "a non-contiguous output tensor")
            if output.numel() != n * input.numel() or output.dtype != input.dtype:
                raise _unsupported(call, f"output of {output.numel()} for {n} x {input.numel()}")
            outs = list(output.view(-1).split(input.numel())) if input.numel() else [output.view(-1)] * n
        return self.gather([outs], [input], opts)

    def scatter(self, output_tensors, input_lists, opts):
        return self._rooted("scatter", opts, input_lists, output_tensors, root_sends=True)

    # torch's newer names for the single-tensor forms.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def set_timeout(self, timeout) -> None:
        raise _unsupported(
            "set_timeout",
            "a weftcc communicator's timeout is fixed when it is made (pass timeout= to "
            "init_process_group or new_group, or set WEFT_TIMEOUT, which wins)",
        )

    def barrier(self, opts=None):
        return self._submit("barrier", opts, [], self._comm.barrier)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's monitored barrier through the group's store: after the operations before
        it, every rank checks in; rank 0 waits for them within `timeout` and raises naming the
        first rank (or, with `wait_all_ranks`, every rank) that did not arrive; then releases
        the others, who wait for that within `timeout` too."""
        if self._store is None:
            raise _unsupported("monitored_barrier", "this group has no store")
        self._monitored += 1
        store, me, n = self._store, self.rank(), self.size()
        prefix = f"weft-monitored/{self._salt}/{self._monitored}/"
        seconds = _seconds(timeout) or 1800.0

        def until(done: Callable[[], bool], deadline: float) -> bool:
            """Polls the store until `done()` or the deadline; whether it was done."""
            while not done():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
            return True

        def job() -> None:
            store.set(f"{prefix}{me}", b"1")
            deadline = time.monotonic() + seconds
            if me == 0:
                missing = list(range(1, n))

                def all_arrived() -> bool:
                    missing[:] = [r for r in missing if not store.check([f"{prefix}{r}"])]
                    return not missing

                if not until(all_arrived, deadline):
                    who = missing if wait_all_ranks else missing[:1]
                    raise errors.Timeout(
                        f"weft backend: monitored_barrier: rank(s) {who} did not arrive within {seconds} s"
                    )
                for r in range(n):
                    store.delete_key(f"{prefix}{r}")
                store.set(f"{prefix}done", b"1")
            elif not until(lambda: store.check([f"{prefix}done"]), deadline):
                raise errors.Timeout(
                    f"weft backend: monitored_barrier: rank {me} was not released by rank 0 within {seconds} s"
                )

        work = self._submit("monitored_barrier", None, [], job)
        work.wait()

    # --- point to point --------------------------------------------------------------------

    def send(self, tensors, dst, tag=0):
        return self._p2p_op("send", tensors, dst, tag, send=True)

    def recv(self, tensors, src, tag=0):
        return self._p2p_op("recv", tensors, src, tag, send=False)

    def recv_anysource(self, tensors, tag=0):
        raise _unsupported("recv from any source", "weftcc receives from a named rank")


# Live groups: a collective on any of them first runs the sends and receives collected on all
# of them, and the interpreter's exit shuts down those still open.
_LIVE: "weakref.WeakSet[ProcessGroupWeft]" = weakref.WeakSet()


# Groups holding collected sends and receives (a set of their own: every collective's call
# looks here, and walking every live group cost more than the rest of a small call).
_WITH_P2P: set = set()


def _flush_all_p2p() -> None:
    if _WITH_P2P:
        for pg in list(_WITH_P2P):
            pg._flush_p2p()


@atexit.register
def _shutdown_live_groups() -> None:
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:
            pass


def _create(store, rank, size, timeout):
    return ProcessGroupWeft.create(store, rank, size, timeout)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    # weftcc keeps its own flight recorder (WEFT_TRACE, `weft trace`): torch's would look for a
    # C++ backend this Python group does not have.
    recording = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(recording, set):
        recording.add(BACKEND)


_register()
