"""Quantized weights executed as they are stored: GGUF blocks loaded without de-quantizing, and the
native kernels (`csrc/quant.c`) that multiply float activations by them.

- `QuantizedWeight`: a matrix `[n, k]` as raw blocks (`specdec.core.quant` formats) with
  `dequantize()`: the float32 matrix transformers' GGUF loader would have made of it.
- `QuantizedProjection(weights)(x, out)`: `out` = `x` times each weight transposed, side by side
  (the fused q/k/v or gate/up of a layer), like `native.linear` for float32 weights; float32 or
  float64 activations, any number of rows; `linear(x, weights, out)` the same, prepared for one
  call. Every weight is de-quantized in registers to exactly its float32 value; products and sums
  are in the activations' dtype.
- `embedding(ids, weight)`: rows of a quantized matrix (a tied embedding / LM head).
- `load_gguf(path)`: a Llama GGUF's tensors under transformers' parameter names, projections as
  `QuantizedWeight`s (q/k rows permuted as transformers permutes them), norms as float32; K-quants
  and other block types de-quantized at load (listed in `GGUFWeights.dequantized`, logged).
- `QuantizedWeight.quantize(weight, "int4" | "int8", group)`, `quantize_linears(model, bits,
  group)`: weight-only quantization of a float matrix, of a model's linear layers.
"""

from __future__ import annotations

import ctypes
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.core import quant
from specdec.core.quant import BlockFormat
from specdec.runtime import native

log = logging.getLogger(__name__)

_KINDS = {"sym4": 0, "asym4": 1, "sym8": 2}  # quant.c's SYM4, ASYM4, SYM8
CHUNK_ROWS = 48
"""Most input rows one kernel call takes; larger passes run in chunks (each rereads the weights,
from memory; the chunk's rows stay in cache)."""


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A matrix `[n, k]` in blocks of `fmt`: `raw` is uint8 `[n, fmt.row_bytes(k)]`, row after row."""

    raw: torch.Tensor
    fmt: BlockFormat
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != (n, self.fmt.row_bytes(k)):
            raise ValueError(f"{self.fmt.name} {list(self.shape)} is uint8 [{n}, {self.fmt.row_bytes(k)}], not "
                             f"{str(self.raw.dtype).removeprefix('torch.')} {list(self.raw.shape)}")
        if not self.raw.is_contiguous() or self.raw.device.type != "cpu":
            raise ValueError("quantized weights are contiguous CPU tensors")
        if not np.isfinite(quant.scales(self.raw, self.fmt, self.shape)).all():
            raise ValueError(f"{self.fmt.name} {list(self.shape)}: a block has a non-finite scale or minimum")

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix `[n, k]` (what transformers' GGUF loader holds for it)."""
        return quant.dequantize(self.raw, self.fmt, self.shape)

    def permute_rows(self, index: torch.Tensor | np.ndarray) -> QuantizedWeight:
        """Row i of the result is row `index[i]` of this one (rows are whole blocks: no re-quantizing)."""
        # numpy: ~50x torch's uint8 gather
        rows = np.ascontiguousarray(self.raw.numpy()[np.asarray(index, dtype=np.int64)])
        return QuantizedWeight(torch.from_numpy(rows), self.fmt, self.shape)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bits: str, group: int = quant.SUB) -> QuantizedWeight:
        """`weight` `[n, k]` quantized to `bits` ("int4": asymmetric, "int8": symmetric) in groups of `group`."""
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        if bits == "int4":
            return cls(quant.quantize_int4(weight, group), quant.int4_format(group), shape)
        if bits == "int8":
            return cls(quant.quantize_int8(weight, group), quant.int8_format(group), shape)
        raise ValueError(f"quantize takes int4 or int8, not {bits!r}")


# --------------------------------------------------------------------------- the kernels


class _Spec(ctypes.Structure):
    """quant.c's `specdec_qweight`: one weight of a call."""

    _fields_ = [("kind", ctypes.c_int32), ("group", ctypes.c_int32), ("n", ctypes.c_int32),
                ("unused", ctypes.c_int32), ("w_t", ctypes.c_int64), ("column", ctypes.c_int64),
                ("w", ctypes.c_void_p)]


MOST_WEIGHTS = 16  # quant.c's MOST_WEIGHTS: weights one call takes side by side


def _library() -> Any:
    lib, why = native.library()
    if lib is None:
        raise RuntimeError(why)
    if not getattr(lib, "_specdec_quant_typed", False):
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        for name in ("specdec_qlinear_many_f32", "specdec_qlinear_many_f64"):
            fn = getattr(lib, name)
            fn.restype = i32
            fn.argtypes = [i32, ptr, i32, i32, ptr, i64, ptr, i64, i32]
        lib.specdec_qrows_f32.restype = i32
        lib.specdec_qrows_f32.argtypes = [i32, i32, i32, ptr, i32, ptr, i64, ptr, i64, i32]
        lib._specdec_quant_typed = True
    return lib


def unavailable(fmt: BlockFormat, dtype: torch.dtype) -> str:
    """Why `linear` cannot run weights of `fmt` with activations of `dtype` here ("" when it can)."""
    if not fmt.native:
        return f"{fmt.name} has no native kernel (de-quantize it at load)"
    if dtype not in (torch.float32, torch.float64):
        return f"the quantized kernels take float32 or float64 activations, not {str(dtype).removeprefix('torch.')}"
    return native.library()[1]


class QuantizedProjection:
    """`x @ W.T` for one quantized weight, or several side by side (a layer's fused q/k/v or gate/up),
    prepared once: each call is one call into the kernels and one parallel region (a decode step of
    SmolLM2-135M is 121 of them; `linear` prepares one for each call, ~10 us more). Built where the
    kernels it calls are the library `native.library()` gives at that moment.

    `sizes`, `width`: each weight's outputs and their sum (the output's columns, weight after weight)."""

    def __init__(self, weights: list[QuantizedWeight]) -> None:
        if not 1 <= len(weights) <= MOST_WEIGHTS:
            raise ValueError(f"a projection takes 1 to {MOST_WEIGHTS} weights, not {len(weights)}")
        self.weights = list(weights)  # keeps the raw blocks alive while the kernel reads them
        self.k = weights[0].shape[1]
        self.sizes = [w.shape[0] for w in weights]
        self.width = sum(self.sizes)
        specs, column = [], 0
        for w in weights:
            if not w.fmt.native:
                raise ValueError(unavailable(w.fmt, torch.float32))
            if w.shape[1] != self.k:
                raise ValueError(f"{w.fmt.name} {list(w.shape)} against inputs of {self.k} features")
            specs.append(_Spec(_KINDS[w.fmt.kind], w.fmt.group, w.shape[0], 0, w.raw.stride(0), column,
                               w.raw.data_ptr()))
            column += w.shape[0]
        self._specs = (_Spec * len(specs))(*specs)
        self.address = ctypes.addressof(self._specs)  # passed as an address: converting the array costs ~4 us
        lib = _library()
        self._kernels = {torch.float32: lib.specdec_qlinear_many_f32, torch.float64: lib.specdec_qlinear_many_f64}

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `[m, k]` (float32 or float64, features contiguous) -> `out` `[m, width]` of its dtype."""
        m = x.size(0)
        if out is None:
            out = x.new_empty((m, self.width))
        fn = self._kernels.get(x.dtype)
        if fn is None:
            raise ValueError(unavailable(self.weights[0].fmt, x.dtype))
        if (out.dtype != x.dtype or x.size(1) != self.k or out.size(0) != m or out.size(1) != self.width
                or x.stride(1) != 1 or out.stride(1) != 1):
            raise ValueError(f"the quantized kernels take x [m, {self.k}] and out [m, {self.width}] of one dtype, "
                             f"features contiguous")
        return self.run(x, out)

    def run(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`__call__` without its checks, for a caller that made `x` and `out` right (the pass, ~121
        calls a decode step): float32 or float64 `[m, k]` and `[m, width]`, features contiguous."""
        m = x.size(0)
        fn = self._kernels[x.dtype]
        threads, size, x_t, y_t = torch.get_num_threads(), x.element_size(), x.stride(0), out.stride(0)
        if m <= CHUNK_ROWS:  # a decode or verify pass: one call
            code = fn(len(self._specs), self.address, m, self.k, x.data_ptr(), x_t, out.data_ptr(), y_t, threads)
            if code:
                raise RuntimeError(f"the quantized linear kernel failed ({native.KernelStatus(code).name})")
            return out
        for start in range(0, m, CHUNK_ROWS):
            code = fn(len(self._specs), self.address, min(CHUNK_ROWS, m - start), self.k,
                      x.data_ptr() + start * x_t * size, x_t, out.data_ptr() + start * y_t * size, y_t, threads)
            if code:
                raise RuntimeError(f"the quantized linear kernel failed ({native.KernelStatus(code).name})")
        return out


def linear(x: torch.Tensor, weights: list[QuantizedWeight], out: torch.Tensor) -> torch.Tensor:
    """`out` `[m, sum n_i]` = `x` `[m, k]` times each `weights[i]` `[n_i, k]` transposed, side by side;
    `x` and `out` float32 (float32 sums) or float64 (float64 sums), features contiguous (a
    `QuantizedProjection` prepared for one call: keep one where the same weights run again)."""
    return QuantizedProjection(weights)(x, out)


def embedding(ids: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` `[T]` of `weight`, de-quantized: `[T, k]` float32 (the input embedding of a model
    whose embedding is quantized, e.g. the tied q8_0 embedding/LM head of the packaged model)."""
    n, k = weight.shape
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"token ids out of range for {n} rows")
    out = torch.empty(ids.numel(), k) if out is None else out
    if out.dtype != torch.float32 or out.shape != (ids.numel(), k) or out.stride(1) != 1:
        raise ValueError(f"out is float32 [{ids.numel()}, {k}] with contiguous features")
    code = _library().specdec_qrows_f32(_KINDS[weight.fmt.kind], weight.fmt.group, ids.numel(), ids.data_ptr(), k,
                                        weight.raw.data_ptr(), weight.raw.stride(0), out.data_ptr(), out.stride(0),
                                        torch.get_num_threads())
    if code:
        raise RuntimeError(f"the quantized row kernel failed ({native.KernelStatus(code).name})")
    return out


def quantize_linears(model: torch.nn.Module, bits: str, group: int = quant.SUB) -> dict[str, QuantizedWeight]:
    """`--quantize int4|int8` for a transformers model: every bias-free `nn.Linear` weight (the
    projections and the LM head) quantized in groups of `group`, by parameter name; a weight
    shared by several modules (a tied head) is quantized once and listed under each name. The
    model is left as it is: the caller runs these through `linear` in its place."""
    done: dict[int, QuantizedWeight] = {}
    out: dict[str, QuantizedWeight] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.bias is None and module.in_features % group == 0:
            weight = module.weight
            if id(weight) not in done:
                done[id(weight)] = QuantizedWeight.quantize(weight.detach().float(), bits, group)
            out[f"{name}.weight" if name else "weight"] = done[id(weight)]
    return out


# --------------------------------------------------------------------------- GGUF files

_LLAMA_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The transformers Llama parameter a GGUF tensor is (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`); None for tensors transformers does not load."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if match is None or match[2] not in _LLAMA_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LLAMA_NAMES[match[2]]}.weight"


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order transformers gives a Llama GGUF's q (`heads` = attention heads) or k (`heads` =
    key/value heads) weight: llama.cpp's converter interleaved each head's two rotary halves, and
    transformers' loader (`_reverse_permute_weights`) takes rows (head, dim, 2) back to (head, 2, dim).
    Row i of transformers' weight is row `index[i]` of the GGUF's."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


@dataclass
class GGUFWeights:
    """A GGUF file's tensors under transformers' names: `QuantizedWeight` where a kernel runs the
    blocks, float32 tensors otherwise; `dequantized` names the quantized tensors that were
    de-quantized at load (block types without a kernel: K-quants and others)."""

    tensors: dict[str, QuantizedWeight | torch.Tensor]
    dequantized: dict[str, str] = field(default_factory=dict)  # name -> its block type
    architecture: str = ""
    heads: int = 0
    kv_heads: int = 0

    @property
    def nbytes(self) -> int:
        distinct = {id(t): t for t in self.tensors.values()}.values()  # a tied embedding and head once
        return sum(t.nbytes if isinstance(t, QuantizedWeight) else t.numel() * t.element_size() for t in distinct)


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOATS = {0: np.float32, 1: np.float16}  # ggml's F32 and F16
_BF16 = 30


@dataclass
class _GGUFTensor:
    """One tensor of a GGUF file: `dims` outermost first, `data` a view of the mapped file (float32 /
    float16 / bfloat16-as-uint16 values shaped `dims`, or uint8 rows of blocks `[rows, row bytes]`)."""

    name: str
    ggml_type: int
    dims: list[int]
    data: np.ndarray


def read_gguf(path: str | Path) -> tuple[dict[str, Any], list[_GGUFTensor]]:
    """A GGUF file's scalar and string metadata (arrays skipped) and its tensors, mapped, not copied.

    A small reader of the format (little-endian, version 2 or 3) instead of `gguf.GGUFReader`, which
    turns every element of every array field into numpy views: the packaged model's tokenizer
    (two arrays of ~49k strings) took it 10-25 s here, against ~0.1 s skipping them."""
    import struct

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mapped)  # type: ignore[arg-type]  # numpy's stubs miss the buffer protocol
    magic, version = bytes(buf[:4]), struct.unpack_from("<I", buf, 4)[0]
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF file of version 2 or 3")
    count, fields_count = struct.unpack_from("<QQ", buf, 8)
    at = 24

    def string() -> str:
        nonlocal at
        (size,) = struct.unpack_from("<Q", buf, at)
        at += 8 + size
        return bytes(buf[at - size:at]).decode("utf-8", errors="replace")

    def value(kind: int) -> Any:
        nonlocal at
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            inner, size = struct.unpack_from("<IQ", buf, at)
            at += 12
            if inner in _SCALARS:
                at += size * struct.calcsize(_SCALARS[inner])
            elif inner == _STRING:  # walk the lengths only
                for _ in range(size):
                    at += 8 + struct.unpack_from("<Q", buf, at)[0]
            else:
                for _ in range(size):
                    value(inner)
            return None  # arrays (the tokenizer's) are transformers' business
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, buf, at)
        at += struct.calcsize(fmt)
        return v

    fields: dict[str, Any] = {}
    for _ in range(fields_count):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        fields[key] = value(kind)
    infos = []
    for _ in range(count):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, at)
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, at + 4))
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        infos.append((name, kind, [int(d) for d in reversed(dims)], offset))  # GGUF lists innermost first
    alignment = int(fields.get("general.alignment") or 32)
    return fields, _map_tensors(mapped, (at + alignment - 1) // alignment * alignment, infos)


def _map_tensors(mapped: np.ndarray, start: int, infos: list[tuple[str, int, list[int], int]]) -> list[_GGUFTensor]:
    """The tensors (name, GGML type, dims outermost first, offset from `start`) as views of `mapped`."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = []
    for name, kind, dims, offset in infos:
        elements = int(np.prod(dims))
        data: np.ndarray
        if kind in _FLOATS or kind == _BF16:
            dtype = _FLOATS.get(kind, np.uint16)
            size = elements * np.dtype(dtype).itemsize
            data = mapped[start + offset:start + offset + size].view(dtype).reshape(dims)
        else:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            rows = elements // dims[-1]
            size = elements // block * block_bytes
            data = mapped[start + offset:start + offset + size].reshape(rows, -1)
        tensors.append(_GGUFTensor(name, kind, dims, data))
    return tensors


def load_gguf(path: str | Path) -> GGUFWeights:
    """A Llama GGUF's tensors without de-quantizing q4_0 / q4_1 / q8_0 blocks (copied out of the
    file into memory; rows as transformers' loader orders them)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    fields, tensors = read_gguf(path)
    arch = fields.get("general.architecture") or ""
    if arch != "llama":
        raise ValueError(f"{path}: a {arch or 'unknown'} model; loading blocks natively covers Llama GGUFs")
    heads, kv_heads = fields.get("llama.attention.head_count"), fields.get("llama.attention.head_count_kv")
    if heads is None:
        raise ValueError(f"{path}: no llama.attention.head_count")
    out = GGUFWeights({}, {}, arch, int(heads), int(kv_heads or heads))
    for t in tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        dims = t.dims
        shape = (dims[0], dims[1]) if len(dims) == 2 else (1, dims[0])
        fmt = quant.GGUF_FORMATS.get(t.ggml_type)
        if fmt is not None and fmt.native and len(dims) == 2:
            tensor: QuantizedWeight | torch.Tensor = QuantizedWeight(
                torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(shape[0], -1)), fmt, shape)
        elif t.ggml_type in _FLOATS:
            tensor = torch.from_numpy(np.array(t.data, dtype=np.float32))
        elif t.ggml_type == _BF16:
            tensor = torch.from_numpy((t.data.astype(np.uint32) << 16).view(np.float32))
        else:
            kind = GGMLQuantizationType(t.ggml_type)
            out.dequantized[name] = kind.name
            values = quant.dequantize(t.data, fmt, shape) if fmt is not None else torch.from_numpy(
                np.array(gguf_dequantize(np.asarray(t.data), kind), dtype=np.float32))
            tensor = values.reshape(dims).contiguous()
        heads_of = {"self_attn.q_proj": out.heads, "self_attn.k_proj": out.kv_heads}
        for module, count in heads_of.items():
            if f".{module}." in name:
                index = unpermute_rows(shape[0], count)
                tensor = tensor.permute_rows(index) if isinstance(tensor, QuantizedWeight) else tensor[index]
        out.tensors[name] = tensor
    if "lm_head.weight" not in out.tensors and "model.embed_tokens.weight" in out.tensors:
        out.tensors["lm_head.weight"] = out.tensors["model.embed_tokens.weight"]  # tied: one weight
    if out.dequantized:
        log.info("%s: %d tensors de-quantized to float32 at load (no native kernel for %s)", Path(path).name,
                 len(out.dequantized), ", ".join(sorted(set(out.dequantized.values()))))
    return out
