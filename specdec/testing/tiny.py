"""Small real transformers models built offline, for tests and benchmarks.

- `make_char_tokenizer`: a character-level tokenizer over printable ASCII (100 tokens).
- `make_tiny_model`: a seeded random Llama whose next-token distributions are peaked, so greedy
  text is not degenerate and sampling statistics mean something.
- `make_tiny_model(..., base=dir, perturb=x)`: a draft made by adding noise to a base model; its
  agreement with the base is dialled by `perturb` (0 → identical).
- `greedy_agreement`: how often a draft's greedy token matches the target's.
- `make_mismatched_tokenizer_model`: a copy whose tokenizer differs, to test refusal.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from specdec.runtime.models import LoadedModel, load_model

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _char_vocab(swap: tuple[str, str] | None = None) -> dict[str, int]:
    tokens = SPECIAL_TOKENS + ["\n", "\t"] + [chr(c) for c in range(32, 127)]
    vocab = {token: i for i, token in enumerate(tokens)}
    if swap is not None:
        a, b = swap
        vocab[a], vocab[b] = vocab[b], vocab[a]
    return vocab


def _build_char_tokenizer(swap: tuple[str, str] | None = None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(_char_vocab(swap), unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    backend.decoder = decoders.Fuse()  # join without spaces: decode(encode(s)) == s
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_char_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer (specials, newline, tab, printable ASCII); saved if out_dir given."""
    tokenizer = _build_char_tokenizer()
    if out_dir is not None:
        tokenizer.save_pretrained(out_dir)
    return tokenizer


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _load_weights(model_dir: str | Path) -> LlamaForCausalLM:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM), f"{model_dir} is not a Llama model"
    return model.eval()


@torch.no_grad()
def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_context: int = 512,
    logit_scale: float = 4.0,
    base: str | Path | None = None,
    perturb: float = 0.0,
) -> Path:
    """Build and save a tiny random Llama (float32 safetensors + char tokenizer + generation config).

    Weights are drawn with std 1/sqrt(hidden) so every layer matters (the next token depends on
    context, not only on the last token), and the lm_head rows are scaled so logits have a std of
    about `logit_scale`: distributions are peaked, not near-uniform.

    With `base`, the shape arguments and `logit_scale` are ignored: base's weights are copied and
    each tensor gets Gaussian noise of std `perturb × tensor.std()` (seeded by `seed`).
    """
    out = Path(out_dir)
    if base is not None:
        model = _load_weights(base)
        generator = torch.Generator().manual_seed(seed)
        if perturb > 0:
            for tensor in model.state_dict().values():  # tensors share storage with the parameters
                if tensor.numel() < 2 or not tensor.is_floating_point():
                    continue
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
                tensor.add_((noise * perturb * tensor.double().std()).to(tensor.dtype))
        return _save(model, AutoTokenizer.from_pretrained(base), out)

    tokenizer = _build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_context,
        initializer_range=1.0 / math.sqrt(hidden),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seed locally; leave the caller's RNG alone
        torch.manual_seed(seed)
        # transformers wraps `to` with functools.wraps, whose typing loses the bound `self`.
        model = LlamaForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]
        head = model.lm_head.weight  # [V, H]; final-norm output has unit RMS: logit std ≈ row std·sqrt(H)
        head.normal_(0.0, logit_scale / math.sqrt(hidden))  # peaked: eos (like any one token) is rare
    return _save(model, tokenizer, out)


def make_mismatched_tokenizer_model(out_dir: str | Path, base: str | Path) -> Path:
    """A copy of `base` whose tokenizer swaps the ids of 'a' and 'b': same size, other fingerprint."""
    model = _load_weights(base)
    return _save(model, _build_char_tokenizer(swap=("a", "b")), Path(out_dir))


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run with n intra-op threads: tiny forwards are slower, and erratic, with a contended pool."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def greedy_agreement(
    target_dir: str | Path, draft_dir: str | Path, prompts: Sequence[str], n_tokens: int
) -> float:
    """Fraction of positions where the draft's argmax equals the target's greedy token.

    Positions are those of the target's own greedy continuation of each prompt (up to
    `n_tokens` tokens, stopping early at eos), computed in float64.
    """
    target = load_model(str(target_dir), dtype="float64", progress=False)
    draft = load_model(str(draft_dir), dtype="float64", progress=False)
    if draft.fingerprint != target.fingerprint:
        raise ValueError(f"{draft_dir} and {target_dir} have different tokenizers; agreement is meaningless")
    with _torch_threads(1):
        matches, total = _count_agreement(target, draft, prompts, n_tokens)
    return matches / total if total else float("nan")


@torch.no_grad()
def _count_agreement(
    target: LoadedModel, draft: LoadedModel, prompts: Sequence[str], n_tokens: int
) -> tuple[int, int]:
    matches = total = 0
    for prompt in prompts:
        ids = target.tokenizer.encode(prompt, add_special_tokens=False) or [target.tokenizer.bos_token_id]
        prompt_len = len(ids)
        budget = min(n_tokens, target.max_context - prompt_len)
        for _ in range(budget):
            logits = target.model(torch.tensor([ids])).logits  # [1, S, V]
            next_id = int(logits[0, -1].argmax())
            ids.append(next_id)
            if next_id in target.eos_token_ids:
                break
        if len(ids) == prompt_len:
            continue
        draft_logits = draft.model(torch.tensor([ids[:-1]])).logits[0]  # [S-1, V]
        draft_argmax = draft_logits[prompt_len - 1 :].argmax(dim=-1)  # [n]
        continuation = torch.tensor(ids[prompt_len:])  # [n]
        matches += int((draft_argmax == continuation).sum())
        total += len(continuation)
    return matches, total
