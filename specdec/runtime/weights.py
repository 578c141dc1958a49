"""The weights a service serves: quantized blocks run as stored, or float tensors, and what they are.

A model whose weights are quantized stays a transformers model (its config, norms, rotary embedding
and structure), with its projections replaced by `QuantizedLinear` modules and, where the embedding
is quantized too (a GGUF's tied q8_0 embedding / output layer), its embedding by a
`QuantizedEmbedding`. Both hold `quantized.QuantizedWeight` blocks and call the native kernels
(`csrc/quant.c`): float32 (or float64) activations, products and sums, each weight de-quantized in
registers to exactly its float32 value. No float copy of a quantized matrix is ever made, so the
model holds the bytes its file ships in. Anything that calls the model's modules (transformers'
own forward, `generate`) runs the same kernels; the packed pass (`packed.PackedForward`) fuses them
per layer through `projection.Projection`.

- `gguf_model(skeleton_config, gguf, dtype)`: a Llama GGUF's blocks (`quantized.load_gguf`) in a
  model built on the meta device, so the float32 matrices are never materialised;
- `quantize_model(model, bits, group)`: `--quantize int4|int8` for a float model, in place;
- `served(model, source)`: the `ServedWeights` a service reports (format, bytes, fingerprint);
- `output_layer(model)`: the device, activation dtype and width of the logits (whatever the head is).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specdec.core import quant
from specdec.runtime.quantized import GGUFWeights, QuantizedProjection, QuantizedWeight, embedding, quantize_linears

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

QUANTIZE_BITS = ("int4", "int8")
ACTIVATION_DTYPES = (torch.float32, torch.float64)
"""The activations the quantized kernels take (float32 sums, or float64 for exactness tests)."""


class QuantizedLinear(torch.nn.Module):
    """`x @ W.T` for a weight kept as quantized blocks (no bias), `x` `[..., in_features]` of `dtype`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"quantized weights run float32 or float64 activations, not {dtype}")
        self.qweight = weight  # a plain attribute: `.to()` and `state_dict()` leave the blocks alone
        self.out_features, self.in_features = weight.shape
        self.bias = None
        self.dtype = dtype
        self.projection = QuantizedProjection([weight])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        return self.projection(h).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.qweight.fmt.name}"


class QuantizedEmbedding(torch.nn.Module):
    """Rows of a quantized matrix `[vocab, hidden]` (a tied embedding), de-quantized as they are read."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = embedding(ids.reshape(-1).cpu(), self.qweight)  # [T, hidden] float32
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.qweight.fmt.name}"


QUANTIZED = (QuantizedLinear, QuantizedEmbedding)


def matrix(module: torch.nn.Module) -> torch.Tensor | QuantizedWeight:
    """The weight a linear module multiplies by: its quantized blocks, or its float tensor."""
    if isinstance(module, QUANTIZED):
        return module.qweight
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether any of the model's matrices are quantized blocks."""
    return any(isinstance(m, QUANTIZED) for m in model.modules())


def output_layer(model: PreTrainedModel) -> tuple[torch.device, torch.dtype, int]:
    """(device, dtype of the activations and logits, logits' width) of the model's output layer."""
    head = model.get_output_embeddings()
    if isinstance(head, QuantizedLinear):
        return torch.device("cpu"), head.dtype, head.out_features
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{type(model).__name__} has no output embeddings to score tokens with")
    return weight.device, weight.dtype, int(weight.shape[0])


# --------------------------------------------------------------------------- building


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def gguf_model(config: PretrainedConfig, gguf: GGUFWeights, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A Llama model of `config` whose matrices are the GGUF's blocks where a kernel runs them
    (`QuantizedLinear`, `QuantizedEmbedding`: the tied q8_0 embedding serves the output layer too,
    one copy), and float tensors of `dtype` for the rest (norms; blocks de-quantized at load). The
    skeleton is built on the meta device: no float matrix is allocated for what the blocks hold."""
    from transformers import AutoModelForCausalLM

    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"GGUF blocks run float32 or float64 activations, not {dtype}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = dict(gguf.tensors)
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        value = tensors.pop(key, None)
        if value is None:
            continue
        if isinstance(value, QuantizedWeight):
            if isinstance(module, torch.nn.Embedding):
                _set_module(model, name, QuantizedEmbedding(value, dtype))
            elif isinstance(module, torch.nn.Linear) and module.bias is None:
                _set_module(model, name, QuantizedLinear(value, dtype))
            else:
                raise ValueError(f"{key}: quantized blocks for a {type(module).__name__}")
        else:
            if tuple(value.shape) != tuple(module.weight.shape):
                raise ValueError(f"{key}: {list(value.shape)} in the file, {list(module.weight.shape)} in the model")
            module.weight = torch.nn.Parameter(value.to(dtype), requires_grad=False)
    if tensors:
        log.info("GGUF tensors the model does not use: %s", ", ".join(sorted(tensors)))
    base = model.model
    with torch.device("cpu"):  # its buffers, computed on the CPU
        base.rotary_emb = type(base.rotary_emb)(config)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if missing:
        raise ValueError(f"the GGUF file lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return model.eval()


def quantize_model(model: PreTrainedModel, bits: str, group: int) -> PreTrainedModel:
    """`--quantize int4|int8`: every bias-free linear layer of `model` (projections and the output
    layer) quantized in groups of `group` (`quantized.quantize_linears`) and replaced in place by a
    `QuantizedLinear` (float32 activations, or float64 for a float64 model); the float matrices
    are freed. A tied input embedding stays the float embedding (rows gathered, not read a step)."""
    if bits not in QUANTIZE_BITS:
        raise ValueError(f"--quantize takes {' or '.join(QUANTIZE_BITS)}, not {bits!r}")
    dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:  # untie: the head goes
        embed.weight = torch.nn.Parameter(embed.weight.detach().to(dtype), requires_grad=False)
    for name, weight in quantize_linears(model, bits, group).items():
        _set_module(model, name.removesuffix(".weight"), QuantizedLinear(weight, dtype))
    if dtype != next(model.parameters()).dtype:
        model.to(dtype)  # type: ignore[arg-type]  # the float parts that remain (norms, embedding) run in the activations' dtype
    model.config.tie_word_embeddings = False
    return model


# --------------------------------------------------------------------------- what is served


@dataclass(frozen=True)
class ServedWeights:
    """What a service's weights are, as GetInfo reports them.

    `format`: how they are stored and run, e.g. "gguf:q4_1+q8_0" (a GGUF's blocks, formats by
    bytes), "int4g128" (`--quantize int4 --quantize-group 128`, possibly "+float32" for layers it
    left), "float32", "bfloat16". `fingerprint`: 16 hex characters of sha256 over every stored
    tensor (names, formats, shapes, bytes): equal fingerprints, the same weights. `nbytes`: the
    bytes of every matrix a decode step reads (projections and output layer; a tied one once).
    `dequantized`: tensors whose blocks had no kernel and were de-quantized at load."""

    format: str
    fingerprint: str
    nbytes: int
    dequantized: dict[str, str] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return not self.format.startswith(("float", "bfloat"))


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every stored tensor of the model by name, shared ones once."""
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        own = [("weight", module.qweight)] if isinstance(module, QUANTIZED) else []
        own += [(n, t) for n, t in module.named_parameters(recurse=False)]
        own += [(n, t) for n, t in module.named_buffers(recurse=False) if n not in ("inv_freq", "original_inv_freq")]
        for part, tensor in own:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out[f"{name}.{part}" if name else part] = tensor
    return out


def _matrices(model: torch.nn.Module) -> list[torch.Tensor | QuantizedWeight]:
    """The matrices a decode step multiplies by: every linear layer's, the output layer's, once each."""
    found: dict[int, torch.Tensor | QuantizedWeight] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, torch.nn.Linear)):
            w = matrix(module)
            found[id(w)] = w
    return list(found.values())


def _nbytes(t: torch.Tensor | QuantizedWeight) -> int:
    return t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()


def _format_of(t: torch.Tensor | QuantizedWeight) -> str:
    return t.fmt.name if isinstance(t, QuantizedWeight) else str(t.dtype).removeprefix("torch.")


def served(model: torch.nn.Module, source: str = "", dequantized: dict[str, str] | None = None) -> ServedWeights:
    """The `ServedWeights` of a loaded model; `source` "gguf" for a GGUF's blocks (named so)."""
    matrices = _matrices(model)
    by_format: Counter[str] = Counter()
    for t in matrices:
        by_format[_format_of(t)] += _nbytes(t)
    label = "+".join(name for name, _ in by_format.most_common()) or "none"
    digest = hashlib.sha256()
    for name, t in sorted(_tensors(model).items()):
        raw = t.raw if isinstance(t, QuantizedWeight) else t.detach()
        shape = t.shape if isinstance(t, QuantizedWeight) else tuple(t.shape)
        digest.update(f"{name}\0{_format_of(t)}\0{list(shape)}\0".encode())
        digest.update(raw.reshape(-1).contiguous().cpu().view(torch.uint8).numpy())  # type: ignore[arg-type]
    return ServedWeights(f"{source}:{label}" if source else label, digest.hexdigest()[:16],
                         sum(_nbytes(t) for t in matrices), dict(dequantized or {}))


def quantized_format(bits: str, group: int) -> str:
    """The format name `--quantize bits --quantize-group group` stores (q4_1 / q8_0 at 32)."""
    return (quant.int4_format if bits == "int4" else quant.int8_format)(group).name
