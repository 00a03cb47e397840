"""weftcc's exceptions: one class per C result code, each carrying the failure's facts as fields
(`rank`, `peer`, `op`, `seq`, from `weftGetLastErrorInfo`), never to be parsed from the
message."""

from __future__ import annotations

from typing import Dict, Optional

# The exception class of each C result code (filled in as the classes below are defined).
_BY_CODE: Dict[int, type] = {}

# weftOpKind_t codes (the C header's weftOp* constants) and their names.
OP_NAMES = {
    1: "all_reduce",
    2: "reduce",
    3: "broadcast",
    4: "all_gather",
    5: "reduce_scatter",
    6: "all_to_all",
    7: "send_recv",
    8: "barrier",
}


class WeftError(RuntimeError):
    """A failed weftcc call.

    Attributes: `code` (the C result code), `rank` (the rank that reported it), `peer` (the
    other rank it is about: lost, mismatched, aborted first or furthest behind), `op` (the
    operation's name, e.g. "all_reduce"), `seq` (its sequence number); each None where the error
    does not say. `message` is weftcc's text, which also names them.
    """

    code = -1

    def __init_subclass__(cls, code: Optional[int] = None, **kwargs):
        # The classes below name their C result code, by which from_facts finds them; a
        # subclass that names none keeps its parent's.
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            _BY_CODE[code] = cls

    def __init__(
        self,
        message: str,
        *,
        rank: Optional[int] = None,
        peer: Optional[int] = None,
        op: Optional[str] = None,
        seq: Optional[int] = None,
    ):
        super().__init__(message)
        self.message = message
        self.rank = rank
        self.peer = peer
        self.op = op
        self.seq = seq


class CudaError(WeftError, code=1):
    """The CUDA driver is missing or a CUDA call failed."""


class SystemFailure(WeftError, code=2):
    """The operating system or a transport failed (sockets, shared memory, bootstrap)."""


class InternalError(WeftError, code=3):
    """A bug in weftcc."""


class InvalidArgument(WeftError, ValueError, code=4):
    """A bad argument; nothing was sent and the communicator stays usable."""


class InvalidUsage(WeftError, code=5):
    """A call out of order (unbalanced groups, a device send as the first device call)."""


class RemoteError(WeftError, code=6):
    """Another rank failed, died, timed out, aborted or called a different collective."""


class Timeout(WeftError, TimeoutError, code=8):
    """An operation of this rank made no progress within the timeout."""


class Aborted(WeftError, code=9):
    """`abort()` was called on this communicator (on this rank)."""


def from_facts(
    code: int,
    message: str,
    *,
    rank: int = -1,
    peer: int = -1,
    op: int = 0,
    seq: int = -1,
) -> WeftError:
    """The exception of result `code` with the C ABI's facts (-1 / 0: not said)."""
    cls = _BY_CODE.get(code, WeftError)
    e = cls(
        message or f"weftcc error {code}",
        rank=rank if rank >= 0 else None,
        peer=peer if peer >= 0 else None,
        op=OP_NAMES.get(op),
        seq=seq if seq >= 0 else None,
    )
    e.code = code
    return e
