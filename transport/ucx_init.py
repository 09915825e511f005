"""UCX for this process: the context options kvbridge sets and the progress mode
(``UcxxTransport`` initialises it once per process; every transport of a process shares one
UCX worker)."""

from __future__ import annotations

import contextlib
import os

import ucxx

DEFAULT_PROGRESS_MODE = "blocking"

UCX_OPTIONS: dict[str, str] = {}
"""UCX context options this package sets (``ucxx.init(options=...)``; a ``UCX_<NAME>`` environment
variable still wins). Deliberately empty (docs/architecture.md, "Design measurements"):

- ``TLS``: UCX's default (all transports) picks shared memory (cma) on one host, the network
  across hosts and cuda_copy / cuda_ipc for device memory; restricting it to ``sm,self`` gained
  nothing on one host and would break cross-host and CUDA.
- ``MEMTYPE_CACHE``: ``import ucxx`` sets ``UCX_MEMTYPE_CACHE=n``; UCX 1.21 no longer knows the
  variable (it only prints "unused environment variable"), so there is nothing to set.
- progress mode: ``DEFAULT_PROGRESS_MODE`` above, not a UCX option.
- Intra-host protocol (``UCX_PROTO_INFO=y``): messages of 8 KiB and more go as rendezvous
  zero-copy reads over ``cma`` (``process_vm_readv`` by the receiver, 512 KiB per call); sysv
  carries the small ones; no xpmem or knem here. Raw ucxx (two processes, worker-address
  endpoint, one large tag message) moved far more from huge-page buffers than from 4 KiB pages:
  page size, not a UCX option, decides, hence ``kvbridge.kernels.host_memory`` (KV tensors and
  staging on huge pages).
  ``RNDV_FRAG_SIZE`` (512K..64M), ``RNDV_SCHEME=put_zcopy`` and ``TLS=sm,self`` /
  ``posix,self`` changed nothing measurable or made it worse.
"""


def init_ucx(progress_mode: str | None = None) -> None:
    """Initialise UCX for this process once (later calls are no-ops): ``UCX_OPTIONS`` and the
    progress mode (``progress_mode``, else ``UCXPY_PROGRESS_MODE``, else ``"blocking"``:
    "blocking" and "polling" moved large messages faster than "thread", and "polling" keeps a
    core busy even when idle; docs/architecture.md, "Design measurements")."""
    mode = progress_mode or os.environ.get("UCXPY_PROGRESS_MODE", DEFAULT_PROGRESS_MODE)
    with contextlib.suppress(RuntimeError):  # already initialised by an earlier transport
        ucxx.init(options=dict(UCX_OPTIONS), progress_mode=mode)


def current_progress_mode() -> str:
    """The progress mode ucxx runs in (whoever initialised it first decided)."""
    return str(ucxx.core._get_ctx().progress_mode)
