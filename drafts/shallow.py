"""A shallow draft cut from the target: some of its layers, its embeddings, its norm and its head.

The draft has the target's architecture with fewer decoder layers (and optionally a narrower
MLP). Its embeddings and output layer are the target's own and stay frozen, so the draft speaks
in the target's token space from the first step; distillation then trains the copied layers
and the final norm to stand in for the layers that were left out.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

LAYER_STRATEGIES = ("first", "first-last", "even")
_LAYER_KEY = re.compile(r"^(?P<head>.*\.layers\.)(?P<index>\d+)(?P<tail>\..*)$")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def choose_layers(n_layers: int, count: int, strategy: str) -> list[int]:
    """Indices of `count` of the target's `n_layers` layers, in order.

    - `first`: the first `count` layers;
    - `first-last`: the first `count − 1` layers and the last one (the last layer maps the
      residual stream onto the vocabulary; keeping it keeps the head's input in familiar shape);
    - `even`: evenly spaced from the first to the last layer.
    """
    if not 1 <= count <= n_layers:
        raise ValueError(f"a draft needs between 1 and {n_layers} layers, got {count}")
    if strategy == "first":
        return list(range(count))
    if strategy == "first-last":
        return list(range(count - 1)) + [n_layers - 1]
    if strategy == "even":
        if count == 1:
            return [0]
        return sorted({round(i * (n_layers - 1) / (count - 1)) for i in range(count)})
    raise ValueError(f"unknown layer strategy {strategy!r}; choose one of {', '.join(LAYER_STRATEGIES)}")


def parse_layers(spec: str, n_layers: int) -> tuple[int, list[int] | None]:
    """`"4"` → (4, None): a count, the strategy picks which; `"0,1,2,29"` → (4, [0, 1, 2, 29])."""
    spec = str(spec).strip()
    if "," not in spec:
        try:
            count = int(spec)
        except ValueError:
            raise ValueError(
                f"--layers takes a count or a comma-separated list of layer indices, got {spec!r}") from None
        choose_layers(n_layers, count, "first")  # validates the range
        return count, None
    indices = [int(part) for part in spec.split(",") if part.strip()]
    if sorted(set(indices)) != indices or not indices or indices[0] < 0 or indices[-1] >= n_layers:
        raise ValueError(f"layer indices must be distinct, increasing and within 0..{n_layers - 1}, got {spec!r}")
    return len(indices), indices


def parse_width(spec: str | None, intermediate: int) -> int | None:
    """MLP width of the draft: None keeps the target's; `"768"` absolute; `"0.5"` a fraction."""
    if spec is None or str(spec).strip() == "":
        return None
    value = float(spec)
    width = round(value * intermediate) if value <= 1.0 and "." in str(spec) else int(value)
    if not 1 <= width <= intermediate:
        raise ValueError(f"--width must give between 1 and {intermediate} MLP units, got {spec!r}")
    return None if width == intermediate else width


def _mlp_keep(state: dict[str, torch.Tensor], prefix: str, width: int) -> torch.Tensor:
    """The `width` MLP units of one layer with the largest |gate|·|up|·|down| norms, in order."""
    try:
        gate, up, down = (state[prefix + name] for name in _MLP)
    except KeyError:
        raise ValueError("--width needs a Llama-style MLP (gate_proj, up_proj, down_proj)") from None
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)  # [I]
    return torch.topk(score, width).indices.sort().values


def make_shallow(target: PreTrainedModel, layers: list[int], width: int | None = None) -> PreTrainedModel:
    """A float32 model of the target's architecture holding `layers` of the target (in order),
    on the target's device.

    Everything outside the decoder layers (embeddings, final norm, output layer) is copied as
    is; tied embeddings stay tied. With `width`, each copied MLP keeps its `width` strongest units.
    """
    n_layers = target.config.num_hidden_layers
    if not layers or sorted(set(layers)) != list(layers) or layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"layers must be distinct, increasing and within 0..{n_layers - 1}, got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in layers]
    if width is not None:
        config.intermediate_size = width
    config.dtype = torch.float32
    device = target.get_output_embeddings().weight.device
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)  # tied weights stay tied

    source = {name: tensor.detach().to(torch.float32) for name, tensor in target.state_dict().items()}
    position = {old: new for new, old in enumerate(layers)}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in source.items():
        match = _LAYER_KEY.match(name)
        if match is None:
            state[name] = tensor
            continue
        old = int(match["index"])
        if old in position:
            state[f"{match['head']}{position[old]}{match['tail']}"] = tensor
    if width is not None:
        heads = {m["head"] for m in map(_LAYER_KEY.match, source) if m is not None}
        if len(heads) != 1:
            raise ValueError("--width needs a model with one stack of decoder layers")
        head = heads.pop()
        for new, old in enumerate(layers):
            src, dst = f"{head}{old}.", f"{head}{new}."
            keep = _mlp_keep(source, src, width)  # [width]
            state[dst + _MLP[0]] = source[src + _MLP[0]][keep]  # gate [width, H]
            state[dst + _MLP[1]] = source[src + _MLP[1]][keep]  # up [width, H]
            state[dst + _MLP[2]] = source[src + _MLP[2]][:, keep]  # down [H, width]
    draft.load_state_dict(state, strict=True)
    if getattr(target, "generation_config", None) is not None:
        draft.generation_config = GenerationConfig.from_dict(target.generation_config.to_dict())
    return draft.eval()


def freeze_shared(draft: PreTrainedModel) -> list[str]:
    """Freeze the embeddings and the output layer (the target's own); return the trainable names."""
    frozen = {id(draft.get_input_embeddings().weight)}
    head = draft.get_output_embeddings()
    if head is not None:
        frozen.add(id(head.weight))
    trainable = []
    for name, param in draft.named_parameters():
        param.requires_grad_(id(param) not in frozen)
        if param.requires_grad:
            trainable.append(name)
    return trainable


def layers_equal(target: PreTrainedModel, draft: PreTrainedModel, layers: list[int]) -> bool:
    """True when draft layer i holds exactly target layer `layers[i]` (before any training)."""
    t_layers = getattr(target, target.base_model_prefix).layers
    d_layers = getattr(draft, draft.base_model_prefix).layers
    for new, old in enumerate(layers):
        t_state, d_state = t_layers[old].state_dict(), d_layers[new].state_dict()
        if t_state.keys() != d_state.keys():
            return False
        if not all(torch.equal(t_state[k].to(torch.float32), d_state[k].to(torch.float32)) for k in t_state):
            return False
    return True


def save_draft(draft: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """A normal transformers checkpoint: safetensors weights, config, generation config, tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
