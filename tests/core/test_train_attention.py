"""`--attention` of train and eval, one typed value: checked and resolved once
(core/train_attention.py), read by the trainer as `TTTConfig.attention`."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from eagle3kit.core import ttt
from eagle3kit.core.train_attention import (
    CHOICES,
    TrainAttention,
    check_attention,
    resolve_attention,
)
from eagle3kit.errors import UserError
from eagle3kit.jobs.config import ATTENTION

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("backend, dtype, draft_dtype, expected", [
    ("gpu", BF16, BF16, "pallas"),  # the fused TTT kernel: 16-bit target and draft on a GPU
    ("gpu", F16, BF16, "pallas"),
    ("gpu", BF16, F32, "cudnn"),  # an fp32 draft: the target still through cuDNN
    ("gpu", BF16, None, "cudnn"),
    ("gpu", F32, BF16, "xla"),  # an fp32 target: no cuDNN flash attention
    ("cpu", BF16, BF16, "xla"),
    ("tpu", BF16, BF16, "xla"),
])
def test_auto_resolves_by_backend_and_dtypes(backend, dtype, draft_dtype, expected):
    got = resolve_attention("auto", backend, dtype, draft_dtype)
    assert type(got) is TrainAttention and got == expected


@pytest.mark.parametrize("choice", ["xla", "cudnn", "pallas"])
def test_a_named_kernel_is_kept_on_any_backend(choice):
    assert resolve_attention(choice, "cpu", F32, F32) is TrainAttention(choice)


def test_an_unknown_choice_is_one_line_naming_the_choices():
    with pytest.raises(UserError, match=r"^--attention 'flash': choose auto, xla, cudnn, "
                                        r"pallas$"):
        check_attention("flash")
    with pytest.raises(UserError, match="--attention 'flash'"):
        resolve_attention("flash", "gpu", BF16, BF16)
    assert ATTENTION == CHOICES  # the command line offers exactly what resolves


def test_the_targets_kernel_under_pallas_is_cudnn_on_gpus_only():
    assert TrainAttention.PALLAS.target("gpu") == "cudnn"
    assert TrainAttention.PALLAS.target("cpu") == "xla"
    assert [TrainAttention(a).target("gpu") for a in ("xla", "cudnn")] == ["xla", "cudnn"]


def test_the_trainer_reads_one_typed_value():
    assert ttt.TTTConfig(attention="pallas").attention is TrainAttention.PALLAS
    assert ttt.TTTConfig().attention is TrainAttention.XLA
    assert ttt.TTTConfig(attention="cudnn") == ttt.TTTConfig(attention=TrainAttention.CUDNN)
    with pytest.raises(ValueError):
        ttt.TTTConfig(attention="auto")  # resolved at the job boundary, never in the trainer
