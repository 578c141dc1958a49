"""Text the target writes itself, with its next-token distributions: the draft's training data.

Self-distillation needs the target's own outputs, not a corpus: the draft only ever has to
guess what *this* target says next. So the data is
- prompts: a given prompt file, or user turns the target invents itself (sampled from its chat
  template with an empty user turn), so that no hand-written prompt set is needed and held-out
  prompts (the bundled set by default) stay out of training;
- answers: the target's greedy (and, for a fraction, sampled) continuation of each prompt;
- teacher: at every answer position, the target's top-k log-probabilities (from the logits the
  generation computed anyway), enough for a top-k forward KL.

Generated once per (target, prompts, settings) and cached as safetensors + JSON, so drafts of
several depths train on the same text. The target generates on its own device; the data is kept
on the host (it is the cache), so text written on a GPU trains a draft anywhere, and back.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from specdec.runtime.models import LoadedModel

DATA_VERSION = 1
_SENTINEL = "@@SPECDEC-USER-TURN@@"


@dataclass
class TeacherData:
    """Sequences of token ids with the target's top-k next-token log-probs over a span of each.

    For sequence i, `top_ids[i][j]` / `top_logp[i][j]` describe the target's distribution of
    `tokens[i][start[i] + j + 1]` given `tokens[i][: start[i] + j + 1]`.
    """

    tokens: list[torch.Tensor]  # each [n_i] int64
    start: list[int]  # first position with a teacher distribution (prompt length − 1)
    top_ids: list[torch.Tensor]  # each [r_i, K] int64, r_i = n_i − 1 − start_i
    top_logp: list[torch.Tensor]  # each [r_i, K] float32, log-probs over the full vocabulary
    prompts: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def teacher_positions(self) -> int:
        return sum(int(t.shape[0]) for t in self.top_ids)

    @property
    def total_tokens(self) -> int:
        return sum(int(t.shape[0]) for t in self.tokens)

    def subset(self, indices: Sequence[int]) -> TeacherData:
        pick = list(indices)
        return TeacherData([self.tokens[i] for i in pick], [self.start[i] for i in pick],
                           [self.top_ids[i] for i in pick], [self.top_logp[i] for i in pick],
                           [self.prompts[i] for i in pick] if self.prompts else [], dict(self.meta))

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        lengths = torch.tensor([len(t) for t in self.tokens], dtype=torch.int64)
        spans = torch.tensor([len(t) for t in self.top_ids], dtype=torch.int64)
        k = self.top_ids[0].shape[1] if self.top_ids else 0
        tensors = {
            "tokens": torch.cat(self.tokens).to(torch.int32) if self.tokens else torch.zeros(0, dtype=torch.int32),
            "lengths": lengths,
            "start": torch.tensor(self.start, dtype=torch.int64),
            "spans": spans,
            "top_ids": (torch.cat(self.top_ids).to(torch.int32) if self.top_ids
                        else torch.zeros(0, k, dtype=torch.int32)),
            "top_logp": torch.cat(self.top_logp).to(torch.float32) if self.top_logp else torch.zeros(0, k),
        }
        save_file(tensors, str(folder / "data.safetensors"))
        (folder / "meta.json").write_text(json.dumps({"meta": self.meta, "prompts": self.prompts}, indent=1))

    @classmethod
    def load(cls, folder: Path) -> TeacherData:
        tensors = load_file(str(folder / "data.safetensors"))
        info = json.loads((folder / "meta.json").read_text())
        lengths, spans = tensors["lengths"].tolist(), tensors["spans"].tolist()
        tokens = [t.to(torch.int64) for t in torch.split(tensors["tokens"], lengths)]
        top_ids = [t.to(torch.int64) for t in torch.split(tensors["top_ids"], spans)]
        top_logp = list(torch.split(tensors["top_logp"], spans))
        return cls(tokens, tensors["start"].tolist(), top_ids, top_logp, info["prompts"], info["meta"])


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Seed the global generators (the host's and the device's) for one `generate` call, and put
    them back afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # seeds the CUDA generators too
        yield


# --------------------------------------------------------------------------- prompts


def load_prompt_file(path: str | Path) -> list[dict]:
    """Prompts from a file: JSON lines with `messages` (chat) or `prompt` (raw text), as in the
    bundled set; any other file is read as one user chat message per non-empty line."""
    text = Path(path).read_text(encoding="utf-8")
    items: list[dict] = []
    if str(path).endswith((".jsonl", ".json")):
        for n, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            item = json.loads(line)
            if "messages" not in item and "prompt" not in item:
                raise ValueError(f"{path}:{n + 1}: each line needs 'messages' or 'prompt'")
            items.append({"id": item.get("id", f"line-{n + 1}"), **item})
    else:
        for n, line in enumerate(text.splitlines()):
            if line.strip():
                items.append({"id": f"line-{n + 1}", "messages": [{"role": "user", "content": line.strip()}]})
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return items


def encode_prompt(tokenizer, item: dict) -> list[int]:
    """Token ids of a prompt exactly as the orchestrator encodes a new request."""
    if "messages" in item:
        text = tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(item["prompt"])["input_ids"])


def prompt_key(item: dict) -> str:
    return json.dumps(item.get("messages") or item.get("prompt"), sort_keys=True, ensure_ascii=False)


def _user_turn_frame(tokenizer) -> tuple[str, str]:
    """The chat text before a user message's content, and the marker that ends the content."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(_SENTINEL, 1)
    line = after.split("\n", 1)[0]
    return before, (line if line.strip() else "\n")


def invent_prompts(target: LoadedModel, count: int, *, seed: int, max_tokens: int = 48, batch_size: int = 16,
                   exclude: Sequence[dict] = (), progress: bool = True) -> list[dict]:
    """`count` distinct user turns sampled from the target itself (temperature 1, top-p 0.95).

    The target writes what its chat template puts after "user": questions and instructions in
    the style it was tuned on. Turns equal to one in `exclude` (the held-out set) are dropped.
    """
    tokenizer = target.tokenizer
    before, marker = _user_turn_frame(tokenizer)
    prefix = list(tokenizer(before, add_special_tokens=False)["input_ids"])
    excluded = {prompt_key(item) for item in exclude}
    found: list[dict] = []
    seen: set[str] = set()
    rounds, max_rounds = 0, 4 * max(1, -(-count // batch_size)) + 2
    generator_seed = seed
    with tqdm(total=count, desc="specdec: target invents prompts", unit="prompt", disable=not progress,
              file=sys.stderr) as bar:
        while len(found) < count and rounds < max_rounds:
            rounds += 1
            ids = torch.tensor([prefix] * batch_size, device=target.device)  # [B, P]: same prefix, no padding
            with _seeded(target.device, generator_seed), torch.inference_mode():
                generator_seed += 1
                out = target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=True,
                    temperature=1.0, top_p=0.95, top_k=0, eos_token_id=target.eos_token_ids,
                    pad_token_id=target.eos_token_ids[0])
            for row in out[:, len(prefix):].tolist():
                text = tokenizer.decode(row, skip_special_tokens=False).split(marker, 1)[0]
                for eos in target.eos_token_ids:
                    text = text.split(tokenizer.decode([eos]), 1)[0]
                content = text.strip()
                messages = [{"role": "user", "content": content}]
                key = prompt_key({"messages": messages})
                if not content or key in seen or key in excluded or len(found) >= count:
                    continue
                seen.add(key)
                found.append({"id": f"invented-{len(found)}", "messages": messages})
                bar.update()
    return found


# --------------------------------------------------------------------------- answers + teacher


def _trim_at_eos(row: list[int], eos: set[int]) -> int:
    for i, token in enumerate(row):
        if token in eos:
            return i + 1
    return len(row)


@torch.inference_mode()
def generate_teacher_data(target: LoadedModel, prompts: Sequence[dict], *, max_new_tokens: int, top_k: int,
                          sampled_fraction: float = 0.0, temperature: float = 0.8, batch_size: int = 8,
                          seed: int = 0, progress: bool = True, desc: str = "specdec: target writes answers",
                          ) -> TeacherData:
    """The target's continuation of every prompt with its top-k log-probs at every new position.

    A `sampled_fraction` of the prompts (chosen by seed) get a sampled continuation at
    `temperature`; the rest greedy. With `batch_size=1` nothing is padded, so greedy output is
    exactly what the target produces alone (use that for held-out reference text). Generation
    and the top-k run on the target's device; the returned data is on the host.
    """
    tokenizer = target.tokenizer
    eos = set(target.eos_token_ids)
    pad = target.eos_token_ids[0]
    encoded = [encode_prompt(tokenizer, item) for item in prompts]
    choice = torch.Generator().manual_seed(seed)
    sampled = (torch.rand(len(prompts), generator=choice) < sampled_fraction).tolist()
    order = sorted(range(len(prompts)), key=lambda i: (sampled[i], len(encoded[i])))  # similar lengths batch well
    results: dict[int, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = {}
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, file=sys.stderr) as bar:
        for first in range(0, len(order), batch_size):
            group = [i for i in order[first:first + batch_size]]
            groups = [[i for i in group if sampled[i] == flag] for flag in (False, True)]
            for members in (g for g in groups if g):
                width = max(len(encoded[i]) for i in members)
                ids = torch.full((len(members), width), pad, dtype=torch.long)  # [B, P] left-padded
                mask = torch.zeros_like(ids)
                for row, i in enumerate(members):
                    ids[row, width - len(encoded[i]):] = torch.tensor(encoded[i])
                    mask[row, width - len(encoded[i]):] = 1
                do_sample = sampled[members[0]]
                options = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if do_sample \
                    else {"do_sample": False}
                with _seeded(target.device, seed + first):
                    out = target.model.generate(
                        ids.to(target.device), attention_mask=mask.to(target.device), max_new_tokens=max_new_tokens,
                        eos_token_id=target.eos_token_ids, pad_token_id=pad, output_logits=True,
                        return_dict_in_generate=True, **options)
                logits = torch.stack(out.logits, dim=1).to(torch.float32)  # [B, R, V] raw target logits, on the device
                new = out.sequences[:, width:].cpu()  # [B, R]
                for row, i in enumerate(members):
                    keep = _trim_at_eos(new[row].tolist(), eos)
                    logp = torch.log_softmax(logits[row, :keep], dim=-1)  # [r, V]
                    top_logp, top_ids = (t.cpu() for t in torch.topk(logp, top_k, dim=-1))  # [r, K] each
                    tokens = torch.tensor(encoded[i] + new[row, :keep].tolist(), dtype=torch.long)
                    results[i] = (tokens, len(encoded[i]) - 1, top_ids, top_logp)
                del logits, out
            bar.update(len(group))
    tokens, start, top_ids, top_logp = zip(*(results[i] for i in range(len(prompts)))) if prompts else ([],) * 4
    return TeacherData(list(tokens), list(start), list(top_ids), list(top_logp), list(prompts),
                       {"sampled": [bool(s) for s in sampled]})


# --------------------------------------------------------------------------- cache


def _model_stamp(target: LoadedModel) -> dict:
    folder = Path(target.path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    # What is served too: a GGUF's blocks and its de-quantized float32 copy write different text.
    return {"path": str(folder.resolve()) if folder.is_dir() else target.path, "fingerprint": target.fingerprint,
            "weights": [[f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files],
            "served": f"{target.weights.format}:{target.weights.fingerprint}"}


def cached_teacher_data(cache: Path, target: LoadedModel, *, prompts: Sequence[dict] | None, invent: int,
                        max_new_tokens: int, top_k: int, sampled_fraction: float, seed: int,
                        exclude: Sequence[dict] = (), batch_size: int = 8, progress: bool = True,
                        kind: str = "train") -> tuple[TeacherData, bool]:
    """Teacher data from the cache, or generated now and cached; returns (data, was_cached).

    With `prompts` None, `invent` prompts are invented by the target (see `invent_prompts`).
    """
    settings = {"version": DATA_VERSION, "kind": kind, "model": _model_stamp(target),
                "prompts": [prompt_key(p) for p in prompts] if prompts is not None else None,
                "invent": invent if prompts is None else 0, "exclude": sorted(prompt_key(p) for p in exclude),
                "max_new_tokens": max_new_tokens, "top_k": top_k, "sampled_fraction": sampled_fraction,
                "seed": seed, "batch_size": batch_size}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache / f"{kind}-{key}"
    if (folder / "meta.json").is_file() and (folder / "data.safetensors").is_file():
        return TeacherData.load(folder), True
    started = time.perf_counter()
    if prompts is None:
        prompts = invent_prompts(target, invent, seed=seed, exclude=exclude, progress=progress)
        invented_s = time.perf_counter() - started
    else:
        invented_s = 0.0
    excluded = {prompt_key(p) for p in exclude}
    prompts = [p for p in prompts if prompt_key(p) not in excluded]
    if not prompts:
        raise ValueError("no training prompts left (all of them are in the held-out set)")
    data = generate_teacher_data(target, prompts, max_new_tokens=max_new_tokens, top_k=top_k,
                                 sampled_fraction=sampled_fraction, batch_size=batch_size, seed=seed,
                                 progress=progress,
                                 desc="specdec: target writes answers" if kind == "train" else f"specdec: {kind} text")
    data.meta.update({"settings": settings, "invent_seconds": round(invented_s, 1),
                      "seconds": round(time.perf_counter() - started, 1), "device": target.describe_device()})
    tmp = cache / f".tmp-{kind}-{key}-{os.getpid()}"
    data.save(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # a concurrent build finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return TeacherData.load(folder), True
    return data, False
