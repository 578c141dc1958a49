"""Suffix speculation: the pure index (`specdec.core.suffix`) and the proposer around it."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.core.sampling import SamplingParams
from specdec.core.suffix import (
    FINGERPRINT_FIELD,
    GROUP_FIELD,
    OUTPUT_FIELD,
    OutputEntry,
    SkippedEntry,
    Speculation,
    SuffixIndex,
    best_speculation,
    decode_entry,
    decode_output,
    encode_entry,
    encode_output,
    followers,
)
from specdec.runtime.drafting import DraftEnv, DraftRequest
from specdec.runtime.proposers import AT_ONCE_TOKENS, MAX_FOLLOWERS, SuffixProposer


def index_of(*sequences: list[int], **kwargs) -> SuffixIndex:
    index = SuffixIndex(**kwargs)
    for seq in sequences:
        index.add(seq)
    return index


def test_follows_the_most_frequent_continuation():
    index = index_of([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [7, 2, 3, 5])
    spec = index.speculate([8, 1, 2, 3], k=3, min_prob=0.1)
    assert spec.tokens == [4]  # after "1 2 3": 4 twice, 9 once; the sequences end there
    assert spec.match_length == 3  # "1 2 3", not just "2 3" (which 5 also followed)
    assert spec.score == pytest.approx(2 / 3)


def test_the_running_product_decides_the_length():
    # After "5 6": 7 four times in five; after "5 6 7": 8 three times in four, then 9 once in three.
    index = index_of([5, 6, 7, 8, 1], [5, 6, 7, 8, 1], [5, 6, 7, 8, 2], [5, 6, 7, 9, 3], [5, 6, 0])
    assert index.speculate([5, 6], 4, min_prob=0.1).tokens == [7, 8, 1]  # 0.8, 0.6, 0.4
    assert index.speculate([5, 6], 4, min_prob=0.5).tokens == [7, 8]
    assert index.speculate([5, 6], 4, min_prob=0.7).tokens == [7]
    assert index.speculate([5, 6], 4, min_prob=0.9).tokens == []  # nothing confident: no draft
    assert index.speculate([5, 6], 2, min_prob=0.1).tokens == [7, 8]  # at most k


def test_a_single_occurrence_proposes_up_to_k_or_its_end():
    index = index_of([1, 2, 3, 4, 5, 6, 7, 8])
    assert index.speculate([9, 2, 3], 3, 0.3).tokens == [4, 5, 6]
    assert index.speculate([9, 6, 7], 5, 0.3).tokens == [8]  # the sequence ends: no more
    assert index.speculate([9, 7, 8], 5, 0.3).tokens == []


def test_spec_factor_bounds_a_proposal_by_its_matchs_length():
    """A 2-token match seen once proposes up to k, or at most spec_factor times 2; a longer match
    more; a bound under one token proposes nothing."""
    index = index_of([5, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9, 8, 7, 1, 2])
    assert index.speculate([0, 1, 2], 6, 0.1).tokens == [3, 4, 5, 6, 7, 8]
    assert index.speculate([0, 1, 2], 6, 0.1, spec_factor=1.0).tokens == [3, 4]  # "1 2": 2 tokens
    assert index.speculate([0, 1, 2], 6, 0.1, spec_factor=1.5).tokens == [3, 4, 5]
    assert index.speculate([5, 1, 2], 6, 0.1, spec_factor=1.0).tokens == [3, 4, 5]  # "5 1 2": 3 tokens
    assert index.speculate([0, 1, 2], 6, 0.1, spec_factor=0.4) == Speculation([])  # int(0.8) = 0
    proposer = SuffixProposer(spec_factor=1.0)
    proposer.add_output([5, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert propose(proposer, "f", [0, 1, 2], 6) == [3, 4]


def test_min_match_and_no_match():
    index = index_of([1, 2, 3, 4], min_match=3)
    assert index.speculate([2, 3], 2, 0.1).tokens == []  # a 2-token match is too short
    assert index.speculate([1, 2, 3], 2, 0.1).tokens == [4]
    assert index.speculate([4, 4, 4], 2, 0.1).tokens == []
    assert index.speculate([1, 2, 3], 0, 0.1).tokens == []


def test_matches_do_not_cross_sequences():
    index = index_of([1, 2], [3, 4, 5])
    assert index.match([2, 3, 4])[0] == 2  # "2 3 4" never occurred: the sentinel between stops it
    assert index.speculate([9, 1, 2], 2, 0.1).tokens == []  # nothing followed "1 2" in its sequence


def test_own_history_excludes_its_own_end_and_extends_incrementally():
    index = SuffixIndex()
    history = [1, 2, 3, 4, 1, 2]
    index.extend(history[:3])
    index.extend(history[3:])  # keys spanning the two appends are found
    assert index.speculate(history, 3, 0.1, own=True).tokens == [3, 4, 1]
    history += [3, 4, 1, 2]
    index.extend(history[6:])
    assert index.speculate(history, 2, 0.1, own=True).tokens == [3, 4]


def test_eviction_drops_oldest_sequences_and_holds_the_bound():
    index = SuffixIndex(max_tokens=50)
    rng = random.Random(0)
    for i in range(40):
        index.add([100 + i, 200 + i] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
        assert index.tokens_held <= 50 + index.sequences
    assert index.speculate([100, 200], 2, 0.1).tokens == []  # the first sequence is gone
    assert index.speculate([139, 239], 1, 0.1).tokens != []  # the last one is there
    assert all(p >= index._cut for positions in index._index.values() for p in positions)


def test_a_single_long_sequence_keeps_its_newest_tokens():
    index = SuffixIndex(max_tokens=100)
    for start in range(0, 1000, 7):
        index.extend(list(range(start, start + 7)))
    assert index.tokens_held <= 100
    assert index.speculate([5, 6], 1, 0.1).tokens == []
    assert index.speculate([990, 991], 2, 0.1).tokens == [992, 993]


def brute_successors(index: SuffixIndex, prefix: tuple[int, ...]) -> set[int]:
    return {key[-1] for key in index._index if key[:-1] == prefix}


@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_successors_follow_the_keys_through_additions_and_evictions(min_match):
    """`successors(prefix)` is the last tokens of the indexed keys that start with `prefix`, as
    sequences come, grow and are evicted (a small token budget)."""
    rng = random.Random(min_match)
    index = SuffixIndex(max_depth=6, min_match=min_match, max_tokens=60)
    prefixes = {tuple(rng.randrange(4) for _ in range(min_match - 1)) for _ in range(30)}
    for step in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        index.add(tokens) if rng.random() < 0.3 else index.extend(tokens)
        for prefix in prefixes:
            assert set(index.successors(prefix)) == brute_successors(index, prefix), (step, prefix)
    assert index.tokens_held <= 60 + index.sequences


@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_followers_hold_every_token_after_which_anything_is_speculated(min_match):
    """Exhaustively over a small vocabulary: whenever the context (a history, indexed, and a block,
    not yet), one token more, has a speculation from the session's index (as it will be after the
    round) or the corpus, that token is a follower; the list is sorted and unique, capped by
    `most`, and None at min_match 1."""
    rng = random.Random(10 + min_match)
    vocab, listed = 5, 0
    for _ in range(300):
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        block = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        budget = rng.choice([1000, 25])
        own = index_of(history, max_depth=8, min_match=min_match, max_tokens=budget)
        outputs = [[rng.randrange(vocab) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(0, 3))]
        corpus = index_of(*outputs, max_depth=8, min_match=min_match) if rng.random() < 0.7 else None
        found = followers(history + block, len(history), own, corpus, most=64)
        if min_match == 1:
            assert found is None
            continue
        assert found is not None and list(found) == sorted(set(found))
        listed += bool(found)
        for t in range(vocab):
            after = index_of(history, max_depth=8, min_match=min_match, max_tokens=budget)
            after.extend(block + [t])
            context = history + block + [t]
            spec = best_speculation(after.speculate(context, 4, 0.1, own=True),
                                    corpus.speculate(context, 4, 0.1) if corpus is not None else Speculation([]))
            if spec.tokens:
                assert t in found, (history, block, t, found)
        assert followers(history + block, len(history), own, corpus, most=len(found)) == found
        if found:
            assert followers(history + block, len(history), own, corpus, most=len(found) - 1) is None
    assert min_match == 1 or listed > 50  # (the cases are not all empty)


def test_a_context_shorter_than_a_match_has_no_followers():
    own = index_of([1, 2, 3], min_match=3)
    assert followers([1], 1, own, None, most=8) == ()
    assert followers([1, 2], 2, own, None, most=8) == (3,)


def test_best_speculation_prefers_more_expected_accepted_tokens():
    a, b = Speculation([1], 0.9, 5), Speculation([2, 3], 1.5, 2)
    assert best_speculation(a, b) is b
    assert best_speculation(Speculation([], 0, 0), Speculation([], 0, 0)).tokens == []


def test_encode_decode_round_trip():
    tokens = [0, 1, 151_643, 2**32 - 1]
    data = encode_output(tokens)
    assert len(data) == 16 and data[:4] == b"\x00\x00\x00\x00"
    assert decode_output(data) == tokens
    with pytest.raises(ValueError):
        decode_output(b"\x00\x01\x02")


def test_large_index_stays_correct_at_speed():
    """10^5 tokens indexed; many queries answer as a naive scan would (no timing asserted)."""
    rng = random.Random(1)
    corpus = [rng.randrange(30) for _ in range(100_000)]
    index = index_of(corpus, max_depth=6, min_match=2, max_candidates=10**6)
    for _ in range(8):
        context = [rng.randrange(30) for _ in range(10)]
        length, ends = index.match(context)
        best = 0
        for end in range(len(corpus)):
            n = 0
            while n < 6 and n <= end and corpus[end - n] == context[-1 - n]:
                n += 1
            best = max(best, n)
        assert length == (best if best >= 2 else 0)
        assert len(index.speculate(context, 8, 0.1).tokens) <= 8


# -- the proposer ----------------------------------------------------------------------------------


def propose(proposer: SuffixProposer, session: str, history: list[int], k: int, output_start: int = 0) -> list[int]:
    drafts = list(proposer.propose(session, history, k, SamplingParams(output_start=output_start), seed=0))
    assert all(d.probs is None for d in drafts)
    return [d.token_id for d in drafts]


def test_proposer_uses_the_session_history_then_the_corpus():
    proposer = SuffixProposer(min_prob=0.3)
    assert propose(proposer, "a", [1, 2, 3, 4], 3) == []
    assert propose(proposer, "a", [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # its own history
    assert propose(proposer, "b", [9, 1, 2], 3) == []  # another session does not see it
    proposer.add_output([7, 1, 2, 8, 8, 8])
    assert propose(proposer, "b", [9, 1, 2], 3) == [8, 8, 8]  # the corpus
    assert propose(proposer, "a", [1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # own: "4 1 2" is a longer match


def test_proposer_reindexes_a_history_that_does_not_extend_the_last():
    proposer = SuffixProposer()
    assert propose(proposer, "a", [1, 2, 3, 1, 2], 2) == [3, 1]
    assert propose(proposer, "a", [5, 6, 7, 5, 6], 2) == [7, 5]  # not [3, ...]: indexed afresh


def test_proposer_sessions_are_bounded_and_released():
    proposer = SuffixProposer(max_sessions=2, learn_on_release=True)
    for s in "abc":
        propose(proposer, s, [1, 2, 3], 1)
    assert list(proposer._sessions) == ["b", "c"]
    propose(proposer, "c", [1, 2, 3, 4, 5, 6], 1, output_start=3)
    assert proposer.forget("c") is True and proposer.forget("c") is False
    assert propose(proposer, "d", [0, 4, 5], 1) == [6]  # c's output joined the corpus on release


def test_a_steady_sessions_look_up_is_made_at_once_and_the_rest_on_the_worker_thread():
    """`propose_at_once` answers what `propose` would for a session indexed up to a few new tokens,
    and leaves to the worker thread a new session, a history that does not extend the indexed one,
    more than AT_ONCE_TOKENS new tokens, another group's request and a lock another thread holds."""
    proposer, reference = SuffixProposer(min_prob=0.3), SuffixProposer(min_prob=0.3)
    history = [1, 2, 3, 4, 1, 2]

    def request(tokens: list[int], session: str = "a", group: str = "") -> DraftRequest:
        return DraftRequest(session, tokens, 3, SamplingParams(), 0, corpus_group=group)

    assert proposer.propose_at_once(request(history)) is None  # a new session: its whole history to index
    propose(proposer, "a", history, 3)
    propose(reference, "a", history, 3)
    for grown in (history + [3], history + [3, 4, 1, 2], history + [3, 4, 1, 2, 9, 1]):
        drafts = proposer.propose_at_once(request(grown))
        assert drafts is not None and [d.token_id for d in drafts] == propose(reference, "a", grown, 3)
    assert proposer.propose_at_once(request([5, 6, 7])) is None  # does not extend it: indexed afresh
    assert proposer.propose_at_once(request(grown + list(range(20, 20 + AT_ONCE_TOKENS + 1)))) is None
    assert proposer.propose_at_once(request(grown + [3], group="other")) is None
    held = threading.Event()
    release = threading.Event()

    def hold():
        with proposer._lock:
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    try:
        assert proposer.propose_at_once(request(grown + [3])) is None  # the corpus is being fed, say
    finally:
        release.set()
        holder.join()
    assert proposer.propose_at_once(request(grown + [3])) is not None


async def test_a_suffix_block_lists_its_followers_from_the_session_and_its_groups_corpus():
    """The block a request gets names the tokens after which its history and block could be drafted
    anything: from the session's own history, the block itself, and its own group's corpus only;
    none when the session's index is not the history's, or past MAX_FOLLOWERS."""
    proposer = SuffixProposer(min_prob=0.3)
    proposer.add_output([7, 8, 9], group="g")
    proposer.add_output([7, 5], group="other")
    env = DraftEnv(ThreadPoolExecutor(max_workers=1), None)

    async def block(history: list[int], group: str = "g", session: str = "a"):
        drafted = await proposer.block(DraftRequest(session, history, 3, SamplingParams(), 0, corpus_group=group), env)
        return [d.token_id async for d, _ in drafted.tokens], drafted.followers

    assert await block([6, 7]) == ([], (8,))  # nothing matches "6 7"; the corpus has "7 8"
    assert await block([6, 7, 8]) == ([9], ())  # the corpus's "7 8 9"; nothing continues "9"
    assert await block([4, 4], session="b") == ([], (4,))  # its own "4 4" (its own end drafts nothing now)
    assert await block([3, 7], group="other", session="c") == ([], (5,))  # the other group's "7 5", not "7 8"
    assert await block([6, 7, 8, 9, 6, 7], session="a") == ([8, 9, 6], (7,))  # its own "6 7 8 9 6"
    many = list(range(100, 100 + MAX_FOLLOWERS + 1))
    history = [x for t in many for x in (0, t)] + [0]
    assert (await block(history, session="many"))[1] is None  # "0" is followed by 65 tokens: not listed
    request = DraftRequest("a", [6, 7, 8, 9, 5], 3, SamplingParams(), 0, corpus_group="g")
    assert proposer.followers(request, []) is None  # the session is indexed up to another history


async def test_a_release_the_orchestrator_marks_forget_output_does_not_join_the_corpus():
    proposer = SuffixProposer(learn_on_release=True)
    propose(proposer, "c", [1, 2, 3, 4, 5, 6], 1, output_start=3)
    assert await proposer.release("c", learn=False) is True
    assert propose(proposer, "d", [0, 4, 5], 1) == []  # c's output was forgotten with it
    propose(proposer, "e", [1, 2, 3, 4, 5, 6], 1, output_start=3)
    assert await proposer.release("e") is True
    assert propose(proposer, "d", [0, 4, 5], 1) == [6]  # the same output, learned when allowed


# -- one corpus per group ---------------------------------------------------------------------------


def propose_as(proposer: SuffixProposer, group: str, session: str, history: list[int], k: int) -> list[int]:
    return [d.token_id for d in proposer.propose(session, history, k, SamplingParams(), seed=0, group=group)]


def test_an_output_drafts_only_for_its_own_group():
    """A tenant's finished output must not draft another tenant's requests: with greedy decoding and a
    logit_bias on a candidate, `accepted >= 1` would reveal the corpus's next token, one by one."""
    proposer = SuffixProposer(min_prob=0.3)
    proposer.add_output([7, 1, 2, 8, 8, 8], group="alice")
    assert propose_as(proposer, "mallory", "m", [9, 1, 2], 3) == []
    assert propose_as(proposer, "", "anon", [9, 1, 2], 3) == []  # nor the anonymous group
    assert propose_as(proposer, "alice", "a", [9, 1, 2], 3) == [8, 8, 8]


async def test_a_released_session_teaches_only_its_own_group():
    proposer = SuffixProposer(learn_on_release=True)
    propose_as(proposer, "alice", "c", [1, 2, 3, 4, 5, 6], 1)
    assert await proposer.release("c") is True
    assert propose_as(proposer, "mallory", "d", [0, 4, 5], 1) == []
    assert propose_as(proposer, "alice", "e", [0, 4, 5], 1) == [6]


def test_the_corpora_share_one_token_budget_and_the_least_recently_used_group_goes_first():
    proposer = SuffixProposer(max_tokens=20)
    proposer.add_output([1, 2, 3, 4, 5, 6], group="a")
    proposer.add_output([1, 2, 3, 4, 5, 7], group="b")
    assert propose_as(proposer, "a", "s", [1, 2, 3], 1) == [4]  # "a" is now the more recently used
    proposer.add_output([1, 2, 3, 4, 5, 8, 9, 10, 11, 12], group="c")  # 6 + 6 + 10 (+ sentinels) > 20
    assert propose_as(proposer, "b", "t", [1, 2, 3, 4, 5], 1) == []  # b's corpus went
    assert propose_as(proposer, "a", "u", [1, 2, 3, 4, 5], 1) == [6]
    assert propose_as(proposer, "c", "v", [1, 2, 3, 4, 5], 1) == [8]
    assert proposer.corpora.tokens_held <= 20


@pytest.mark.parametrize("fields, reason", [
    ({OUTPUT_FIELD: encode_output([1, 2]), FINGERPRINT_FIELD: b"\xff"}, "malformed"),
    ({OUTPUT_FIELD: encode_output([1, 2]), GROUP_FIELD: b"\xc3("}, "malformed"),
    ({OUTPUT_FIELD: b"\x01\x00\x00"}, "malformed"),
    ({OUTPUT_FIELD: encode_output([1, 2]), FINGERPRINT_FIELD: b"other"}, "other_tokenizer"),
    ({OUTPUT_FIELD: b""}, "empty"),
    ({}, "empty"),
    ({OUTPUT_FIELD: encode_output([1, 100])}, "out_of_vocabulary"),
    ({OUTPUT_FIELD: encode_output([1, 2**32 - 1])}, "out_of_vocabulary"),
])
def test_a_stream_entry_that_cannot_join_a_corpus_says_why(fields, reason):
    with pytest.raises(SkippedEntry) as skipped:
        decode_entry(fields, "fp", vocab_size=100)
    assert skipped.value.reason == reason


def test_a_stream_entry_round_trips_with_its_group():
    assert decode_entry(encode_entry([1, 2, 99], "g1"), "fp", 100) == OutputEntry([1, 2, 99], "g1")
    assert decode_entry(encode_entry([2**31 - 1]), "fp") == OutputEntry([2**31 - 1], "")  # no vocabulary: int32
    assert decode_entry({**encode_entry([3]), FINGERPRINT_FIELD: b"fp"}, "fp", 100).tokens == [3]
