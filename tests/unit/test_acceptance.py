"""Tests for specdec.core.acceptance: greedy tables, sampling edge cases, and statistical
checks that rejection sampling is lossless (emitted tokens follow the target's `p`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.core.acceptance import Verdict, verify, verify_greedy, verify_sampling
from specdec.core.sampling import SamplingParams, derive_generator, logits_to_probs, sample

V = 6
ALPHA = 1e-3  # significance of the chi-square tests; seeds are fixed so results are too
TRIALS = 4_000  # generations per statistical test: >= 30 expected counts in every cell


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """These tensors are tiny: intra-op threads only add overhead (and stalls on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _logits_with_argmax(argmax: Sequence[int], vocab: int = V) -> torch.Tensor:
    """Rows `[len(argmax), vocab]` of noise with a clear maximum at each given id."""
    logits = torch.rand(len(argmax), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), torch.tensor(argmax, dtype=torch.long)] = 5.0
    return logits


def _probs(*rows: Sequence[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- Verdict ------------------------------------------------------------------------------


def test_verdict_emitted_is_accepted_prefix_then_token() -> None:
    assert Verdict(num_accepted=2, token=9, bonus=False).emitted([4, 5, 6]) == [4, 5, 9]
    all_accepted = Verdict(num_accepted=3, token=9, bonus=True)
    assert all_accepted.emitted(torch.tensor([4, 5, 6])) == [4, 5, 6, 9]
    assert Verdict(num_accepted=0, token=9, bonus=True).emitted([]) == [9]


# --- greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argmax, drafts, expected",
    [
        ([3, 1, 4, 2], [3, 1, 4], Verdict(3, 2, bonus=True)),  # perfect match: bonus
        ([3, 1, 4, 2], [0, 1, 4], Verdict(0, 3, bonus=False)),  # mismatch at 0: recovered
        ([3, 1, 4, 2], [3, 5, 4], Verdict(1, 1, bonus=False)),  # mismatch in the middle
        ([3, 1, 4, 2], [3, 1, 0], Verdict(2, 4, bonus=False)),  # mismatch at the last draft
        ([5], [], Verdict(0, 5, bonus=True)),  # k = 0: plain decoding
    ],
)
def test_verify_greedy_table(argmax: list[int], drafts: list[int], expected: Verdict) -> None:
    logits = _logits_with_argmax(argmax)
    assert verify_greedy(logits, torch.tensor(drafts, dtype=torch.long)) == expected
    assert verify(logits, drafts, None, SamplingParams(), None) == expected


def test_verify_greedy_breaks_ties_to_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0], [1.0, 1.0, 0.0]])
    assert verify_greedy(logits, [2]) == Verdict(0, 1, bonus=False)
    assert verify_greedy(logits, [1]) == Verdict(1, 0, bonus=True)


def test_verify_greedy_ignores_draft_probs() -> None:
    logits = _logits_with_argmax([1, 2])
    q = _probs([0, 0, 0, 0, 0, 1])  # nonsense q must not matter when greedy
    assert verify(logits, [1], q, SamplingParams(temperature=0.0), None) == Verdict(1, 2, True)


# --- sampling: edge cases and determinism -------------------------------------------------


def _random_block(
    seed: int, k: int, vocab: int = 10
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random p `[k+1, V]`, q `[k, V]` and draft tokens `x_i ~ q_i`."""
    g = _gen(seed)
    p = torch.softmax(2 * torch.randn(k + 1, vocab, generator=g, dtype=torch.float64), dim=1)
    q = torch.softmax(2 * torch.randn(k, vocab, generator=g, dtype=torch.float64), dim=1)
    drafts = [sample(q[i], g) for i in range(k)]
    return p, q, drafts


@pytest.mark.parametrize("seed", range(10))
def test_verify_sampling_is_reproducible_from_the_seed(seed: int) -> None:
    p, q, drafts = _random_block(seed, k=4)
    first = verify_sampling(p, q, drafts, derive_generator(seed, 100, 2))
    assert verify_sampling(p, q, drafts, derive_generator(seed, 100, 2)) == first
    assert verify_sampling(p, q, torch.tensor(drafts), derive_generator(seed, 100, 2)) == first


def test_verify_sampling_seeds_give_varied_verdicts() -> None:
    p, q, drafts = _random_block(3, k=4)
    verdicts = {verify_sampling(p, q, drafts, derive_generator(s, 0, 2)) for s in range(50)}
    assert len(verdicts) > 3


def test_q_equal_to_p_accepts_everything() -> None:
    p, _, _ = _random_block(1, k=3)
    g = _gen(5)
    for _ in range(300):
        drafts = [sample(p[i], g) for i in range(3)]
        verdict = verify_sampling(p, p[:3], drafts, g)
        assert verdict.num_accepted == 3 and verdict.bonus


def test_zero_target_mass_on_a_draft_token_is_always_rejected() -> None:
    p = _probs([0.2, 0.3, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0], [0.25] * 4)
    q = _probs([0.2, 0.3, 0.5, 0.0], [0.7, 0.1, 0.1, 0.1])
    g = _gen(7)
    for _ in range(300):
        verdict = verify_sampling(p, q, [2, 0], g)  # draft 0 has p == q, draft 1 has p = 0
        assert verdict == Verdict(1, verdict.token, bonus=False)
        assert verdict.token in (1, 2)  # the residual max(0, p - q) lives on {1, 2}


def test_deterministic_draft_uses_p_as_acceptance_and_removes_x_from_residual() -> None:
    p = _probs([0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.1, 0.2, 0.7])
    g = _gen(11)
    outcomes = set()
    for _ in range(200):
        verdict = verify_sampling(p, None, [0, 2], g)
        outcomes.add((verdict.num_accepted, verdict.bonus))
        if verdict.num_accepted == 0:
            assert verdict.token == 1  # p_0 with the draft token 0 removed
    assert outcomes == {(0, False), (2, True)}
    for _ in range(50):  # p_0(2) = 0: always rejected, recovered from {0, 1}
        verdict = verify_sampling(p, None, [2, 0], g)
        assert verdict.num_accepted == 0 and verdict.token in (0, 1)


@pytest.mark.parametrize("seed", range(5))
def test_deterministic_draft_matches_an_explicit_one_hot_q(seed: int) -> None:
    p, _, _ = _random_block(seed, k=3)
    drafts = [int(t) for t in torch.randint(0, 10, (3,), generator=_gen(seed))]
    one_hot = torch.nn.functional.one_hot(torch.tensor(drafts), 10).to(torch.float64)  # [k, V]
    for position in range(20):
        expected = verify_sampling(p, one_hot, drafts, derive_generator(seed, position, 2))
        assert verify_sampling(p, None, drafts, derive_generator(seed, position, 2)) == expected


def test_certain_target_accepts_deterministic_draft() -> None:
    p = _probs([0, 1, 0], [0, 0, 1], [1, 0, 0])
    for seed in range(20):
        assert verify_sampling(p, None, [1, 2], _gen(seed)) == Verdict(2, 0, bonus=True)


def test_empty_residual_falls_back_to_p() -> None:
    # q's row sums to 1 + 5e-5 (allowed rounding), so max(0, p - q) is all zero.
    p = _probs([0.0, 0.5, 0.5], [1.0, 0.0, 0.0])
    q = _probs([5e-5, 0.5, 0.5])
    g = _gen(2)
    tokens = {verify_sampling(p, q, [0], g).token for _ in range(100)}
    assert tokens == {1, 2}


def test_k_zero_samples_the_bonus_from_p() -> None:
    p = _probs([0.0, 0.0, 1.0])
    assert verify_sampling(p, None, [], _gen()) == Verdict(0, 2, bonus=True)
    empty_q = torch.zeros(0, 3, dtype=torch.float64)  # [k=0, V]
    assert verify_sampling(p, empty_q, [], _gen()) == Verdict(0, 2, bonus=True)


@pytest.mark.parametrize(
    "p, q, drafts, message",
    [
        (_probs([0.5, 0.5]), None, [0], "rows"),  # k+1 rows expected
        (_probs([0.5, 0.5], [0.5, 0.5]), _probs([0.5, 0.25, 0.25]), [0], "q must be"),  # V differs
        (_probs([0.5, 0.5], [0.5, 0.5]), _probs([0.5, 0.4]), [0], "sum to 1"),
        (_probs([0.5, 0.6], [0.5, 0.5]), None, [0], "sum to 1"),
        (_probs([0.5, 0.5], [0.5, 0.5]), _probs([1.5, -0.5]), [0], "non-negative"),
        (_probs([0.5, 0.5], [0.5, 0.5]), None, [2], "draft token ids"),
        (_probs([0.5, 0.5], [0.5, 0.5]), None, [-1], "draft token ids"),
        (_probs([0.5, 0.5], [0.5, 0.5]), _probs([1.0, 0.0]), [1], "q > 0"),
        (_probs([0.5, 0.5], [0.5, 0.5]), None, [[0]], r"\[k\]"),
        (torch.ones(4, dtype=torch.float64), None, [], r"\[k\+1, V\]"),
    ],
)
def test_verify_sampling_rejects_bad_shapes(
    p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        verify_sampling(p, q, drafts, _gen())


def test_verify_requires_a_generator_when_sampling() -> None:
    with pytest.raises(ValueError, match="generator"):
        verify(torch.zeros(2, 3), [0], None, SamplingParams(temperature=1.0), None)


def test_verify_greedy_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="rows"):
        verify_greedy(torch.zeros(3, 4), [0])
    with pytest.raises(ValueError, match="draft token ids"):
        verify_greedy(torch.zeros(2, 4), [4])


# --- sampling: losslessness (chi-square) --------------------------------------------------
#
# The target's rows are crafted independent of the prefix: position j always has
# distribution P[j], and the draft's Q[j]. A generation of two tokens runs rounds of
# speculation until two tokens are out; each round starts at the position reached so far.
# If the rule is lossless the pair (t1, t2) follows P[0] x P[1].

Rule = Callable[[torch.Tensor, "torch.Tensor | None", list[int], torch.Generator], Verdict]

P_BASE = _probs(
    [0.35, 0.25, 0.20, 0.12, 0.08],
    [0.10, 0.30, 0.15, 0.25, 0.20],
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.40, 0.10, 0.10, 0.10, 0.30],
    [0.15, 0.15, 0.40, 0.20, 0.10],
)
Q_NEAR = torch.softmax(0.8 * torch.log(P_BASE[:4]), dim=1)  # a flatter copy of p
Q_FAR = _probs(  # mass where p has little, zeros where p has much
    [0.00, 0.05, 0.10, 0.25, 0.60],
    [0.60, 0.00, 0.30, 0.05, 0.05],
    [0.90, 0.10, 0.00, 0.00, 0.00],
    [0.00, 0.50, 0.50, 0.00, 0.00],
)
P_SPARSE = _probs(  # p with holes, some where q puts mass
    [0.50, 0.30, 0.20, 0.00, 0.00],
    [0.00, 0.20, 0.30, 0.50, 0.00],
    [0.30, 0.00, 0.00, 0.30, 0.40],
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.00, 0.00, 0.60, 0.00, 0.40],
)
Q_SPARSE = _probs(
    [0.00, 0.10, 0.30, 0.40, 0.20],
    [0.25, 0.25, 0.25, 0.25, 0.00],
    [0.20, 0.20, 0.20, 0.20, 0.20],
)
DRAFT_IDS = [0, 3, 2, 1]  # a deterministic draft's proposal at each position


def _generate_two(
    rule: Rule, target: torch.Tensor, q: torch.Tensor | None, k: int, trials: int
) -> np.ndarray:
    """Counts `[V, V]` of the first two tokens over `trials` seeded generations.

    target: `[k+2, V]` rows (logits or p) for positions 0..k+1; q: `[k+1, V]` or None.
    """
    assert target.shape[0] >= k + 2 and (q is None or q.shape[0] >= k + 1)
    vocab = target.shape[1]
    verify_gen = _gen(1)
    if q is None:
        draws = [[DRAFT_IDS[j]] * 2 * trials for j in range(len(DRAFT_IDS))]
    else:  # draws[j][2 * t + r]: the draft's token at position j in round r of trial t
        draft_gen = _gen(2)
        draws = [
            torch.multinomial(q[j], 2 * trials, replacement=True, generator=draft_gen).tolist()
            for j in range(k + 1)
        ]
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for t in range(trials):
        out: list[int] = []
        for r in range(2):
            pos = len(out)  # 0, or 1 when the first round emitted a single token
            drafts = [draws[pos + i][2 * t + r] for i in range(k)]
            q_block = None if q is None else q[pos : pos + k]
            out += rule(target[pos : pos + k + 1], q_block, drafts, verify_gen).emitted(drafts)
            if len(out) >= 2:
                break
        counts[out[0], out[1]] += 1
    return counts


def _pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value that `counts` were drawn from `probs` (0 if outside the support)."""
    counts, probs = counts.ravel(), probs.ravel()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def _check_lossless(counts: np.ndarray, p0: torch.Tensor, p1: torch.Tensor) -> None:
    p0_np, p1_np = p0.numpy(), p1.numpy()
    first = _pvalue(counts.sum(axis=1), p0_np)
    pair = _pvalue(counts, np.outer(p0_np, p1_np))
    assert first > ALPHA, f"first token is not distributed as p_0 (p-value {first:.2e})"
    assert pair > ALPHA, f"(t1, t2) is not distributed as p_0 x p_1 (p-value {pair:.2e})"


@pytest.mark.parametrize(
    "p, q, k",
    [
        pytest.param(P_BASE, Q_FAR, 2, id="far-k2"),
        pytest.param(P_BASE, Q_NEAR, 3, id="near-k3"),
        pytest.param(P_SPARSE, Q_SPARSE, 2, id="sparse-k2"),
        pytest.param(P_SPARSE, None, 3, id="deterministic-draft-sparse-k3"),
    ],
)
def test_rejection_sampling_is_lossless(p: torch.Tensor, q: torch.Tensor | None, k: int) -> None:
    counts = _generate_two(verify_sampling, p, q, k, trials=TRIALS)
    _check_lossless(counts, p[0], p[1])


def test_verify_with_temperature_top_k_top_p_is_lossless() -> None:
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    target_logits = torch.tensor(  # [k+2, V]: rows for positions 0, 1, 2
        [
            [2.0, 1.5, 1.2, 0.8, 0.5, 0.1, -1.0, -2.0],
            [0.3, 1.8, -0.5, 1.0, 1.4, 0.9, 0.0, -1.0],
            [1.0, 1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0],
        ]
    )
    draft_logits = torch.tensor(  # [k+1, V]: a draft that likes tokens the target cuts
        [
            [0.5, 2.0, 0.2, 1.5, 0.0, 1.0, 0.8, -1.0],
            [1.0, 0.0, 1.2, 0.2, 1.6, -0.3, 0.5, 0.4],
        ]
    )
    q = logits_to_probs(draft_logits, params)  # the draft applies the same params

    def rule(
        logits: torch.Tensor, q_block: torch.Tensor | None, drafts: list[int], g: torch.Generator
    ) -> Verdict:
        return verify(logits, drafts, q_block, params, g)

    counts = _generate_two(rule, target_logits, q, 1, trials=TRIALS)
    p = logits_to_probs(target_logits, params)
    assert int((p[0] > 0).sum()) < 8 and bool((q[0][p[0] == 0] > 0).any())  # cuts differ
    _check_lossless(counts, p[0], p[1])


# --- the statistical test has power: wrong rules fail it ----------------------------------


def _always_accept(
    p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], g: torch.Generator
) -> Verdict:
    return Verdict(num_accepted=len(drafts), token=sample(p[len(drafts)], g), bonus=True)


def _recover_from_p(
    p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], g: torch.Generator
) -> Verdict:
    """Right acceptance test, wrong recovery: samples p_i instead of norm(max(0, p_i - q_i))."""
    assert q is not None
    for i, x in enumerate(drafts):
        u = float(torch.rand((), generator=g, dtype=torch.float64))
        if u * float(q[i, x]) >= float(p[i, x]):
            return Verdict(num_accepted=i, token=sample(p[i], g), bonus=False)
    return Verdict(num_accepted=len(drafts), token=sample(p[len(drafts)], g), bonus=True)


def _bonus_from_row_0(
    p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], g: torch.Generator
) -> Verdict:
    """Right for the first token, wrong bonus: samples it from p_0 instead of p_k."""
    return verify_sampling(torch.cat([p[:-1], p[:1]]), q, drafts, g)


@pytest.mark.parametrize(
    "wrong_rule, k",
    [(_always_accept, 2), (_recover_from_p, 2), (_bonus_from_row_0, 1)],
)
def test_chi_square_check_catches_a_wrong_rule(wrong_rule: Rule, k: int) -> None:
    counts = _generate_two(wrong_rule, P_BASE, Q_NEAR if k == 1 else Q_FAR, k, trials=3_000)
    with pytest.raises(AssertionError, match="not distributed"):
        _check_lossless(counts, P_BASE[0], P_BASE[1])
