"""Output processing: ``update_from_output()``, finishing and freeing requests, and settling
the connector's report of finished transfers and load errors.

``SchedulerUpdate`` is a base of ``Scheduler`` (scheduler.py). Per step it appends sampled
tokens, applies the stop rules (vLLM's order: length cap, EOS, stop token ids), frees finished
requests (``connector.request_finished`` first; ``delay_free`` keeps the blocks until
``finished_sending``), settles async loads (``finished_recving`` -> ``KVTransferTracker``) and
applies the load-failure policy to ``invalid_block_ids``: ``"recompute"`` truncates progress to
the first bad block (or restarts from scratch), ``"fail"`` finishes the request with
``FINISHED_ERROR``. Either way no block leaks. ``finish_requests`` (aborts from outside the
loop) frees the same way.

Owning thread: the engine thread, like the rest of ``Scheduler``.
"""

from __future__ import annotations

from collections.abc import Iterable

from .connector_interface import KVConnectorOutput, KVLoadFailurePolicy
from .kv_transfer_tracker import HOLD_SENDING, LoadSettled
from .request import Request, RequestStatus
from .scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from .scheduler_queues import SchedulerQueues

__all__ = ["SchedulerUpdate"]


class SchedulerUpdate(SchedulerQueues):
    """Output processing of ``Scheduler``; the attributes are set by ``Scheduler.__init__``
    (see its Args)."""

    max_model_len: int
    kv_load_failure_policy: KVLoadFailurePolicy

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside the loop (abort). Unknown or already finished ids are
        ignored (an abort may race a completion). Returns one output per request finished.

        Raises:
            ValueError: if ``finished_status`` is not a finished status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            self._remove_from_queues(request)
            request.status = finished_status
            outputs.append(self._finish_output(request, []))
        return outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results (mutates requests, queues and allocations). Returns the news
        of every request that got a token or finished this step."""
        outputs: list[EngineCoreOutput] = []
        kv_output = model_runner_output.kv_connector_output
        recomputed: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            recomputed = self._handle_invalid_blocks(kv_output.invalid_block_ids, outputs)

        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in recomputed:
                continue  # aborted during the step, or its inputs were bad
            chunk = model_runner_output.prompt_logprobs_dict.get(req_id)
            if chunk is not None and request.num_output_tokens == 0:  # not after a resume
                self._add_prompt_logprobs(request, chunk)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that does not reach the end: no token yet
            index = model_runner_output.req_id_to_index[req_id]
            new_token_ids: list[int] = []
            for token_id in model_runner_output.sampled_token_ids[index]:
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request):
                    break
            if request.is_finished():
                self.running.remove(request)
                outputs.append(self._finish_output(request, new_token_ids))
            else:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        prompt_logprobs=self._prompt_logprobs.pop(req_id, None),
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                    )
                )

        self.kv_transfer.end_step()
        if kv_output is not None:
            self._update_from_kv_xfer_finished(kv_output, outputs)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        """vLLM's order: length cap, then EOS (unless ignore_eos), then stop token ids."""
        params = request.sampling_params
        last = request.all_token_ids[-1]
        if request.num_output_tokens >= request.max_tokens or (
            request.num_tokens >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        elif not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
        else:
            return False
        return True

    def _add_prompt_logprobs(self, request: Request, chunk: list[float]) -> None:
        acc = self._prompt_logprobs.setdefault(request.request_id, [None])
        acc.extend(chunk)

    def _finish_output(self, request: Request, new_token_ids: list[int]) -> EngineCoreOutput:
        """Free (or hold) a request that just got a finished status; its output."""
        kv_transfer_params = self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            kv_transfer_params=kv_transfer_params,
            prompt_logprobs=self._prompt_logprobs.pop(request.request_id, None),
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _free_request(self, request: Request) -> dict | None:
        """``request_finished`` first, then free the blocks unless something still uses them:
        the connector's delayed free, or an async load still in flight."""
        req_id = request.request_id
        self.finished_req_ids.add(req_id)
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if not self.kv_transfer.hold_finished(req_id, delay_free=delay_free):
            self._free_blocks(request)
        return kv_transfer_params

    def _free_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_transfer.forget_blocks(request.request_id)
        self._prompt_logprobs.pop(request.request_id, None)
        del self.requests[request.request_id]

    def _update_from_kv_xfer_finished(
        self, kv_output: KVConnectorOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """Settle loads (before sends: a request may report both in one step), then sends."""
        self.connector.update_connector_output(kv_output)
        for req_id in sorted(kv_output.finished_recving or ()):
            request = self.requests.get(req_id)
            settled = self.kv_transfer.settle_load(req_id, request)
            if settled is LoadSettled.FREE:
                self._free_blocks(request)
            elif settled is LoadSettled.FAILED:
                self.waiting.remove(request)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(self._finish_output(request, []))
        for req_id in sorted(kv_output.finished_sending or ()):
            if self.kv_transfer.release_hold(req_id, HOLD_SENDING):
                self._free_blocks(self.requests[req_id])

    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], outputs: list[EngineCoreOutput]
    ) -> set[str]:
        """Apply the load-failure policy to every sync load into a bad block (async ones are
        settled by ``KVTransferTracker``). This step's result for them is void:
        ``"recompute"`` truncates ``num_computed_tokens`` to the first bad block (or restarts
        from scratch when the blocks do not allow it), ``"fail"`` finishes the request with
        ``FINISHED_ERROR``. Returns the ids whose sampled token must be dropped."""
        void: set[str] = set()
        for req_id, first_bad in self.kv_transfer.take_failed_sync_loads(invalid_block_ids):
            void.add(req_id)
            request = self.requests[req_id]
            if request.is_finished():
                continue
            if self.kv_load_failure_policy == "recompute":
                num_computed = min(request.num_computed_tokens, first_bad)
                if self.kv_transfer.can_resume_from(req_id, num_computed):
                    request.num_computed_tokens = num_computed
                else:
                    self._restart_from_scratch(request)
            else:
                self._remove_from_queues(request)
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(self._finish_output(request, []))
        return void
