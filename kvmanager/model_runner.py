"""``ModelRunner``: the worker half of one step (vllm/v1/worker/gpu_model_runner.py, slimmed).

It keeps a persistent batch: one block-table row per request it holds (``MultiGroupBlockTable``),
kept compact (a removed row is filled by moving the last row into it, which clears the source).
Per step it:

1. drops the rows of finished and preempted requests, adds rows for new requests (full block
   lists) and appends block-id deltas for cached ones;
2. builds the flattened inputs: token ids, positions, and per KV cache group an
   ``AttentionMetadata`` (``query_start_loc``, ``seq_lens``, the committed block-table rows of the
   batch, the slot mapping ``block_id * block_size + offset``);
3. runs the worker connector hooks around the forward in vLLM's order::

       bind_connector_metadata -> start_load_kv -> wait_for_layer_load (every layer)
       -> model forward -> save_kv_layer (every layer) -> wait_for_save
       -> get_finished / get_block_ids_with_load_errors -> clear_connector_metadata

   ``ReferenceDecoder.forward`` has no per-layer hooks, so the per-layer calls bracket the whole
   forward: every layer's load is waited for before the first layer runs, and every layer's save
   starts after the last layer wrote its KV. That is correct for whole-request pulls; it only
   gives up layer-wise overlap. The hooks also run on steps with no tokens (vLLM's
   ``kv_connector_no_forward``), so transfers progress while every request waits;
4. samples greedily at each request's last scheduled position and returns a
   ``ModelRunnerOutput`` with the connector's ``KVConnectorOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvbridge.kernels import AttentionMetadata
from kvbridge.kernels.model import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    ReferenceDecoder,
    allocate_kv_caches,
    greedy_sample,
    layer_names_by_type,
    token_logprobs,
)

from .block_table import MultiGroupBlockTable
from .connector_interface import (
    ForwardContext,
    KVConnectorBase,
    KVConnectorOutput,
    KVConnectorRole,
    NoOpConnector,
)
from .kv_cache_spec import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from .scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput

__all__ = ["ModelRunner", "make_kv_cache_config"]


def make_kv_cache_config(
    model_config: ModelConfig, *, num_blocks: int, block_size: int
) -> KVCacheConfig:
    """One KV cache group per attention type present (full first, then sliding window), all
    drawing from ``num_blocks`` shared block ids; one ``KVCacheTensor`` of ``num_blocks *
    page_size_bytes`` per layer (``kernels/layout.py``).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` < 1.
    """
    by_type = layer_names_by_type(model_config)
    groups: list[KVCacheGroupSpec] = []
    common = dict(
        block_size=block_size,
        num_kv_heads=model_config.num_kv_heads,
        head_size=model_config.head_dim,
        dtype=model_config.dtype,
    )
    if FULL_ATTENTION in by_type:
        groups.append(KVCacheGroupSpec(by_type[FULL_ATTENTION], FullAttentionSpec(**common)))
    if SLIDING_ATTENTION in by_type:
        spec = SlidingWindowSpec(**common, sliding_window=model_config.sliding_window)
        groups.append(KVCacheGroupSpec(by_type[SLIDING_ATTENTION], spec))
    tensors = [
        KVCacheTensor(size_bytes=num_blocks * group.kv_cache_spec.page_size_bytes, shared_by=[name])
        for group in groups
        for name in group.layer_names
    ]
    return KVCacheConfig(num_blocks, groups, tensors)


@dataclass(slots=True)
class _CachedRequestState:
    """What the runner remembers of a request it holds."""

    req_id: str
    prompt_token_ids: list[int]
    wants_prompt_logprobs: bool
    row: int


class ModelRunner:
    """Runs ``ReferenceDecoder`` over paged KV caches it allocates.

    Args:
        model: the decoder (its weights are used as they are).
        kv_cache_config: groups and ``num_blocks`` (``make_kv_cache_config``); every group's spec
            must be an ``AttentionSpec`` with the same ``block_size``.
        max_num_reqs: rows of the persistent batch (>= the scheduler's ``max_num_seqs``).
        max_model_len: longest request in tokens (sizes the block-table columns).
        connector: the worker half of a KV connector; ``NoOpConnector`` by default.
        device: where the KV caches and block tables live.
        use_triton: kernel choice (``kernels/dispatch.py``).

    Raises:
        ValueError: on a group spec that is not attention, mixed block sizes, or a layer of the
            model missing from the groups.
    """

    def __init__(
        self,
        model: ReferenceDecoder,
        kv_cache_config: KVCacheConfig,
        *,
        max_num_reqs: int,
        max_model_len: int,
        connector: KVConnectorBase | None = None,
        device: torch.device | str = "cpu",
        use_triton: bool | None = None,
    ) -> None:
        specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        if not all(isinstance(spec, AttentionSpec) for spec in specs):
            raise ValueError("ModelRunner serves attention groups only")
        block_sizes = {spec.block_size for spec in specs}
        if len(block_sizes) != 1:
            raise ValueError(f"every group needs the same block size, got {sorted(block_sizes)}")
        self.block_size = block_sizes.pop()
        self.model = model
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.use_triton = use_triton
        self.layer_name_to_group = {
            name: group_id
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        missing = set(model.layer_names) - set(self.layer_name_to_group)
        if missing:
            raise ValueError(f"layers {sorted(missing)} belong to no KV cache group")
        self.sliding_windows = [getattr(spec, "sliding_window", None) for spec in specs]
        self.kv_caches = allocate_kv_caches(
            model.config, kv_cache_config.num_blocks, self.block_size, device=self.device
        )
        max_blocks = -(-max_model_len // self.block_size)
        self.block_tables = MultiGroupBlockTable(
            block_sizes=[self.block_size] * len(specs),
            max_num_reqs=max_num_reqs,
            max_num_blocks_per_req=[max_blocks] * len(specs),
            device=self.device,
        )
        self.max_num_reqs = max_num_reqs
        self.requests: dict[str, _CachedRequestState] = {}
        self.row_to_req_id: list[str] = []
        self.connector = connector or NoOpConnector(KVConnectorRole.WORKER)
        self.connector.register_kv_caches(self.kv_caches)

    # ------------------------------------------------------------------ persistent batch
    def _remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is None:
            return
        last = len(self.row_to_req_id) - 1
        if state.row != last:
            moved_id = self.row_to_req_id[last]
            self.block_tables.move_row(last, state.row)  # clears the last row
            self.requests[moved_id].row = state.row
            self.row_to_req_id[state.row] = moved_id
        else:
            self.block_tables.clear_row(last)
        self.row_to_req_id.pop()

    def _add_request(self, new_req: NewRequestData) -> None:
        if new_req.req_id in self.requests:
            raise RuntimeError(f"runner already holds request {new_req.req_id!r}")
        row = len(self.row_to_req_id)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full: {row} rows of {self.max_num_reqs}")
        self.block_tables.add_row(new_req.block_ids, row)
        self.row_to_req_id.append(new_req.req_id)
        self.requests[new_req.req_id] = _CachedRequestState(
            req_id=new_req.req_id,
            prompt_token_ids=new_req.prompt_token_ids,
            wants_prompt_logprobs=new_req.sampling_params.prompt_logprobs is not None,
            row=row,
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._remove_request(req_id)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id not in self.requests:
                raise RuntimeError(f"cached request {req_id!r} is not in the persistent batch")
            if new_block_ids is not None:
                self.block_tables.append_row(new_block_ids, self.requests[req_id].row)
        for new_req in scheduler_output.scheduled_new_reqs:
            self._add_request(new_req)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (mutates the persistent batch and the KV caches). Returns the sampled
        tokens and the connector's report.

        Raises:
            RuntimeError: if the scheduler output disagrees with the persistent batch.
        """
        self._update_states(scheduler_output)
        batch = self._prepare_inputs(scheduler_output)
        connector = self.connector
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        forward_context = ForwardContext(
            kv_caches=self.kv_caches,
            attn_metadata=batch.attn_metadata if batch is not None else None,
            layer_name_to_group=self.layer_name_to_group,
        )
        connector.start_load_kv(forward_context)
        output = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        if batch is not None:
            for name in self.model.layer_names:
                connector.wait_for_layer_load(name)
            output = self._forward_and_sample(batch)
            for name in self.model.layer_names:
                group_metadata = batch.attn_metadata[self.layer_name_to_group[name]]
                connector.save_kv_layer(name, self.kv_caches[name], group_metadata)
        connector.wait_for_save()
        finished_sending, finished_recving = connector.get_finished(
            scheduler_output.finished_req_ids
        )
        output.kv_connector_output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return output

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> _Batch | None:
        """Flatten the scheduled requests in row order (the order of the committed rows)."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        if not num_scheduled:
            return None
        step_tokens: dict[str, tuple[int, list[int]]] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            start = new_req.num_computed_tokens
            n = num_scheduled[new_req.req_id]
            step_tokens[new_req.req_id] = (start, new_req.all_token_ids[start : start + n])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, token_ids, start in zip(
            cached.req_ids, cached.new_token_ids, cached.num_computed_tokens, strict=True
        ):
            step_tokens[req_id] = (start, token_ids)

        req_ids = sorted(step_tokens, key=lambda req_id: self.requests[req_id].row)
        rows = np.array([self.requests[r].row for r in req_ids], dtype=np.int64)
        query_lens = np.array([len(step_tokens[r][1]) for r in req_ids], dtype=np.int64)
        starts = np.array([step_tokens[r][0] for r in req_ids], dtype=np.int64)
        if (query_lens != np.array([num_scheduled[r] for r in req_ids])).any():
            raise RuntimeError("token ids sent for a request differ from its scheduled count")
        # token t of request i sits at position starts[i] + (t - query_start_loc[i]).
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        token_rows = np.repeat(rows, query_lens)
        positions = np.repeat(starts - query_start_loc[:-1], query_lens) + np.arange(
            int(query_start_loc[-1])
        )
        input_ids = np.fromiter(
            (t for r in req_ids for t in step_tokens[r][1]), dtype=np.int64,
            count=int(query_start_loc[-1]),
        )
        seq_lens = starts + query_lens

        committed = self.block_tables.commit(len(self.row_to_req_id))
        slot_mappings = self.block_tables.compute_slot_mapping(token_rows, positions)
        rows_t = torch.from_numpy(rows).to(self.device)
        qsl_t = torch.from_numpy(query_start_loc).to(self.device)
        seq_lens_t = torch.from_numpy(seq_lens).to(self.device)
        attn_metadata = [
            AttentionMetadata(
                query_start_loc=qsl_t,
                seq_lens=seq_lens_t,
                block_table=committed[group_id].index_select(0, rows_t),
                slot_mapping=torch.from_numpy(slot_mappings[group_id]).to(self.device),
                block_size=self.block_size,
                sliding_window=self.sliding_windows[group_id],
                max_query_len=int(query_lens.max()),
                max_seq_len=int(seq_lens.max()),
            )
            for group_id in range(len(self.block_tables))
        ]
        return _Batch(
            req_ids=req_ids,
            input_ids=torch.from_numpy(input_ids).to(self.device),
            positions=torch.from_numpy(positions).to(self.device),
            query_start_loc=query_start_loc,
            starts=starts,
            attn_metadata=attn_metadata,
        )

    def _forward_and_sample(self, batch: _Batch) -> ModelRunnerOutput:
        by_layer = {
            name: batch.attn_metadata[group_id]
            for name, group_id in self.layer_name_to_group.items()
        }
        hidden = self.model.forward(
            batch.input_ids, batch.positions, self.kv_caches, by_layer, use_triton=self.use_triton
        )
        last_rows = torch.from_numpy(batch.query_start_loc[1:] - 1).to(self.device)
        sampled = greedy_sample(self.model.compute_logits(hidden.index_select(0, last_rows)))
        sampled_list = sampled.tolist()
        output = ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index={req_id: i for i, req_id in enumerate(batch.req_ids)},
            sampled_token_ids=[[token_id] for token_id in sampled_list],
        )
        for i, req_id in enumerate(batch.req_ids):
            state = self.requests[req_id]
            if state.wants_prompt_logprobs:
                chunk = self._prompt_logprobs_chunk(state, batch, hidden, i)
                if chunk:
                    output.prompt_logprobs_dict[req_id] = chunk
        return output

    def _prompt_logprobs_chunk(
        self, state: _CachedRequestState, batch: _Batch, hidden: torch.Tensor, i: int
    ) -> list[float]:
        """``log p(prompt[p + 1] | prompt[: p + 1])`` for this step's prompt positions ``p``
        with ``p + 1 < num_prompt_tokens``."""
        start = int(batch.starts[i])
        q_begin, q_end = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
        num_prompt = len(state.prompt_token_ids)
        last_position = min(start + (q_end - q_begin), num_prompt - 1)  # exclusive
        if last_position <= start:
            return []
        rows = hidden[q_begin : q_begin + (last_position - start)]
        targets = torch.tensor(
            state.prompt_token_ids[start + 1 : last_position + 1], device=self.device
        )
        return token_logprobs(self.model.compute_logits(rows), targets).tolist()

    def shutdown(self) -> None:
        """Shut the connector's worker half down."""
        self.connector.shutdown()


@dataclass(slots=True)
class _Batch:
    """One step's flattened inputs (row order)."""

    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: np.ndarray
    starts: np.ndarray
    attn_metadata: list[AttentionMetadata]
