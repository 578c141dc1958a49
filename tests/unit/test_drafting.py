"""Which draft requests a drafter takes, and how a model-free proposer's tokens stream (no model)."""

from __future__ import annotations

import time

import pytest

from specdec.core.sampling import SamplingParams
from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from specdec.runtime.drafting import Drafter
from specdec.runtime.proposers import ModelProposer, NgramProposer


@pytest.mark.parametrize("history,k,fingerprint,error,message", [
    ([5, 6], 0, "", InvalidArgument, "num_tokens must be >= 1"),
    ([], 2, "", InvalidArgument, "history is empty"),
    ([5, 6], 2, "other", FailedPrecondition, "tokenizer mismatch: caller has other, draft model 'tiny' has fp"),
])
def test_a_request_the_drafter_cannot_serve_is_refused(history, k, fingerprint, error, message):
    with pytest.raises(error, match=message):
        Drafter(NgramProposer(), "fp", "tiny").check(history, k, fingerprint)


def test_a_request_it_can_serve_passes():
    drafter = Drafter(NgramProposer(), "fp", "tiny")
    drafter.check([5, 6], 2, "fp")
    drafter.check([5, 6], 2, "")  # no fingerprint: not checked


async def test_a_model_proposer_drafts_only_through_a_batcher():
    proposer = ModelProposer.__new__(ModelProposer)
    proposer.batcher = None
    with pytest.raises(ValueError, match="drafts through a batcher"):
        async for _ in Drafter(proposer, "fp", "tiny").stream("s", [1, 2], 2, SamplingParams(), 0, None, 0.0):
            pass


async def test_prompt_lookup_streams_its_tokens_with_the_queue_wait_on_the_first():
    drafter = Drafter(NgramProposer(max_ngram=2, min_ngram=1), "fp", "tiny")
    history = [1, 2, 3, 4, 1, 2]  # the suffix [1, 2] was followed by 3, 4
    arrived = time.monotonic() - 0.01
    got = [item async for item in drafter.stream("s", history, 2, SamplingParams(), 0, None, arrived)]
    assert [draft.token_id for draft, _ in got] == [3, 4]
    assert all(step.batch_size == 0 for _, step in got)
    assert got[0][1].queue_ns >= 0.01e9 and got[1][1].queue_ns == 0


async def test_prompt_lookup_past_its_deadline_is_dropped_before_compute():
    drafter = Drafter(NgramProposer(), "fp", "tiny")
    with pytest.raises(DeadlineExceeded, match="while it was queued"):
        async for _ in drafter.stream("s", [1, 2], 2, SamplingParams(), 0, time.monotonic() - 1, time.monotonic()):
            pass
