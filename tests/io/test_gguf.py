"""io.gguf's header reader: every key/value and tensor as the `gguf` package's GGUFReader
reads them (a synthetic file with every value type, in both byte orders, and the real
SmolLM2), and bad files refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from eagle3kit.errors import InputError
from eagle3kit.io.gguf import GGUFCheckpoint, GGUFHeader


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
