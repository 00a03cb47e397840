"""The communicator over libweft: a raw layer on addresses and element counts, shared by the
NumPy methods here and the torch backend (`weftcc.torch`), so both run the same calls."""

from __future__ import annotations

import contextlib
import ctypes
import enum
import threading
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import errors
from ._lib import (
    last_error,
    CONFIG_MAGIC,
    CONFIG_UNDEF_INT,
    CONFIG_VERSION,
    SCALAR_HOST_IMMEDIATE,
    SPLIT_NOCOLOR,
    UNIQUE_ID_BYTES,
    Config,
    UniqueIdStruct,
    check,
    lib,
)


class DataType(enum.IntEnum):
    """Element types (the C ABI's weftDataType_t)."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9


class ReduceOp(enum.IntEnum):
    """Built-in reductions (the C ABI's weftRedOp_t)."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


class PreMulSum:
    """A sum of each rank's input multiplied by `factor` (this rank's own factor), NCCL's
    ncclRedOpCreatePreMulSum: pass it as `op`."""

    def __init__(self, factor: float):
        self.factor = float(factor)

    def __repr__(self) -> str:
        return f"PreMulSum({self.factor})"


Op = Union[ReduceOp, PreMulSum, str]

_NUMPY_TYPES = {
    np.dtype(np.int8): DataType.INT8,
    np.dtype(np.uint8): DataType.UINT8,
    np.dtype(np.int32): DataType.INT32,
    np.dtype(np.uint32): DataType.UINT32,
    np.dtype(np.int64): DataType.INT64,
    np.dtype(np.uint64): DataType.UINT64,
    np.dtype(np.float16): DataType.FLOAT16,
    np.dtype(np.float32): DataType.FLOAT32,
    np.dtype(np.float64): DataType.FLOAT64,
}


def get_unique_id() -> str:
    """A new unique id; starts the job's bootstrap store in this process, which must become
    rank 0. Give the id to every rank (`Communicator.from_unique_id`)."""
    uid = UniqueIdStruct()
    check(lib.weftGetUniqueId(ctypes.byref(uid)))
    return uid.internal.decode()


def _config(timeout: Optional[float], deterministic: Optional[bool]) -> Config:
    cfg = Config(
        size=ctypes.sizeof(Config),
        magic=CONFIG_MAGIC,
        version=CONFIG_VERSION,
        timeoutMs=CONFIG_UNDEF_INT,
        splitShare=CONFIG_UNDEF_INT,
        deterministic=CONFIG_UNDEF_INT,
    )
    if timeout is not None:
        cfg.timeoutMs = max(1, int(round(timeout * 1000)))
    if deterministic is not None:
        cfg.deterministic = int(bool(deterministic))
    return cfg


_group = threading.local()


@contextlib.contextmanager
def group() -> Iterator[None]:
    """Collects this thread's sends and receives (of any communicator) and runs them together
    when the block ends, so that ranks can exchange without deadlock (weftGroupStart/End).
    The arrays passed are kept alive until then. If the block raises, the calls made so far
    still run (the C library has no way to cancel them) before the exception propagates."""
    check(lib.weftGroupStart())
    depth = getattr(_group, "depth", 0)
    if depth == 0:
        _group.keep = []
    _group.depth = depth + 1
    ok = False
    try:
        yield
        ok = True
    finally:
        _group.depth = depth
        code = lib.weftGroupEnd()
        if depth == 0:
            _group.keep = []
        if ok:
            check(code)


def _keep_for_group(buf) -> None:
    if getattr(_group, "depth", 0):
        _group.keep.append(buf)


class Communicator:
    """A weftcc communicator. Create it with `from_env()` (weft run, torchrun, srun, mpirun) or
    `from_unique_id()`; close it with `close()` or a `with` block.

    The NumPy methods take C-contiguous arrays of int8, uint8, int32, uint32, int64, uint64,
    float16, float32, float64 (and bfloat16 from ml_dtypes); a receive array left
    out is the send array (in place) or, where shapes differ, a new array. Every call blocks until
    the operation completed on this rank and raises a `weftcc.WeftError` subclass naming the
    rank, the operation and its sequence number when it fails.
    """

    def __init__(self, handle: ctypes.c_void_p):
        self._handle = handle
        # Calls in flight (any thread): close() waits for them before the handle is freed.
        self._lock = threading.Condition()
        self._users = 0
        count, rank = ctypes.c_int(0), ctypes.c_int(0)
        check(lib.weftCommCount(handle, ctypes.byref(count)))
        check(lib.weftCommUserRank(handle, ctypes.byref(rank)))
        self.size = count.value
        self.rank = rank.value

    # --- creation and life ---------------------------------------------------------------

    @classmethod
    def from_env(cls) -> "Communicator":
        """This process's communicator from the launcher's environment (WEFT_RANK/RANK,
        WORLD_SIZE, MASTER_ADDR/MASTER_PORT or WEFT_UNIQUE_ID, SLURM, Open MPI)."""
        handle = ctypes.c_void_p()
        check(lib.weftCommInitFromEnv(ctypes.byref(handle)))
        return cls(handle)

    @classmethod
    def from_unique_id(
        cls,
        unique_id: Union[str, bytes],
        rank: int,
        size: int,
        *,
        timeout: Optional[float] = None,
        deterministic: Optional[bool] = None,
    ) -> "Communicator":
        """Rank `rank` of `size` from a unique id made by `get_unique_id()` on rank 0.
        `timeout` (seconds) bounds every operation (default: WEFT_TIMEOUT); `deterministic`
        makes float reductions bitwise reproducible (default: WEFT_DETERMINISTIC)."""
        raw = unique_id.encode() if isinstance(unique_id, str) else bytes(unique_id)
        if len(raw) >= UNIQUE_ID_BYTES:
            raise errors.InvalidArgument(f"unique id of {len(raw)} bytes is too long")
        uid = UniqueIdStruct(raw)
        cfg = _config(timeout, deterministic)
        handle = ctypes.c_void_p()
        check(
            lib.weftCommInitRankConfig(
                ctypes.byref(handle), int(size), uid, int(rank), ctypes.byref(cfg)
            )
        )
        return cls(handle)

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Collective: ranks with the same `color` form a new communicator ranked by (key, old
        rank); `color=None` takes part without joining (returns None)."""
        handle = ctypes.c_void_p()
        c = SPLIT_NOCOLOR if color is None else int(color)
        if c < 0 and color is not None:
            raise errors.InvalidArgument(f"split color {color} is negative")
        self._call(lib.weftCommSplit, c, int(key), ctypes.byref(handle), stream=False)
        return Communicator(handle) if handle.value else None

    # --- recovery: docs/failures.md ---------------------------------------------------------

    def revoke(self) -> None:
        """Revokes the communicator on every rank: pending and later calls raise (`InvalidUsage`
        here, `RemoteError` on the others, both saying "revoked"); it stays for
        `agree_on_failures` and `shrink`."""
        self._call(lib.weftCommRevoke, 0, stream=False)

    def agree_on_failures(self) -> Tuple[List[int], int]:
        """Collective over the survivors: the failed ranks (the same list on every survivor)
        and the agreement's epoch."""
        room = self.size
        failed = (ctypes.c_int * room)()
        count = ctypes.c_int(0)
        epoch = ctypes.c_uint64(0)
        self._call(
            lib.weftCommAgree,
            failed,
            room,
            ctypes.byref(count),
            ctypes.byref(epoch),
            stream=False,
        )
        return [failed[i] for i in range(count.value)], epoch.value

    def shrink(self, exclude: Sequence[int] = ()) -> "Communicator":
        """Collective over the ranks not in `exclude`: their communicator, renumbered in order
        (an excluded caller gets `InvalidUsage`)."""
        ranks = (ctypes.c_int * max(len(exclude), 1))(*[int(r) for r in exclude])
        handle = ctypes.c_void_p()
        self._call(
            lib.weftCommShrink, ranks, len(exclude), ctypes.byref(handle), 0, stream=False
        )
        return Communicator(handle)

    def job_id(self) -> str:
        """The job's id (its store's address and token), which a newcomer passes to
        `Communicator.join_grown`."""
        uid = UniqueIdStruct()
        self._call(lib.weftCommGetUniqueId, ctypes.byref(uid), stream=False)
        return uid.internal.decode()

    def grow(self, joining: int) -> "Communicator":
        """Collective over this communicator: admits `joining` newcomers (`join_grown`), which
        take the ranks after the existing ones."""
        handle = ctypes.c_void_p()
        self._call(
            lib.weftCommGrow,
            self.size + int(joining),
            None,
            -1,
            ctypes.byref(handle),
            stream=False,
        )
        return Communicator(handle)

    @classmethod
    def join_grown(cls, job_id: Union[str, bytes], size: int, rank: int = -1) -> "Communicator":
        """A newcomer: waits for a place in a communicator of the job `job_id` growing to
        `size` ranks (`rank`: the rank it expects, or -1 for the next place)."""
        raw = job_id.encode() if isinstance(job_id, str) else bytes(job_id)
        uid = UniqueIdStruct(raw)
        handle = ctypes.c_void_p()
        check(lib.weftCommGrow(None, int(size), ctypes.byref(uid), int(rank), ctypes.byref(handle)))
        return cls(handle)

    def abort(self) -> None:
        """Aborts: calls blocked in this communicator (any thread) and later ones raise
        `Aborted`; the other ranks' calls raise `RemoteError` naming this rank."""
        h = self._enter()
        try:
            code = lib.weftCommAbort(h)
        finally:
            self._exit()
        check(code)

    def async_error(self) -> Optional[errors.WeftError]:
        """The error that broke the communicator, or None while it is healthy."""
        result = ctypes.c_int(0)
        h = self._enter()
        try:
            code = lib.weftCommGetAsyncError(h, ctypes.byref(result))
            # The call recorded the error's message and facts on this thread.
            found = last_error() if code == 0 and result.value != 0 else None
        finally:
            self._exit()
        check(code)
        return found

    def close(self) -> None:
        """Destroys the communicator (idempotent). Waits for calls in flight on other threads
        (call `abort()` first to end them at once)."""
        with self._lock:
            handle, self._handle = self._handle, None
            while self._users:
                self._lock.wait()
        if handle is not None:
            lib.weftCommDestroy(handle)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _enter(self) -> ctypes.c_void_p:
        with self._lock:
            if self._handle is None:
                raise errors.InvalidUsage("the communicator was closed")
            self._users += 1
            return self._handle

    def _exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._lock.notify_all()

    def _call(self, fn, *args, stream: bool = True, cuda_stream: int = 0) -> None:
        """`fn(*args, comm[, stream])` with the handle kept alive for the call: the stream is
        `cuda_stream` (a `cudaStream_t` as an integer: the buffers are device memory, the call
        enqueues on it) or NULL (host buffers, the call returns when done)."""
        h = self._enter()
        try:
            code = fn(*args, h, cuda_stream or None) if stream else fn(h, *args)
        finally:
            self._exit()
        check(code)

    # --- the raw layer: addresses, element counts, type codes -----------------------------

    def _op(self, op: Op):
        """A context manager giving the C code of `op` (a PreMulSum is created for the call and
        destroyed after; a built-in costs no generator)."""
        if isinstance(op, int):  # ReduceOp is an IntEnum
            return _Code(int(op))
        return self._made_op(op)

    @contextlib.contextmanager
    def _made_op(self, op: Op) -> Iterator[int]:
        if isinstance(op, PreMulSum):
            code = ctypes.c_int(-1)
            factor = ctypes.c_double(op.factor)
            h = self._enter()
            try:
                check(
                    lib.weftRedOpCreatePreMulSum(
                        ctypes.byref(code),
                        ctypes.byref(factor),
                        int(DataType.FLOAT64),
                        SCALAR_HOST_IMMEDIATE,
                        h,
                    )
                )
                try:
                    yield code.value
                finally:
                    lib.weftRedOpDestroy(code.value, h)
            finally:
                self._exit()
            return
        if isinstance(op, str):
            try:
                op = ReduceOp[op.upper()]
            except KeyError:
                raise errors.InvalidArgument(f"unknown reduction {op!r}") from None
        yield int(op)

    def raw_all_reduce(
        self, send: int, recv: int, count: int, dtype: int, op: Op, cuda_stream: int = 0
    ) -> None:
        with self._op(op) as code:
            self._call(lib.weftAllReduce, send, recv, count, dtype, code, cuda_stream=cuda_stream)

    def raw_broadcast(
        self, send: int, recv: int, count: int, dtype: int, root: int, cuda_stream: int = 0
    ) -> None:
        self._call(lib.weftBroadcast, send, recv, count, dtype, root, cuda_stream=cuda_stream)

    def raw_reduce(
        self, send: int, recv: int, count: int, dtype: int, op: Op, root: int, cuda_stream: int = 0
    ) -> None:
        with self._op(op) as code:
            self._call(lib.weftReduce, send, recv, count, dtype, code, root, cuda_stream=cuda_stream)

    def raw_all_gather(
        self, send: int, recv: int, count: int, dtype: int, cuda_stream: int = 0
    ) -> None:
        self._call(lib.weftAllGather, send, recv, count, dtype, cuda_stream=cuda_stream)

    def raw_reduce_scatter(
        self, send: int, recv: int, count: int, dtype: int, op: Op, cuda_stream: int = 0
    ) -> None:
        with self._op(op) as code:
            self._call(lib.weftReduceScatter, send, recv, count, dtype, code, cuda_stream=cuda_stream)

    def raw_all_to_all(
        self, send: int, recv: int, count: int, dtype: int, cuda_stream: int = 0
    ) -> None:
        self._call(lib.weftAllToAll, send, recv, count, dtype, cuda_stream=cuda_stream)

    def raw_send(self, buf: int, count: int, dtype: int, peer: int) -> None:
        self._call(lib.weftSend, buf, count, dtype, peer)

    def raw_recv(self, buf: int, count: int, dtype: int, peer: int) -> None:
        self._call(lib.weftRecv, buf, count, dtype, peer)

    def barrier(self) -> None:
        """Blocks until every rank called it."""
        self._call(lib.weftBarrier, stream=False)

    # --- NumPy ---------------------------------------------------------------------------

    def all_reduce(self, send: np.ndarray, recv: Optional[np.ndarray] = None, op: Op = ReduceOp.SUM) -> np.ndarray:
        """Every rank's `recv` holds the reduction of every `send` (in place without `recv`)."""
        if recv is None or recv is send:  # in place: one buffer to read
            b = _array(send, writable=True)
            self.raw_all_reduce(b.ptr, b.ptr, b.count, b.dtype, op)
            return send
        s, r = _array(send), _array(recv, writable=True)
        _same(s, r, s.count, "all_reduce")
        self.raw_all_reduce(s.ptr, r.ptr, s.count, s.dtype, op)
        return recv

    def broadcast(self, buf: np.ndarray, root: int) -> np.ndarray:
        """`root`'s `buf` into every rank's `buf`."""
        b = _array(buf, writable=True)
        self.raw_broadcast(b.ptr, b.ptr, b.count, b.dtype, root)
        return buf

    def reduce(
        self, send: np.ndarray, recv: Optional[np.ndarray] = None, op: Op = ReduceOp.SUM, root: int = 0
    ) -> np.ndarray:
        """The reduction of every `send` into `root`'s `recv` (in place without `recv`); other
        ranks' `recv` is left alone."""
        recv = send if recv is None else recv
        s, r = _array(send), _array(recv, writable=True)
        _same(s, r, s.count, "reduce")
        self.raw_reduce(s.ptr, r.ptr, s.count, s.dtype, op, root)
        return recv

    def all_gather(self, send: np.ndarray, recv: Optional[np.ndarray] = None) -> np.ndarray:
        """`recv` (shape (size, *send.shape) when made here) holds every rank's `send` in rank
        order."""
        if recv is None:
            recv = np.empty((self.size,) + send.shape, dtype=send.dtype)
        s, r = _array(send), _array(recv, writable=True)
        _same(s, r, s.count * self.size, "all_gather")
        self.raw_all_gather(s.ptr, r.ptr, s.count, s.dtype)
        return recv

    def reduce_scatter(
        self, send: np.ndarray, recv: Optional[np.ndarray] = None, op: Op = ReduceOp.SUM
    ) -> np.ndarray:
        """Rank r's `recv` holds block r (of size send.size / size) of the reduction of every
        `send`; made here (shape send.shape[1:] when send's first axis is the rank) if left
        out."""
        if recv is None:
            if send.ndim >= 1 and send.shape[0] == self.size:
                recv = np.empty(send.shape[1:], dtype=send.dtype)
            else:
                if send.size % self.size:
                    raise errors.InvalidArgument(
                        f"reduce_scatter: {send.size} elements do not split into {self.size} blocks"
                    )
                recv = np.empty(send.size // self.size, dtype=send.dtype)
        s, r = _array(send), _array(recv, writable=True)
        _same(s, r, s.count // self.size, "reduce_scatter")
        if s.count != r.count * self.size:
            raise errors.InvalidArgument(
                f"reduce_scatter: {s.count} send elements are not {self.size} blocks of {r.count}"
            )
        self.raw_reduce_scatter(s.ptr, r.ptr, r.count, s.dtype, op)
        return recv

    def all_to_all(self, send: np.ndarray, recv: Optional[np.ndarray] = None) -> np.ndarray:
        """Block j of `send` (send.size / size elements) goes to rank j; block i of `recv`
        comes from rank i."""
        if recv is None:
            recv = np.empty_like(send)
        s, r = _array(send), _array(recv, writable=True)
        _same(s, r, s.count, "all_to_all")
        if s.count % self.size:
            raise errors.InvalidArgument(
                f"all_to_all: {s.count} elements do not split into {self.size} blocks"
            )
        self.raw_all_to_all(s.ptr, r.ptr, s.count // self.size, s.dtype)
        return recv

    def send(self, buf: np.ndarray, peer: int) -> None:
        """Sends `buf` to `peer`, which posts a matching `recv`. Inside `weftcc.group()` it runs
        when the block ends (keep `buf` alive until then)."""
        b = _array(buf)
        _keep_for_group(buf)
        self.raw_send(b.ptr, b.count, b.dtype, peer)

    def recv(self, buf: np.ndarray, peer: int) -> np.ndarray:
        """Receives into `buf` from `peer` (see `send`)."""
        b = _array(buf, writable=True)
        _keep_for_group(buf)
        self.raw_recv(b.ptr, b.count, b.dtype, peer)
        return buf


class _Code:
    """A built-in reduction's code as a context manager (no generator for the common case)."""

    __slots__ = ("code",)

    def __init__(self, code: int):
        self.code = code

    def __enter__(self) -> int:
        return self.code

    def __exit__(self, *exc) -> None:
        return None


class _Buf:
    __slots__ = ("ptr", "count", "dtype", "np_dtype")

    def __init__(self, ptr: int, count: int, dtype: int, np_dtype):
        self.ptr, self.count, self.dtype, self.np_dtype = ptr, count, dtype, np_dtype


def numpy_dtype_code(dt: np.dtype) -> int:
    """The weftcc type of a NumPy dtype (bfloat16 from ml_dtypes included)."""
    code = _NUMPY_TYPES.get(dt) if isinstance(dt, np.dtype) else _NUMPY_TYPES.get(np.dtype(dt))
    if code is None and np.dtype(dt).name == "bfloat16":
        code = DataType.BFLOAT16
    if code is None:
        raise errors.InvalidArgument(
            f"dtype {np.dtype(dt)} is not a weftcc type (int8, uint8, int32, uint32, int64, "
            "uint64, float16, bfloat16, float32, float64)"
        )
    return int(code)


def _array(a: np.ndarray, writable: bool = False) -> _Buf:
    if not isinstance(a, np.ndarray):
        raise errors.InvalidArgument(f"expected a NumPy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise errors.InvalidArgument("the array is not C-contiguous (use np.ascontiguousarray)")
    if writable and not a.flags.writeable:
        raise errors.InvalidArgument("the receive array is read-only")
    return _Buf(a.ctypes.data, a.size, numpy_dtype_code(a.dtype), a.dtype)


def _same(s: _Buf, r: _Buf, want: int, call: str) -> None:
    if s.np_dtype != r.np_dtype:
        raise errors.InvalidArgument(f"{call}: send is {s.np_dtype}, receive is {r.np_dtype}")
    if r.count != want:
        raise errors.InvalidArgument(f"{call}: the receive array has {r.count} elements, not {want}")


__all__: Sequence[str] = [
    "Communicator",
    "DataType",
    "PreMulSum",
    "ReduceOp",
    "get_unique_id",
    "group",
    "numpy_dtype_code",
]
