"""When a step's forward has really computed its blocks: the marker ``wait_for_save`` takes.

vLLM calls the worker half's ``wait_for_save`` once the model's forward has been *issued*. On a
CPU the forward ran on the calling thread, so its blocks hold their KV by then. On a GPU the
kernels were only queued on the worker thread's current stream and may still be running: a
holder that vouched for the step's new blocks at that moment could serve a peer (an index hit)
bytes the forward has not written yet. The marker is a CUDA event recorded on that stream;
``HeldBlockHashes.apply_stores`` lists the step's blocks once it has completed
(docs/architecture.md, "Life of an index hit").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["forward_done_marker"]


def forward_done_marker(device: torch.device) -> Callable[[], bool] | None:
    """A callable true once the work queued so far on the calling thread's current stream of
    ``device`` has finished (``torch.cuda.Event.query`` of an event recorded now), or None for
    a device whose work is done when the call returns (CPU: the forward ran synchronously).

    Call it on the thread that issued the forward (vLLM's worker thread, in ``wait_for_save``);
    the callable may be called from any thread (the connector loop's is bound to ``device``).
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.query
