"""Model loading (specdec.runtime.models) and the tiny offline models (specdec.testing.tiny)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from specdec.runtime.models import (
    DEFAULT_MODEL,
    ModelLoadError,
    cache_dir,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    tokenizer_fingerprint,
)
from specdec.testing.tiny import (
    greedy_agreement,
    make_char_tokenizer,
    make_mismatched_tokenizer_model,
    make_tiny_model,
)

PROMPTS = ["Once upon a time", "def f(x):"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    base = make_tiny_model(root / "base", seed=0)
    return {
        "base": base,
        "copy": make_tiny_model(root / "copy", base=base, perturb=0.0),
        "near": make_tiny_model(root / "near", base=base, perturb=0.05, seed=1),
        "far": make_tiny_model(root / "far", base=base, perturb=1.0, seed=1),
        "mismatched": make_mismatched_tokenizer_model(root / "mismatched", base),
    }


def test_round_trip(models: dict[str, Path]) -> None:
    loaded = load_model(str(models["base"]), progress=False)
    assert loaded.dtype == torch.float32
    assert not loaded.model.training
    assert loaded.name == "base" and loaded.path == str(models["base"])
    assert loaded.max_context == 512
    assert loaded.eos_token_ids == [loaded.tokenizer.eos_token_id] == [2]
    assert loaded.vocab_size == len(loaded.tokenizer) == 100
    assert len(loaded.fingerprint) == 16
    int(loaded.fingerprint, 16)
    assert (models["base"] / "model.safetensors").is_file()


def test_every_weight_on_a_cpu_starts_on_a_cache_line(models: dict[str, Path]) -> None:
    """transformers views safetensors weights where they lie in the mapped file, at any offset;
    the loader moves a misaligned one to aligned memory, same values, tied weights still tied.
    The tiny model's file may happen to be aligned, so a weight is misaligned here on purpose."""
    from specdec.runtime import models as loader

    loaded = load_model(str(models["base"]), progress=False)
    model = loaded.model
    assert all(t.data_ptr() % loader.ALIGN_BYTES == 0 for t in [*model.parameters(), *model.buffers()])
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many models' are
    for weight in (model.model.layers[0].self_attn.q_proj.weight, model.lm_head.weight):
        values = weight.detach().clone()
        shifted = torch.empty(values.numel() + 1)[1:].view_as(values)  # 4 bytes past an aligned start
        shifted.copy_(values)
        weight.data = shifted
        assert weight.data_ptr() % loader.ALIGN_BYTES
        loader._align(model)
        assert weight.data_ptr() % loader.ALIGN_BYTES == 0 and torch.equal(weight, values)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("name, dtype", [("float64", torch.float64), ("bfloat16", torch.bfloat16)])
def test_dtype_selection(models: dict[str, Path], name: str, dtype: torch.dtype) -> None:
    loaded = load_model(str(models["base"]), dtype=name, progress=False)
    assert loaded.dtype == dtype
    assert {p.dtype for p in loaded.model.parameters()} == {dtype}
    ids = torch.tensor([loaded.tokenizer.encode("hi")])
    with torch.no_grad():
        assert loaded.model(ids).logits.dtype == dtype


def test_bad_dtype_lists_allowed(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="float32.*bfloat16.*float16.*float64"):
        load_model(str(models["base"]), dtype="int8")


def test_fingerprints(models: dict[str, Path]) -> None:
    fingerprints = {name: load_model(str(path), progress=False).fingerprint for name, path in models.items()}
    assert fingerprints["base"] == fingerprints["copy"] == fingerprints["near"] == fingerprints["far"]
    assert fingerprints["mismatched"] != fingerprints["base"]
    assert tokenizer_fingerprint(make_char_tokenizer()) == fingerprints["base"]
    assert tokenizer_fingerprint(load_tokenizer(str(models["base"]))) == fingerprints["base"]


def test_decode_round_trips_ascii(models: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(str(models["base"]))
    text = "Hello,  world!\n\tdef f(x): return x ** 2  # ~`{}|\\"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_chat_template(models: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(str(models["base"]))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "system: Be brief.\nuser: Hi\nassistant: "


def test_perturb_zero_is_identical(models: dict[str, Path]) -> None:
    base = load_model(str(models["base"]), progress=False)
    copy = load_model(str(models["copy"]), progress=False)
    ids = torch.tensor([base.tokenizer.encode("Once upon a time")])
    with torch.no_grad():
        assert torch.equal(base.model(ids).logits, copy.model(ids).logits)


def test_same_seed_same_weights(models: dict[str, Path], tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (models["base"] / "model.safetensors").read_bytes()


def test_logits_are_peaked(models: dict[str, Path]) -> None:
    base = load_model(str(models["base"]), dtype="float64", progress=False)
    ids = torch.tensor([base.tokenizer.encode("Once upon a time, in a land far away")])
    with torch.no_grad():
        p = torch.softmax(base.model(ids).logits[0], dim=-1)  # [S, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    assert float(entropy.mean()) < 0.6 * torch.log(torch.tensor(100.0)).item()  # far from uniform
    assert float(p.max(-1).values.mean()) > 0.3


def test_greedy_agreement(models: dict[str, Path]) -> None:
    assert greedy_agreement(models["base"], models["copy"], PROMPTS, 24) == 1.0
    near = greedy_agreement(models["base"], models["near"], PROMPTS, 24)
    far = greedy_agreement(models["base"], models["far"], PROMPTS, 24)
    assert 1.0 > near > far
    assert far < 0.3


def test_agreement_refuses_mismatched_tokenizers(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="different tokenizers"):
        greedy_agreement(models["base"], models["mismatched"], PROMPTS, 4)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("SPECDEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specdec"


def test_resolve_passes_through(models: dict[str, Path]) -> None:
    assert resolve_model_path(str(models["base"])) == str(models["base"])
    assert resolve_model_path("some-org/some-model") == "some-org/some-model"


def test_missing_local_dir_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="default"):
        load_model(str(tmp_path / "nope"))


def test_non_model_dir_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="local directory"):
        load_model(str(tmp_path))


@pytest.mark.slow
def test_default_model() -> None:
    path = Path(resolve_model_path("default"))
    assert path == cache_dir() / "models" / "SmolLM2-135M-Instruct"
    assert json.loads((path / "specdec-conversion.json").read_text())["dtype"] == "float32"
    assert not list(path.parent.glob(".tmp-*")), "a temporary conversion folder was left behind"
    assert os.access(path / "model.safetensors", os.R_OK)

    loaded = load_model(DEFAULT_MODEL, progress=False, weights="dense")
    assert loaded.weights.format == "float32"
    config = loaded.model.config
    assert (config.num_hidden_layers, config.hidden_size, loaded.vocab_size) == (30, 576, 49152)
    assert loaded.name == DEFAULT_MODEL and loaded.max_context == 8192
    assert config.tie_word_embeddings
    head, embed = loaded.model.get_output_embeddings().weight, loaded.model.get_input_embeddings().weight
    assert head.data_ptr() == embed.data_ptr() or torch.equal(head, embed)
    assert loaded.tokenizer.chat_template
    assert loaded.fingerprint == tokenizer_fingerprint(load_tokenizer("default"))

    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.model.generate(ids, max_new_tokens=5, do_sample=False)
    text = loaded.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert text.strip()


@pytest.mark.slow
def test_default_model_serves_its_gguf_blocks_by_default() -> None:
    """The packaged model's q4_1 / q8_0 blocks as stored (one copy of the tied q8_0 embedding and
    head), the same tokenizer as its float32 conversion, and transformers' own generate runs it."""
    from specdec.runtime.weights import QuantizedEmbedding, QuantizedLinear

    loaded = load_model(DEFAULT_MODEL, progress=False)
    assert loaded.weights.format == "gguf:q4_1+q8_0" and loaded.dtype == torch.float32
    assert loaded.weights.nbytes == 96_436_224  # 210 q4_1 matrices and the q8_0 head: the norms are not matrices
    model = loaded.model
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, QuantizedLinear) and isinstance(embed, QuantizedEmbedding)
    assert head.qweight is embed.qweight and head.qweight.fmt.name == "q8_0"
    assert sum(p.numel() for p in model.parameters()) == 61 * 576  # only the norms are float tensors
    assert (loaded.name, loaded.max_context, loaded.vocab_size, loaded.eos_token_ids) == (DEFAULT_MODEL, 8192, 49152,
                                                                                        [2])
    assert loaded.fingerprint == tokenizer_fingerprint(load_tokenizer("default"))
    dense = load_model(DEFAULT_MODEL, progress=False, weights="dense")
    assert dense.fingerprint == loaded.fingerprint and dense.weights.fingerprint != loaded.weights.fingerprint
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = [m.generate(ids, max_new_tokens=8, do_sample=False)[0].tolist() for m in (model, dense.model)]
    assert out[0] == out[1]


# --------------------------------------------------------------------------- devices


def test_device_auto_is_the_cpu_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


def test_device_auto_takes_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"only 2 CUDA GPU\(s\) are visible \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


def test_dtype_auto_is_bfloat16_on_a_gpu_that_computes_it_and_float32_elsewhere(monkeypatch: pytest.MonkeyPatch,
                                                                                 caplog) -> None:
    """--dtype auto (the target's default): float32 on a CPU (the packaged GGUF's blocks run with float32
    activations), bfloat16 on a CUDA GPU with native bfloat16, float32 on one without (said in the log);
    a dtype named is taken as it is, an unknown one refused naming the choices."""
    native_bf16 = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native_bf16.append(including_emulation) or bf16[0])
    bf16 = [True]
    assert resolve_dtype("auto", torch.device("cpu")) == "float32" and native_bf16 == []
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16" and native_bf16 == [False]
    bf16[0] = False
    with caplog.at_level("INFO", logger="specdec.runtime.models"):
        assert resolve_dtype("auto", torch.device("cuda", 0)) == "float32"
    assert "no native bfloat16" in caplog.text
    assert resolve_dtype("float16", torch.device("cuda", 0)) == "float16"
    assert resolve_dtype("bfloat16", torch.device("cpu")) == "bfloat16"
    with pytest.raises(ValueError, match="choose auto or one of float32"):
        resolve_dtype("int8", torch.device("cpu"))


def test_the_target_loads_its_default_auto_dtype_as_float32_on_a_cpu(models: dict[str, Path]) -> None:
    from target_service.config import TargetConfig

    assert TargetConfig().dtype == "auto"
    loaded = load_model(str(models["base"]), dtype="auto", progress=False, device="cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}


def test_a_gpu_asked_for_without_one_says_what_to_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="run with --device cpu"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="choose auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        resolve_device("meta")


def test_loaded_model_is_on_the_device_it_reports(models: dict[str, Path]) -> None:
    loaded = load_model(str(models["base"]), progress=False, device="cpu")
    assert loaded.device == torch.device("cpu")
    assert {p.device for p in loaded.model.parameters()} == {torch.device("cpu")}
    assert loaded.describe_device() == "cpu"


def test_service_refuses_a_device_it_does_not_have_before_loading() -> None:
    """The flag is checked when the config is built: no model is loaded for a pod that cannot run."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: asking for one is not an error here")
    proc = subprocess.run([sys.executable, "-m", "target_service", "--device", "cuda", "--model", "/nonexistent"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--device: device 'cuda' requested but" in proc.stderr
    assert "run with --device cpu" in proc.stderr
