"""Distil a draft on the target's top-k distributions, within a wall-clock budget.

The loss at each position is the forward KL `KL(p ‖ q)` between the target's distribution `p`
and the draft's `q`, both coarsened to the target's top-k tokens plus one "everything else"
bucket: exact for the mass the target puts on its top k, and a lower bound of the full KL.
Forward KL (mode-covering) is what greedy and sampled acceptance both reward: the draft must
put mass where the target does.

Training runs on the draft's device (a GPU makes the budget worth far more tokens than a CPU);
the teacher data stays on the host and each batch moves over in one transfer.

Training state (trainable weights, AdamW moments, step, elapsed time, loss history) is written
as host safetensors + JSON every `checkpoint_every_s` and at the end, so a stopped build
resumes, on the same device or another.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from drafts.data import TeacherData

STATE_TENSORS = "state.safetensors"
STATE_JSON = "state.json"


def topk_kl(draft_logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Per-position `KL(p ‖ q)` over the target's top-k tokens plus the rest as one bucket.

    draft_logits: [N, V] raw draft logits; top_ids: [N, K] token ids; top_logp: [N, K] target
    log-probabilities (normalised over the full vocabulary). Returns [N].
    """
    assert draft_logits.dim() == 2 and top_ids.shape == top_logp.shape and top_ids.shape[0] == draft_logits.shape[0]
    # At least float32 (a bf16 draft's logits are widened), never narrowed (float64 stays).
    log_q = torch.log_softmax(draft_logits.to(torch.promote_types(draft_logits.dtype, torch.float32)), dim=-1)
    log_q_top = log_q.gather(1, top_ids)  # [N, K]
    p_top = top_logp.exp()  # [N, K]
    p_rest = (1.0 - p_top.sum(-1)).clamp_min(0.0)  # [N]
    q_rest = (-torch.expm1(torch.logsumexp(log_q_top, dim=-1))).clamp_min(1e-12)  # [N]
    kl_top = (p_top * (top_logp - log_q_top)).sum(-1)  # [N]
    kl_rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-12).log() - q_rest.log()), torch.zeros_like(p_rest))
    return kl_top + kl_rest


def _base(model: PreTrainedModel) -> torch.nn.Module:
    return getattr(model, model.base_model_prefix)


def batch_logits(model: PreTrainedModel, data: TeacherData, indices: list[int], *, head_sample: int = 0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft logits at the teacher positions of some sequences, with the matching teacher rows.

    Only the positions that have a teacher distribution go through the output layer (the
    costliest matrix of a shallow draft). Returns logits [N, C], top_ids [N, K] (columns of the
    logits) and top_logp [N, K].

    With `head_sample` > 0 (training only), the output layer is evaluated on C columns instead
    of the whole vocabulary: every token in the batch's teacher top-k, plus `head_sample` other
    tokens drawn uniformly, whose logits are offset by log(rest / head_sample) so that they
    stand in for all the tokens not drawn in the softmax normaliser (sampled softmax). That
    cuts the head's cost by the vocabulary / C ratio.

    The batch is assembled on the host (the teacher data lives there; the column draw uses the
    host `generator`, so a seed picks the same columns on any device) and moved to the model's
    device in one transfer per tensor; everything returned is on the model's device.
    """
    head = model.get_output_embeddings()
    device = head.weight.device
    width = max(len(data.tokens[i]) for i in indices)
    ids = torch.zeros((len(indices), width), dtype=torch.long)  # [B, S] right-padded
    mask = torch.zeros_like(ids)
    rows, cols = [], []
    for b, i in enumerate(indices):
        n = len(data.tokens[i])
        ids[b, :n] = data.tokens[i]
        mask[b, :n] = 1
        span = data.top_ids[i].shape[0]
        rows.append(torch.full((span,), b, dtype=torch.long))
        cols.append(torch.arange(data.start[i], data.start[i] + span))
    top_ids = torch.cat([data.top_ids[i] for i in indices])  # [N, K] on the host
    top_logp = torch.cat([data.top_logp[i] for i in indices]).to(device)  # [N, K]
    hidden = _base(model)(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [B, S, H]
    picked = hidden[torch.cat(rows).to(device), torch.cat(cols).to(device)]  # [N, H]
    vocab = head.weight.shape[0]
    if head_sample <= 0 or getattr(head, "bias", None) is not None:
        return head(picked), top_ids.to(device), top_logp  # [N, V]
    seen = torch.unique(top_ids)  # [U] sorted
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[seen] = False
    others = rest.nonzero().squeeze(1)  # [V - U]
    draw = min(head_sample, others.numel())
    if draw == 0:
        return head(picked), top_ids.to(device), top_logp
    drawn = others[torch.randperm(others.numel(), generator=generator)[:draw]]  # [D]
    columns = torch.cat([seen, drawn])  # [C] on the host
    offset = torch.zeros(columns.numel())
    offset[seen.numel():] = math.log(others.numel() / draw)
    logits = picked @ head.weight[columns.to(device)].T  # [N, C]
    return logits + offset.to(device), torch.searchsorted(seen, top_ids).to(device), top_logp


def token_batches(data: TeacherData, tokens_per_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of sequence indices, shuffled by (seed, epoch), packed up to a token budget."""
    order = list(range(len(data)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    batches, current, size = [], [], 0
    for i in order:
        n = len(data.tokens[i])
        if current and size + n > tokens_per_batch:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        batches.append(current)
    return batches


@torch.no_grad()
def evaluate(model: PreTrainedModel, data: TeacherData, tokens_per_batch: int = 2048) -> dict:
    """Mean top-k KL and greedy agreement (draft argmax == target argmax) over all teacher positions."""
    was_training = model.training
    model.eval()
    kl_sum, agree, count = 0.0, 0, 0
    for indices in token_batches(data, tokens_per_batch, seed=0, epoch=0):
        logits, top_ids, top_logp = batch_logits(model, data, sorted(indices))
        kl_sum += float(topk_kl(logits, top_ids, top_logp).sum())
        agree += int((logits.argmax(-1) == top_ids[:, 0]).sum())
        count += logits.shape[0]
    model.train(was_training)
    return {"kl": kl_sum / max(count, 1), "agreement": agree / max(count, 1), "positions": count}


@dataclass
class DistillConfig:
    budget_s: float  # wall-clock seconds of training (all sessions of a resumed build together)
    lr: float = 5e-4
    warmup_steps: int = 5
    min_lr_fraction: float = 0.1
    tokens_per_batch: int = 1024
    head_sample: int = 0  # > 0: sampled softmax over the teacher's tokens + this many others (see batch_logits)
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    checkpoint_every_s: float = 120.0
    validate_every_s: float = 60.0  # with validation data: evaluate this often (time not counted in the budget)
    keep_best: bool = True  # with validation data: end with the weights of the lowest validation KL
    seed: int = 0


@dataclass
class DistillResult:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    positions: int = 0
    epochs: float = 0.0
    losses: list[list[float]] = field(default_factory=list)  # [elapsed_s, step, mean loss since last point]
    validation: list[list[float]] = field(default_factory=list)  # [elapsed_s, step, KL, agreement]
    validation_seconds: float = 0.0  # spent evaluating, outside the budget
    best_step: int = 0  # the step whose weights the model ends with (keep_best), 0: untrained
    resumed_from_step: int = 0


def _lr_at(config: DistillConfig, step: int, elapsed: float) -> float:
    """Linear warm-up over steps, then cosine decay over the *time* budget down to min_lr_fraction."""
    warm = min(1.0, (step + 1) / max(1, config.warmup_steps))
    frac = min(1.0, elapsed / max(config.budget_s, 1e-9))
    floor = config.min_lr_fraction
    return config.lr * warm * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def _save_state(folder: Path, model: PreTrainedModel, optimizer: torch.optim.Optimizer,
                names: dict[torch.nn.Parameter, str], result: DistillResult, epoch: int, batch: int,
                best: dict[str, torch.Tensor] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # Host tensors on disk: a build trained on a GPU resumes on any device.
    tensors = {f"best/{name}": tensor.detach().cpu().contiguous() for name, tensor in (best or {}).items()}
    for param, name in names.items():
        tensors[f"param/{name}"] = param.detach().cpu().contiguous()
        state = optimizer.state.get(param, {})
        for slot in ("exp_avg", "exp_avg_sq"):
            if slot in state:
                tensors[f"{slot}/{name}"] = state[slot].cpu().contiguous()
    tmp = folder / (STATE_TENSORS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(folder / STATE_TENSORS)
    info = {"result": asdict(result), "epoch": epoch, "batch": batch}
    (folder / (STATE_JSON + ".tmp")).write_text(json.dumps(info))
    (folder / (STATE_JSON + ".tmp")).replace(folder / STATE_JSON)


def _load_state(folder: Path, optimizer: torch.optim.Optimizer,
                names: dict[torch.nn.Parameter, str]) -> tuple[DistillResult, int, int, dict[str, torch.Tensor]]:
    """The saved state, back on the device of the parameters (the weights, the Adam moments, the best weights)."""
    tensors = load_file(str(folder / STATE_TENSORS))  # host tensors
    info = json.loads((folder / STATE_JSON).read_text())
    result = DistillResult(**info["result"])
    device = next(iter(names)).device
    with torch.no_grad():
        for param, name in names.items():
            param.copy_(tensors[f"param/{name}"])
            if f"exp_avg/{name}" in tensors:
                # AdamW (not fused, not capturable) keeps its step count on the host.
                optimizer.state[param] = {"step": torch.tensor(float(result.steps)),
                                          "exp_avg": tensors[f"exp_avg/{name}"].to(param.device, copy=True),
                                          "exp_avg_sq": tensors[f"exp_avg_sq/{name}"].to(param.device, copy=True)}
    result.resumed_from_step = result.steps
    best = {key[len("best/"):]: value.to(device) for key, value in tensors.items() if key.startswith("best/")}
    return result, info["epoch"], info["batch"], best


def has_state(folder: Path) -> bool:
    return (folder / STATE_TENSORS).is_file() and (folder / STATE_JSON).is_file()


def distill(model: PreTrainedModel, data: TeacherData, config: DistillConfig, *, state_dir: Path | None = None,
            resume: bool = False, progress: bool = True, validation: TeacherData | None = None) -> DistillResult:
    """Train the model's trainable parameters on `data` until `config.budget_s` seconds are spent.

    With `validation` (held-in text: same source as `data`, not trained on), the draft is
    evaluated every `validate_every_s` and at the end; with `keep_best` it ends with the weights
    that had the lowest validation KL (the text is small, so long budgets overfit it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: every parameter is frozen")
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay)
    result, epoch, batch_index = DistillResult(), 0, 0
    best: dict[str, torch.Tensor] = {}
    if resume and state_dir is not None and has_state(state_dir):
        result, epoch, batch_index, best = _load_state(state_dir, optimizer, names)
    epoch_tokens = max(1, data.total_tokens)
    model.train()
    started = time.perf_counter() - result.seconds
    last_checkpoint = time.perf_counter()
    window: list[float] = []
    point_every = max(config.budget_s / 60, 1.0)  # about 60 points on the loss curve
    next_point = (result.losses[-1][0] + point_every) if result.losses else 0.0

    def batches() -> Iterator[tuple[int, int, list[int]]]:
        nonlocal epoch, batch_index
        while True:
            plan = token_batches(data, config.tokens_per_batch, config.seed, epoch)
            while batch_index < len(plan):
                yield epoch, batch_index, plan[batch_index]
                batch_index += 1
            epoch, batch_index = epoch + 1, 0

    sampler = torch.Generator().manual_seed(config.seed * 7919 + result.steps)  # host: same columns on any device
    total = math.ceil(config.budget_s)
    best_kl = min((v[2] for v in result.validation if v[1] == result.best_step), default=math.inf)
    last_validation = time.perf_counter()

    def validate() -> None:
        nonlocal started, best_kl, best, last_validation
        began = time.perf_counter()
        check = evaluate(model, validation)
        result.validation.append([round(result.seconds, 2), result.steps, round(check["kl"], 5),
                                  round(check["agreement"], 5)])
        if check["kl"] < best_kl:
            best_kl, result.best_step = check["kl"], result.steps
            best = {names[p]: p.detach().clone() for p in params}
        spent = time.perf_counter() - began
        started += spent  # evaluation time is not training time
        result.validation_seconds = round(result.validation_seconds + spent, 2)
        last_validation = time.perf_counter()

    if validation is not None and not result.validation:
        validate()  # the untrained draft: step 0
    bar = tqdm(total=total, initial=min(total, int(result.seconds)), desc="specdec: distilling", unit="s",
               disable=not progress, file=sys.stderr,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s {postfix}")
    shown = int(result.seconds)
    resume_point = (epoch, batch_index)  # the next batch to train on
    try:
        for epoch_now, index_now, indices in batches():
            elapsed = time.perf_counter() - started
            if elapsed >= config.budget_s:
                break
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(config, result.steps, elapsed)
            logits, top_ids, top_logp = batch_logits(model, data, indices, head_sample=config.head_sample,
                                                     generator=sampler)
            loss = topk_kl(logits, top_ids, top_logp).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            result.steps += 1
            resume_point = (epoch_now, index_now + 1)
            result.positions += logits.shape[0]
            result.tokens += sum(len(data.tokens[i]) for i in indices)
            last_loss = loss.item()
            window.append(last_loss)
            elapsed = time.perf_counter() - started
            result.seconds = elapsed
            if elapsed >= next_point or elapsed >= config.budget_s:
                result.losses.append([round(elapsed, 2), result.steps, round(sum(window) / len(window), 5)])
                window.clear()
                next_point = elapsed + point_every
            bar.set_postfix_str(f"step {result.steps} loss {last_loss:.3f}", refresh=False)
            advance = min(total, int(elapsed)) - shown
            if advance > 0:
                bar.update(advance)
                shown += advance
            if validation is not None and time.perf_counter() - last_validation >= config.validate_every_s:
                validate()
            if state_dir is not None and time.perf_counter() - last_checkpoint >= config.checkpoint_every_s:
                _save_state(state_dir, model, optimizer, names, result, *resume_point, best=best)
                last_checkpoint = time.perf_counter()
    finally:
        bar.close()
    if window:
        result.losses.append([round(result.seconds, 2), result.steps, round(sum(window) / len(window), 5)])
    result.epochs = round(result.tokens / epoch_tokens, 3)
    if validation is not None and (not result.validation or result.validation[-1][1] != result.steps):
        validate()
    if state_dir is not None:
        _save_state(state_dir, model, optimizer, names, result, *resume_point, best=best)
    if validation is not None and config.keep_best and best and result.best_step != result.steps:
        with torch.no_grad():
            for param in params:
                param.copy_(best[names[param]])
    elif validation is None or not config.keep_best:
        result.best_step = result.steps
    model.eval()
    return result
