"""Labelled assertions for the engine tests (``test_engine*.py``): the end-of-test leak check
(``check_integrity`` and a free pool), greedy tokens equal to the no-cache reference, and the
worker's block-table rows agreeing with the manager's blocks.
"""

from __future__ import annotations

from _engine_builders import TOKENIZER, reference_greedy
from kvbridge.kvmanager import Engine

MAX_TOKENS = 6


def _assert_all_blocks_free(engine: Engine) -> None:
    """Integrity holds and, with nothing left, every usable block is back in the free queue."""
    assert engine.scheduler.is_empty()
    engine.check_integrity()
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.config.num_blocks - 1


def _assert_matches_reference(engine: Engine, prompts: list[list[int]], *, hybrid: bool) -> list:
    outputs = engine.generate(prompts, max_tokens=MAX_TOKENS)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_greedy(prompt, MAX_TOKENS, hybrid=hybrid)
        assert output.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert output.finish_reason == "length"
        assert output.text == TOKENIZER.decode(expected)
    return outputs


def _assert_runner_rows_match_manager(engine: Engine) -> None:
    """Seed 000, invariant 5: the worker's block-table row of every request it holds agrees with
    the manager's blocks (a sliding group's manager list has null blocks where the worker keeps
    the stale id, which attention never reads)."""
    runner = engine.runner
    for req_id, state in runner.requests.items():
        if req_id in engine.scheduler.finished_req_ids:
            continue  # freed by the scheduler; the runner drops the row at the next step
        manager_ids = engine.kv_cache_manager.get_block_ids(req_id)
        for group_id, ids in enumerate(manager_ids):
            table = runner.block_tables[group_id]
            row = table.block_table_np[state.row, : table.num_blocks_per_row[state.row]].tolist()
            assert len(row) == len(ids), (req_id, group_id)
            for worker_id, manager_id in zip(row, ids, strict=True):
                assert manager_id in (0, worker_id), (req_id, group_id, row, ids)
