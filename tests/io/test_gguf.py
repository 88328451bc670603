"""io.gguf's header reader: every key/value and tensor as the `gguf` package's GGUFReader
reads them (a synthetic file with every value type, in both byte orders, and the real
SmolLM2), and bad files refused in one line; dequantisation on the device (io.gguf_quants)
bit for bit the package's, on edge-case blocks and on the real SmolLM2 and Gemma-3 tensors,
and `load_target` from it equal to the host load."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from eagle3kit.core.sharding import make_mesh
from eagle3kit.errors import InputError
from eagle3kit.io import gguf_quants as q
from eagle3kit.io.gguf import GGUFCheckpoint, GGUFHeader
from eagle3kit.io.hf import load_target, resolve_target
from tests import assets


def assert_same_as_gguf_package(path):
    ours, ref = GGUFHeader(path), GGUFReader(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for key, value in fields.items():
        assert ours.fields[key] == value, key
        items = value if isinstance(value, list) else [value]
        mine = ours.fields[key] if isinstance(value, list) else [ours.fields[key]]
        assert [type(x) for x in mine] == [type(x) for x in items], key  # 1 is not 1.0, True
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert (t.tensor_type, t.dims) == (int(r.tensor_type), tuple(r.shape.tolist())), t.name
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        np.testing.assert_array_equal(t.data, r.data, err_msg=t.name)


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_and_tensor_layout(tmp_path, endian):
    path = tmp_path / "all.gguf"
    w = GGUFWriter(path, "llama", endianess=endian)
    V = GGUFValueType
    scalars = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000,
               V.UINT32: 4_000_000_000, V.INT32: -2_000_000_000, V.FLOAT32: 0.1,
               V.UINT64: 2**63 + 5, V.INT64: -(2**62), V.FLOAT64: 0.1, V.BOOL: True,
               V.STRING: "héllo ▁world"}
    for kind, value in scalars.items():
        w.add_key_value(f"s.{kind.name}", value, kind)
        if kind != V.STRING:
            w.add_key_value(f"a.{kind.name}", [value, value, value], V.ARRAY, sub_type=kind)
    w.add_key_value("a.STRING", ["", "a", "▁ü" * 40, "<0x0A>"], V.ARRAY, sub_type=V.STRING)
    w.add_custom_alignment(1024)  # not the default 32
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", quantize(q, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_gguf_package(path)
    assert GGUFHeader(path).fields["s.FLOAT32"] != 0.1  # float32's 0.1, not float64's


def test_real_smollm2_header(smollm2_gguf):
    assert_same_as_gguf_package(smollm2_gguf)


@pytest.mark.parametrize("content", [b"", b"not a gguf file", "cut"])
def test_unreadable_file_is_one_line_naming_it(smollm2_gguf, tmp_path, content):
    path = tmp_path / "bad.gguf"
    if content == "cut":  # the header cut inside the vocabulary
        with open(smollm2_gguf, "rb") as f:
            content = f.read(200_000)
    path.write_bytes(content)
    with pytest.raises(InputError, match="not a readable GGUF file") as e:
        GGUFCheckpoint(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# ---- dequantisation on the device (io/gguf_quants.py): bit for bit the `gguf` package's ------

QUANTS = {q.Q4_0: [0], q.Q4_1: [0, 2], q.Q5_0: [0], q.Q5_1: [0, 2], q.Q8_0: [0],
          q.Q4_K: [0, 2], q.Q5_K: [0, 2], q.Q6_K: [208]}  # where each block's float16s are
# scales at the edges, one per block first: the largest, the smallest subnormal, negative, -0
EDGES = np.array([65504, -65504, 2**-24, -(2**-24), -0.0, 0.0, 1, -1.5, 2**-14, -7e-3],
                 np.float16).view(np.uint16)


def _blocks(qtype, rows, rng):
    """`rows` rows of random blocks (every bit pattern of the quants and the 6-bit scales),
    their float16 scales finite, the first blocks' scales the EDGES."""
    values, nbytes = q.BLOCKS[qtype]
    data = rng.integers(0, 256, (rows * 8, nbytes), dtype=np.uint8)
    for at in QUANTS[qtype]:
        half = data[:, at:at + 2].copy().view(np.uint16)[:, 0]
        half[(half & 0x7C00) == 0x7C00] &= 0xBFFF  # inf/nan -> finite
        half[:len(EDGES)] = EDGES
        data[:, at:at + 2] = half.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, 8 * nbytes), (rows, 8 * values)


def assert_bits_equal(ours, ref):
    ours, ref = np.asarray(ours), np.asarray(ref, np.float32)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    differ = ours.view(np.uint32) != ref.view(np.uint32)
    assert not differ.any(), f"{differ.sum()} values differ, first at {np.argwhere(differ)[0]}"


def _ours(data, qtype, shape):
    return jax.jit(q.dequantize, static_argnums=(1, 2))(data, qtype, shape)


@pytest.mark.parametrize("qtype", list(QUANTS), ids=lambda t: GGMLQuantizationType(t).name)
def test_quantised_blocks_exact(qtype):
    data, shape = _blocks(qtype, 64, np.random.default_rng(qtype))
    if qtype in (q.Q4_K, q.Q5_K):  # every 6-bit scale and min occurs
        from gguf.quants import Q4_K
        scales = data.reshape(-1, q.BLOCKS[qtype][1])[:, 4:16]
        assert all(len(np.unique(x)) == 64 for x in Q4_K.get_scale_min(scales))
    assert_bits_equal(_ours(data, qtype, shape), dequantize(data, GGMLQuantizationType(qtype)))


def test_plain_types_exact():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, (32, 64), dtype=np.uint16)  # every class, NaN included
    bits[0, :len(EDGES)] = EDGES
    half = bits.view(np.float16)
    assert_bits_equal(_ours(half, q.F16, (32, 64)), half.astype(np.float32))
    bf16 = bits.view(np.uint8).reshape(32, 128)
    assert_bits_equal(_ours(bf16, q.BF16, (32, 64)),
                      dequantize(bf16, GGMLQuantizationType.BF16))
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    assert_bits_equal(_ours(f32, q.F32, (3, 5)), f32)


def _real_tensors_exact(path, extra=()):
    """The smallest tensor of each type in the file, and `extra`: on the device as `get`."""
    ckpt = GGUFCheckpoint(path)
    assert ckpt.on_device()
    smallest = {}
    for name in ckpt.names:
        t = ckpt._tensors[name]
        if t.data.nbytes < smallest.get(t.tensor_type, (None, np.inf))[1]:
            smallest[t.tensor_type] = (name, t.data.nbytes)
    names = [n for n, _ in smallest.values()] + list(extra)
    for name in names:
        assert_bits_equal(ckpt.device_tensor(name), ckpt.get(name))
    return {GGMLQuantizationType(t).name for t in smallest}


def test_real_smollm2_tensors_exact(smollm2_gguf):
    # Llama: Q and K come back un-interleaved (the rotary permutation)
    rotary = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"]
    assert {"Q4_1", "Q8_0"} <= _real_tensors_exact(smollm2_gguf, rotary)


@pytest.mark.slow
def test_real_gemma3_tensors_exact():
    # Gemma: norms come back less llama.cpp's 1
    norms = ["model.layers.0.input_layernorm.weight", "model.norm.weight"]
    types = _real_tensors_exact(assets.gemma3_gguf(), norms)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types


def _tiny_llama(path):
    """A 3-layer Llama GGUF of random blocks, its layers' types mixed as Q4_K_M mixes them."""
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, "llama")
    w.add_block_count(3)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(64)
    T = GGMLQuantizationType

    def add(name, rows, cols, qtype):
        if qtype == T.F32:
            w.add_tensor(name, rng.standard_normal(cols).astype(np.float32))
        else:
            data, _ = _blocks(qtype, rows * cols // (8 * q.BLOCKS[qtype][0]), rng)
            w.add_tensor(name, data.reshape(rows, -1), raw_dtype=qtype)

    add("token_embd.weight", 32, 256, T.Q5_0)
    add("output_norm.weight", 1, 256, T.F32)
    add("output.weight", 32, 256, T.Q8_0)
    for i, (big, small) in enumerate([(T.Q6_K, T.Q4_K), (T.Q4_K, T.Q5_K), (T.Q6_K, T.Q4_1)]):
        for name, rows, cols, qtype in [("attn_q", 256, 256, small), ("attn_k", 128, 256, big),
                                        ("attn_v", 128, 256, big), ("attn_output", 256, 256, small),
                                        ("ffn_gate", 512, 256, small), ("ffn_up", 512, 256, small),
                                        ("ffn_down", 256, 512, big)]:
            add(f"blk.{i}.{name}.weight", rows, cols, qtype)
        add(f"blk.{i}.attn_norm.weight", 1, 256, T.F32)
        add(f"blk.{i}.ffn_norm.weight", 1, 256, T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model,dtype", [
    ("tiny", "float32"), pytest.param("tiny", "bfloat16", marks=pytest.mark.slow),
    pytest.param("smollm2", "float32", marks=pytest.mark.slow),
    # Q4_K_M: some layers' tensors Q6_K, the others' Q4_K (batches joined in layer order)
    pytest.param("gemma3", "float32", marks=pytest.mark.slow),
    pytest.param("gemma3", "bfloat16", marks=pytest.mark.slow)])
def test_load_target_on_device_is_the_host_load(tmp_path, monkeypatch, model, dtype):
    """Every weight as `load_target` lays it out: from the stored bytes on the device, equal
    to dequantising by the `gguf` package on the host (float32 exact, bf16 the same rounding)."""
    path = {"tiny": lambda: _tiny_llama(tmp_path / "tiny.gguf"), "smollm2": assets.smollm2_gguf,
            "gemma3": assets.gemma3_gguf}[model]()
    ckpt = resolve_target(path)
    assert ckpt.source.on_device()
    # the tiny model on the tests' 8 devices; a real one on one (8 replicas twice is too much)
    mesh = make_mesh() if model == "tiny" else make_mesh(devices=jax.devices()[:1])
    ours = load_target(ckpt, mesh, jnp.dtype(dtype))
    monkeypatch.setattr(GGUFCheckpoint, "on_device", lambda self: False)
    ref = load_target(ckpt, mesh, jnp.dtype(dtype))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours),
                            jax.tree_util.tree_leaves(ref), strict=True):
        assert a.dtype == b.dtype and a.sharding == b.sharding, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))
