"""GPU readiness on a CPU host (issue 30, part 5): the device binder with a fake ``torch.cuda``,
the connector loop's binding and its refusal of a second GPU, the copy threads' binding, and the
UCX memory decision (``transport/ucx_memory``) with UCX's CUDA support faked. The end-to-end
check is ``scripts/gpu_device_check.py`` (``tests/test_gpu_device_check.py`` runs it on CPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from kvbridge.connector.loop_thread import LoopThread
from kvbridge.kernels import device_binding
from kvbridge.transport import staging, ucx_memory
from kvbridge.transport.staging import StagingPool


class _FakeCuda:
    """``torch.cuda``'s per-thread current device, without a GPU."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.calls: list[tuple[str, int]] = []

    def set_device(self, index: int) -> None:
        self.local.index = index
        self.calls.append((threading.current_thread().name, index))

    def current_device(self) -> int:
        return getattr(self.local, "index", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    return fake


def test_bind_device_sets_the_cuda_device_and_ignores_the_cpu(fake_cuda):
    device_binding.bind_device(torch.device("cpu"))
    assert fake_cuda.calls == []
    device_binding.bind_device(torch.device("cuda", 1))
    assert fake_cuda.current_device() == 1
    with pytest.raises(ValueError, match="indexed"):
        device_binding.bind_device(torch.device("cuda"))


def test_resolve_device_indexes_cuda_from_the_creating_thread(fake_cuda):
    fake_cuda.set_device(2)
    assert device_binding.resolve_device("cuda") == torch.device("cuda", 2)
    assert device_binding.resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'gpu9'"):
        device_binding.resolve_device("gpu9")


def test_bound_binds_the_thread_that_runs_it_to_the_device_given(fake_cuda):
    seen = []
    target = device_binding.bound("cuda:3", lambda: seen.append(torch.cuda.current_device()))
    thread = threading.Thread(target=target, name="bound-thread")
    thread.start()
    thread.join()
    assert seen == [3]
    assert fake_cuda.calls == [("bound-thread", 3)]
    assert fake_cuda.current_device() == 0  # this thread was not rebound


def test_the_loop_thread_is_bound_once_and_refuses_a_second_gpu(fake_cuda):
    loop = LoopThread(name="test-bind-loop")
    try:
        loop.bind(torch.device("cpu"))  # a CPU engine in the same process: nothing to bind
        assert loop.device is None and fake_cuda.calls == []
        loop.bind(torch.device("cuda", 1))
        loop.bind(torch.device("cuda", 1))  # a second engine on the same GPU
        assert fake_cuda.calls == [("test-bind-loop", 1)] * 2
        assert loop.device == torch.device("cuda", 1)
        with pytest.raises(ValueError, match=r"bound to cuda:1; KV tensors on cuda:0"):
            loop.bind(torch.device("cuda", 0))
        assert loop.run(_current_device()) == 1
    finally:
        loop.loop.call_soon_threadsafe(loop.loop.stop)


async def _current_device() -> int:
    return torch.cuda.current_device()


def test_copy_threads_are_bound_to_their_device(fake_cuda):
    seen = staging.copy_executor(torch.device("cuda", 5)).submit(torch.cuda.current_device)
    assert seen.result(10) == 5
    assert staging.copy_executor() is staging.copy_executor(torch.device("cpu"))  # one pool


# ----------------------------------------------------------------------------- UCX memory
CUDA_INFO = """#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 2  :  cuda_cpy
#     component 3  :  cuda_ipc
#
#            md 2  :  component 2  cuda_cpy
"""
HOST_INFO = "#\n#     component 0  :  self\n#     component 1  :  cma\n"


def test_memory_domains_are_read_from_the_context_info():
    assert ucx_memory.ucx_memory_domains(CUDA_INFO) == {"self", "tcp", "cuda_cpy", "cuda_ipc"}
    assert ucx_memory.ucx_memory_domains(HOST_INFO) == {"self", "cma"}
    assert ucx_memory.ucx_memory_domains("") == frozenset()


@pytest.mark.parametrize(
    ("kv_device", "info", "forced", "memory", "staging_device"),
    [
        ("cpu", HOST_INFO, None, "host", "cpu"),
        ("cpu", CUDA_INFO, "staged", "host", "cpu"),  # host KV is never staged
        ("cuda:1", CUDA_INFO, None, "device", "cuda:1"),
        ("cuda:1", HOST_INFO, None, "staged", "cpu"),
        ("cuda:1", "", None, "staged", "cpu"),  # ucxx without context info: the safe choice
        ("cuda:1", CUDA_INFO, "staged", "staged", "cpu"),
        ("cuda:0", HOST_INFO, "device", "device", "cuda:0"),
    ],
)
def test_wire_memory_is_decided_from_ucx_cuda_support(
    monkeypatch, kv_device, info, forced, memory, staging_device
):
    monkeypatch.setattr(ucx_memory, "ucx_context_info", lambda: info)
    kv = torch.device(kv_device)
    assert ucx_memory.choose_wire_memory(kv, forced) == memory
    assert ucx_memory.wire_device(memory, kv) == torch.device(staging_device)


def test_wire_memory_refuses_what_ucx_cannot_move():
    with pytest.raises(ValueError, match="device_memory must be"):
        ucx_memory.check_device_memory("pinned")
    with pytest.raises(ValueError, match="CPU or CUDA only"):
        ucx_memory.wire_memory(torch.device("meta"), ucx_cuda=True)


def test_staged_gpu_kv_is_never_sent_from_the_kv_tensor_itself():
    gpu_kv = [torch.empty(4, 2, 16, 2, 8, device="meta")]
    host_kv = [torch.empty(4, 2, 16, 2, 8)]
    assert not StagingPool(1 << 20, torch.device("cpu")).in_place(gpu_kv)
    assert StagingPool(1 << 20, torch.device("cpu")).in_place(host_kv)
    with pytest.raises(ValueError, match="pinned staging is host memory"):
        StagingPool(1 << 20, torch.device("cuda", 0), pinned=True)
