"""Keys and values that come from elsewhere (Redis: snapshots, other replicas' prefix segments) are
checked before anything uses them, at three depths: the blob is decoded against the model's layout
(`snapshot_codec`); a session takes only views and restores of its own geometry and dtype
(`kv_buffer.SessionKV`), and the attention plan only segments that match the session; and the native
kernels, given every buffer's sizes and storage, refuse a call that would read or write past one
(`KernelStatus.OUT_OF_BOUNDS`), the last line for a plan that got past the others.

`tests/unit/test_native_asan.py` runs this file under AddressSanitizer."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from safetensors.torch import save as st_save

from specdec.errors import FailedPrecondition
from specdec.runtime import native, native_attention
from specdec.runtime.kv_buffer import SessionKV
from specdec.runtime.snapshot_codec import KVLayout, MalformedKV, SnapshotIdentity, decode_layers, encode_layers

LAYERS, HEADS, DIM = 2, 3, 64
IDENTITY = SnapshotIdentity("tiny", "float32", "fp", LAYERS)
LAYOUT = KVLayout(LAYERS, HEADS, DIM, torch.float32, vocab_size=100, max_tokens=512)


def session(prefix=(), capacity: int = 64) -> SessionKV:
    return SessionKV(LAYERS, HEADS, DIM, 4096, torch.float32, prefix=prefix, capacity=capacity)


BAD_VIEWS = {
    "float16, one head of one dim (a corrupt segment)": torch.zeros(2, LAYERS, 1, 64, 1, dtype=torch.float16),
    "float16": torch.zeros(2, LAYERS, HEADS, 64, DIM, dtype=torch.float16),
    "float64": torch.zeros(2, LAYERS, HEADS, 64, DIM, dtype=torch.float64),
    "fewer heads": torch.zeros(2, LAYERS, HEADS - 1, 64, DIM),
    "smaller head_dim": torch.zeros(2, LAYERS, HEADS, 64, DIM // 2),
    "fewer layers": torch.zeros(2, LAYERS - 1, HEADS, 64, DIM),
    "keys only": torch.zeros(1, LAYERS, HEADS, 64, DIM),
    "four dimensions": torch.zeros(2, LAYERS, HEADS, 64 * DIM),
    "head_dim not contiguous": torch.zeros(2, LAYERS, HEADS, DIM, 64).transpose(3, 4),
}


@pytest.mark.parametrize("view", BAD_VIEWS.values(), ids=BAD_VIEWS.keys())
def test_a_session_refuses_shared_prefix_views_that_are_not_its_keys_and_values(view):
    with pytest.raises(ValueError, match="shared prefix view"):
        session(prefix=(view,))
    kv = session()
    kv.length = 64
    with pytest.raises(ValueError, match="shared prefix view"):
        kv.rebase((view,))


@pytest.mark.parametrize("keys", [torch.zeros(1, 1, 10, 1), torch.zeros(1, HEADS, 10, DIM, dtype=torch.float16),
                                  torch.zeros(1, HEADS, 10, DIM, dtype=torch.float64), torch.zeros(HEADS, 10, DIM),
                                  torch.zeros(1, HEADS, 10, 1)],
                         ids=["would broadcast", "float16 would be cast", "float64 would be cast", "three dimensions",
                              "one dim would broadcast"])
def test_a_restore_refuses_what_a_copy_would_broadcast_or_cast(keys):
    good = torch.zeros(1, HEADS, 10, DIM)
    kv = session()
    with pytest.raises(ValueError, match="layer 0 holds"):
        kv.load([(keys, good)] + [(good, good)] * (LAYERS - 1), 10)
    with pytest.raises(ValueError, match="layer 0 holds"):
        kv.load([(good, keys)] + [(good, good)] * (LAYERS - 1), 10)
    kv.load([(good, good)] * LAYERS, 10)  # the right shape loads
    assert kv.length == 10


def test_the_attention_plan_refuses_segments_of_another_geometry_or_dtype():
    for view in BAD_VIEWS.values():
        kv = session(capacity=8)
        kv.prefix, kv.offset, kv.length = (view,), view.shape[3] if view.ndim == 5 else 64, 64  # past SessionKV's check
        with pytest.raises(ValueError, match="segment|head_dim"):
            native_attention.AttentionPlan([(kv, 0, 1, 64)])


# -- the kernel: the last line -------------------------------------------------------------------------------------

def _call(plan: native_attention.AttentionPlan, q: torch.Tensor, out: torch.Tensor, layer: int = 1,
          tokens: int | None = None, q_bytes: int | None = None, new=None) -> native.KernelStatus:
    """The attention entry point called directly (past `native_attention.attend`'s checks)."""
    lib, why = native.library()
    if lib is None:
        pytest.skip(why)
    rows = native_attention._Rows
    qd = rows.of(q)
    if q_bytes is not None:
        qd.bytes = q_bytes
    stored = (None, None) if new is None else (ctypes.byref(rows.of(new[0])), ctypes.byref(rows.of(new[1])))
    rc = lib.specdec_attend_f32(plan.count, ctypes.addressof(plan.rows), plan.segment_count,
                                ctypes.addressof(plan.segments), layer, HEADS, 3, DIM,
                                q.shape[0] if tokens is None else tokens, ctypes.byref(qd), *stored,
                                ctypes.byref(rows.of(out)), DIM**-0.5, 1)
    return native.KernelStatus(rc)


def _plan(past: int = 100, n: int = 2, prefix: int = 64):
    """A session of `past` positions (the first `prefix` in a shared view) with room for `n` more, its
    plan, and q, out for its block."""
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(2, LAYERS, HEADS, prefix, DIM, generator=gen)
    kv = session(prefix=(shared,) if prefix else (), capacity=past + n - prefix)
    kv.data.copy_(torch.randn(kv.data.shape, generator=gen))
    kv.length = past
    q = torch.randn(n, HEADS * 3, DIM, generator=gen)
    return kv, native_attention.AttentionPlan([(kv, 0, n, past)]), q, torch.empty_like(q)


def _shrink(field: str, value):
    def change(plan, segment):
        setattr(plan.segments[segment], field, value)
    return change


OVERREACHES = {  # a plan the Python side would never make, and what the kernel must see in it
    "a prefix segment's storage smaller than its sizes": (_shrink("bytes", 64 * 4), 0),
    "the own buffer's storage smaller than its sizes": (_shrink("bytes", 1000), 1),
    "a float16-sized storage read as float32": (_shrink("bytes", 2 * LAYERS * HEADS * 64 * DIM * 2), 0),
    "fewer heads than the call reads": (_shrink("heads", 1), 0),
    "a head_dim other than the call's": (_shrink("dim", 1), 0),
    "a layer beyond the segment's": (_shrink("layers", 1), 0),
    "more positions read than it has": (_shrink("positions", 10), 0),
    "a negative stride": (_shrink("pos_stride", -DIM), 0),
    "a stride past its storage": (_shrink("layer_stride", 10**9), 1),
    "an overflowing stride": (_shrink("head_stride", 2**62), 1),
    "a gap between segments": (_shrink("start", 65), 1),
    "segments ending before the last query's key": (_shrink("width", 10), 1),
    "no base": (_shrink("base", None), 0),
}


@pytest.mark.parametrize("change, segment", OVERREACHES.values(), ids=OVERREACHES.keys())
def test_the_kernel_refuses_a_plan_that_would_read_past_a_segment(change, segment):
    kv, plan, q, out = _plan()
    assert _call(plan, q, out) == native.KernelStatus.OK
    change(plan, segment)
    before = kv.data.clone()
    k = torch.randn(2, HEADS, DIM)
    assert _call(plan, q, out, new=(k, k)) == native.KernelStatus.OUT_OF_BOUNDS
    assert torch.equal(kv.data, before)  # refused before anything was stored


def test_the_kernel_refuses_rows_beyond_its_queries_or_segments():
    kv, plan, q, out = _plan()
    assert _call(plan, q, out, tokens=1) == native.KernelStatus.OUT_OF_BOUNDS  # the row's 2 queries in 1 token
    assert _call(plan, q, out, q_bytes=q.numel() * 4 - 4) == native.KernelStatus.OUT_OF_BOUNDS
    plan.rows[0].first_query = 1
    assert _call(plan, q, out) == native.KernelStatus.OUT_OF_BOUNDS
    plan.rows[0].first_query = 0
    plan.rows[0].segments = 3  # more than the plan holds
    assert _call(plan, q, out) == native.KernelStatus.OUT_OF_BOUNDS
    plan.rows[0].segments, plan.rows[0].past = 2, 99  # its segments reach key 101, its last query sees 100
    assert _call(plan, q, out) == native.KernelStatus.OUT_OF_BOUNDS


def test_attend_raises_for_a_refusal_and_checks_the_tensors_it_is_given():
    kv, plan, q, out = _plan()
    plan.segments[0].bytes = 16
    with pytest.raises(ValueError, match="past its buffers"):
        native_attention.attend(plan, 1, q, out, HEADS, DIM**-0.5)
    kv, plan, q, out = _plan()
    with pytest.raises(ValueError, match="q and out"):
        native_attention.attend(plan, 1, q, out[:1], HEADS, DIM**-0.5)
    with pytest.raises(ValueError, match="plan's keys/values"):
        native_attention.attend(plan, 1, q.double(), out.double(), HEADS, DIM**-0.5)
    with pytest.raises(ValueError, match="new keys and values"):
        native_attention.attend(plan, 1, q, out, HEADS, DIM**-0.5, new=(torch.zeros(1, HEADS, DIM),) * 2)


def test_the_linear_kernel_refuses_a_product_past_its_buffers():
    lib, why = native.library()
    if lib is None:
        pytest.skip(why)
    x, w, y = torch.randn(3, 16), torch.randn(8, 16), torch.empty(3, 8)

    def call(x_bytes: int = 3 * 16 * 4, w_bytes: int = 8 * 16 * 4, y_bytes: int = 3 * 8 * 4, x_t=16, y_t=8):
        return native.KernelStatus(lib.specdec_linear_f32(3, 8, 16, x.data_ptr(), x_t, x_bytes, w.data_ptr(), w_bytes,
                                                          y.data_ptr(), y_t, y_bytes, 1))

    assert call() == native.KernelStatus.OK
    torch.testing.assert_close(y, x @ w.T)
    for overreach in (dict(x_bytes=x.numel() * 4 - 4), dict(w_bytes=w.numel() * 4 - 4),
                      dict(y_bytes=y.numel() * 4 - 4), dict(x_t=2**62), dict(y_t=-8)):
        assert call(**overreach) == native.KernelStatus.OUT_OF_BOUNDS, overreach
    with pytest.raises(ValueError, match="fill 9 columns"):
        native.linear(x, [w], torch.empty(3, 9))


# -- decoding: the first line --------------------------------------------------------------------------------------

def _blob(tokens=None, keys=None, layers=LAYERS, extra_tensors=None, drop=None, metadata=None) -> bytes:
    """A snapshot blob of the test model, with one thing changed."""
    tokens = torch.arange(3, 13) if tokens is None else tokens
    count = tokens.shape[0] if tokens.ndim else 1
    tensors = {"tokens": tokens}
    for i in range(layers):
        tensors[f"k.{i}"] = torch.zeros(1, HEADS, count, DIM) if keys is None or i else keys
        tensors[f"v.{i}"] = torch.zeros(1, HEADS, count, DIM)
    tensors.update(extra_tensors or {})
    for name in drop or ():
        del tensors[name]
    return st_save(tensors, metadata={**IDENTITY.as_metadata(), "format": "1", **(metadata or {})})


def _with_header(header: bytes, rest: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + rest


MALFORMED = {
    "keys of another dtype": _blob(keys=torch.zeros(1, HEADS, 10, DIM, dtype=torch.float16)),
    "keys of one head of one dim": _blob(keys=torch.zeros(1, 1, 10, 1)),
    "keys of fewer positions than tokens": _blob(keys=torch.zeros(1, HEADS, 9, DIM)),
    "keys of another head_dim": _blob(keys=torch.zeros(1, HEADS, 10, DIM + 1)),
    "keys without the leading 1": _blob(keys=torch.zeros(HEADS, 10, DIM)),
    "a layer missing": _blob(drop=["v.1"]),
    "a tensor too many": _blob(extra_tensors={"k.2": torch.zeros(1, HEADS, 10, DIM)}),
    "tokens as floats": _blob(tokens=torch.arange(3.0, 13.0)),
    "tokens as a matrix": _blob(tokens=torch.arange(3, 13).view(2, 5)),
    "a token outside the vocabulary": _blob(tokens=torch.tensor([3, 4, 100] + [5] * 7)),
    "a negative token": _blob(tokens=torch.tensor([3, -1] + [5] * 8)),
    "no tokens": _blob(tokens=torch.zeros(0, dtype=torch.int64)),
    "more tokens than the context": _blob(tokens=torch.full((513,), 5)),
    "truncated": _blob()[:-100],
    "truncated in its header": _blob()[:40],
    "empty": b"",
    "a header of non-UTF-8 bytes": _with_header(b'{"__metadata__": {"model": "\xff\xfe"}}'),
    "a header that is not JSON": _with_header(b"{not json"),
    "a header that is a list": _with_header(b"[1, 2]"),
    "a header longer than the blob": (10**12).to_bytes(8, "little") + b"{}",
    "metadata that is not strings": _with_header(json.dumps({"__metadata__": {"model": 1}}).encode()),
    "a tensor whose data lies past the blob": _with_header(json.dumps({
        "__metadata__": {**IDENTITY.as_metadata(), "format": "1"},
        "tokens": {"dtype": "I64", "shape": [10**9], "data_offsets": [0, 8 * 10**9]}}).encode(), b"\0" * 64),
}


@pytest.mark.parametrize("blob", MALFORMED.values(), ids=MALFORMED.keys())
def test_decoding_refuses_a_blob_that_does_not_fit_the_model(blob):
    with pytest.raises(MalformedKV):
        decode_layers(blob, IDENTITY, LAYOUT)


def test_a_blob_of_another_model_or_format_is_not_malformed_but_not_ours():
    with pytest.raises(FailedPrecondition, match="another model"):
        decode_layers(_blob(metadata={"model": "other"}), IDENTITY, LAYOUT)
    with pytest.raises(FailedPrecondition, match="format"):
        decode_layers(_blob(metadata={"format": "9"}), IDENTITY, LAYOUT)


def test_a_good_blob_decodes_to_what_was_encoded():
    keys = [(torch.randn(1, HEADS, 10, DIM), torch.randn(1, HEADS, 10, DIM)) for _ in range(LAYERS)]
    tokens, layers = decode_layers(encode_layers(keys, list(range(3, 13)), IDENTITY), IDENTITY, LAYOUT)
    assert tokens == list(range(3, 13))
    for (k, v), (k2, v2) in zip(keys, layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)
