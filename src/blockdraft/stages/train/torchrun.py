"""torchrun, as `blockdraft train` starts it (`python -m blockdraft.stages.train.torchrun ARGS`, ARGS torchrun's own).

A rendezvous that cannot happen (node 0's port taken, no node 1 within train.dist_timeout_minutes, node 0 not
answering) ends torchrun's agent with its own traceback. Here it is one `error:` line naming the endpoint, the cause
and the fix, and exit status 2, as every blockdraft error. A rank that failed printed its own error (one line, or a
bug's traceback) and torchrun logged which rank it was: its exit status is passed on without torchrun's traceback on
top.
"""

from __future__ import annotations

import sys

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import parse_args
from torch.distributed.run import run as torchrun


def rendezvous_line(exc: BaseException, endpoint: str, timeout_s: str) -> str:
    """The one line for a rendezvous at `endpoint` that failed with `exc` (torchrun's rendezvous timeout
    `timeout_s`)."""
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    if "EADDRINUSE" in detail or "address already in use" in detail.lower():
        why = ("its port is in use on this machine (another program, or another node started as --node-rank 0); use a "
               "free port, the same on every node, and give each node its own --node-rank")
    else:
        why = (f"not every node joined within train.dist_timeout_minutes ({timeout_s} s): start each node (--node-rank "
               "0 to --nnodes - 1, each once) within that time, with the same --rdzv-endpoint")
    return f"error: the nodes did not meet at {endpoint} ({detail}): {why}; then rerun `blockdraft train` on every node"


def main() -> None:
    args = parse_args(sys.argv[1:])
    try:
        torchrun(args)
    except (DistNetworkError, DistStoreError, RendezvousError) as exc:
        timeout = next((item.split("=", 1)[1] for item in args.rdzv_conf.split(",") if item.startswith("timeout=")),
                       "?")
        print(rendezvous_line(exc, args.rdzv_endpoint, timeout), file=sys.stderr)
        sys.exit(2)
    except ChildFailedError as exc:
        # the rank printed its own error (a line, or a bug's traceback); torchrun logged which
        _, failure = exc.get_first_failure()
        sys.exit(failure.exitcode if failure.exitcode > 0 else 1)


if __name__ == "__main__":
    main()
