"""weftcc from Python: collective communication on NumPy arrays (`Communicator`) and, with
`import weftcc.torch`, a torch.distributed backend named "weft".

    import numpy as np, weftcc
    comm = weftcc.Communicator.from_env()        # under weft run, torchrun, srun or mpirun
    x = np.full(4, comm.rank, dtype=np.float32)
    comm.all_reduce(x)                           # in place: every rank holds the sum
"""

from .communicator import (
    Communicator,
    DataType,
    PreMulSum,
    ReduceOp,
    get_unique_id,
    group,
)
from .errors import (
    Aborted,
    CudaError,
    InternalError,
    InvalidArgument,
    InvalidUsage,
    RemoteError,
    SystemFailure,
    Timeout,
    WeftError,
)

__version__ = "0.1.0"

__all__ = [
    "Aborted",
    "Communicator",
    "CudaError",
    "DataType",
    "InternalError",
    "InvalidArgument",
    "InvalidUsage",
    "PreMulSum",
    "ReduceOp",
    "RemoteError",
    "SystemFailure",
    "Timeout",
    "WeftError",
    "get_unique_id",
    "group",
]
