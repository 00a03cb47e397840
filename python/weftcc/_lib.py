"""ctypes bindings of libweft (weftcc's C ABI, include/weftcc.h): loading, signatures, and the
translation of a failed call into a Python exception built from `weftGetLastErrorInfo`'s
fields."""

from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_int64,
    c_size_t,
    c_uint32,
    c_void_p,
)

from . import errors

API_VERSION = 2
UNIQUE_ID_BYTES = 256
CONFIG_MAGIC = 2003134068
CONFIG_VERSION = 2
CONFIG_UNDEF_INT = -(2**63)
SPLIT_NOCOLOR = -1
SCALAR_HOST_IMMEDIATE = 1


class UniqueIdStruct(Structure):
    _fields_ = [("internal", c_char * UNIQUE_ID_BYTES)]


class Config(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint32),
        ("version", c_uint32),
        ("timeoutMs", c_int64),
        ("splitShare", c_int64),
        ("deterministic", c_int64),
    ]


class ErrorInfo(Structure):
    _fields_ = [
        ("size", c_size_t),
        ("result", c_int),
        ("rank", c_int),
        ("peer", c_int),
        ("op", c_int),
        ("seq", c_int64),
    ]


def _library_path() -> str:
    explicit = os.environ.get("WEFTCC_LIBRARY")
    if explicit:
        return explicit
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libweft.so")


def _load() -> ctypes.CDLL:
    path = _library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(
            f"weftcc: cannot load libweft ({path}): {e}. Install the package with "
            "`pip install ./python` from the weftcc repository, or set WEFTCC_LIBRARY to a "
            "built libweft.so"
        ) from e
    comm = c_void_p
    stream = c_void_p
    sigs = {
        "weftGetVersion": [POINTER(c_int)],
        "weftGetUniqueId": [POINTER(UniqueIdStruct)],
        "weftCommInitRank": [POINTER(comm), c_int, UniqueIdStruct, c_int],
        "weftCommInitRankConfig": [POINTER(comm), c_int, UniqueIdStruct, c_int, POINTER(Config)],
        "weftCommInitFromEnv": [POINTER(comm)],
        "weftRedOpCreatePreMulSum": [POINTER(c_int), c_void_p, c_int, c_int, comm],
        "weftRedOpDestroy": [c_int, comm],
        "weftCommSplit": [comm, c_int, c_int, POINTER(comm)],
        "weftCommRevoke": [comm, c_int],
        "weftCommAgree": [comm, POINTER(c_int), c_int, POINTER(c_int), POINTER(ctypes.c_uint64)],
        "weftCommShrink": [comm, POINTER(c_int), c_int, POINTER(comm), c_int],
        "weftCommGetUniqueId": [comm, POINTER(UniqueIdStruct)],
        "weftCommGrow": [comm, c_int, POINTER(UniqueIdStruct), c_int, POINTER(comm)],
        "weftCommDestroy": [comm],
        "weftCommAbort": [comm],
        "weftCommCount": [comm, POINTER(c_int)],
        "weftCommUserRank": [comm, POINTER(c_int)],
        "weftCommGetAsyncError": [comm, POINTER(c_int)],
        "weftGetLastErrorInfo": [POINTER(ErrorInfo)],
        "weftAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, comm, stream],
        "weftBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, comm, stream],
        "weftReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, comm, stream],
        "weftAllGather": [c_void_p, c_void_p, c_size_t, c_int, comm, stream],
        "weftReduceScatter": [c_void_p, c_void_p, c_size_t, c_int, c_int, comm, stream],
        "weftAllToAll": [c_void_p, c_void_p, c_size_t, c_int, comm, stream],
        "weftBarrier": [comm],
        "weftGroupStart": [],
        "weftGroupEnd": [],
        "weftSend": [c_void_p, c_size_t, c_int, c_int, comm, stream],
        "weftRecv": [c_void_p, c_size_t, c_int, c_int, comm, stream],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    lib.weftGetLastError.argtypes = [comm]
    lib.weftGetLastError.restype = c_char_p
    lib.weftGetErrorString.argtypes = [c_int]
    lib.weftGetErrorString.restype = c_char_p
    version = c_int(0)
    lib.weftGetVersion(ctypes.byref(version))
    if version.value != API_VERSION:
        raise ImportError(
            f"weftcc: libweft at {path} has C API version {version.value}; this package "
            f"needs {API_VERSION}"
        )
    return lib


lib = _load()


def last_error() -> errors.WeftError:
    """The exception for this thread's last failed call (its facts and message)."""
    info = ErrorInfo(size=ctypes.sizeof(ErrorInfo))
    lib.weftGetLastErrorInfo(ctypes.byref(info))
    message = (lib.weftGetLastError(None) or b"").decode("utf-8", "replace")
    return errors.from_facts(
        info.result,
        message,
        rank=info.rank,
        peer=info.peer,
        op=info.op,
        seq=info.seq,
    )


def check(code: int) -> None:
    """Raises the last error's exception when `code` is not weftSuccess."""
    if code != 0:
        e = last_error()
        if e.code != code:
            # The call failed before recording (a null argument): the code is the fact.
            e = errors.from_facts(code, lib.weftGetErrorString(code).decode())
        raise e
