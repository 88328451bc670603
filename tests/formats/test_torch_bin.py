"""pytorch_model.bin read without torch and without running pickled code."""

from __future__ import annotations

import pickle
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

from eagle3kit.errors import InputError
from eagle3kit.formats import torch_bin


def test_reads_what_torch_save_wrote(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "fc.weight": torch.randn(4, 6, generator=g),
        "half": torch.randn(3, generator=g).half(),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(),
        "d2t": torch.arange(5, dtype=torch.int64) * 3,
        "t2d": torch.tensor([True, False, True]),
        "view": torch.randn(6, 4, generator=g).t(),  # non-contiguous: strides matter
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    got = torch_bin.load(tmp_path / "pytorch_model.bin")
    assert set(got) == set(state)
    for k, v in state.items():
        expected = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        actual = got[k].astype(np.float32) if got[k].dtype == ml_dtypes.bfloat16 else got[k]
        np.testing.assert_array_equal(actual, expected, err_msg=k)
    assert got["bf16"].dtype == ml_dtypes.bfloat16 and got["t2d"].dtype == np.bool_


def test_refuses_to_run_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.bin"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}))
    with pytest.raises(InputError, match="refusing to unpickle builtins.print"):
        torch_bin.load(path)
    (tmp_path / "plain.bin").write_bytes(b"not a zip")
    with pytest.raises(InputError, match="not a zip archive"):
        torch_bin.load(tmp_path / "plain.bin")
