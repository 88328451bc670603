"""Options shared by several commands, declared once (`train`, `eval`, `regenerate`,
`tokenize`).

Use as a parameter's type, with the default in the signature:

    def eval_cmd(target: Target, mesh: Mesh = None, dtype: Dtype = "bfloat16", ...)

Choices are checked while the command line is parsed (exit 2, one `error:` line: cli/_common.Group).
"""

from __future__ import annotations

from typing import Annotated

import typer

from eagle3kit.errors import UserError
from eagle3kit.io.dtypes import dtype_name
from eagle3kit.jobs.config import ATTENTION, COMPUTE_DTYPES


def _dtype(option: str):
    def check(value: str) -> str:
        try:
            return dtype_name(value, COMPUTE_DTYPES, option)
        except UserError as e:
            raise typer.BadParameter(str(e).removeprefix(f"{option} ")) from None
    return check


def _one_of(choices: tuple[str, ...]):
    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r}: choose {', '.join(choices)}")
        return value
    return check


Target = Annotated[str, typer.Option(
    help="Target model: HF directory, .gguf file or Hub id.", show_default=False)]
Mesh = Annotated[str | None, typer.Option(
    help="Device mesh as AXIS=N,..., e.g. data=4,tensor=2 (default: every device on data; "
         "generation uses tensor=T only, default one device).")]
Dtype = Annotated[str, typer.Option(
    callback=_dtype("--dtype"),
    help="Draft compute dtype: bfloat16 or float32 (training keeps float32 master weights and "
         "optimizer state).")]
EvalDtype = Annotated[str, typer.Option(
    "--dtype", callback=_dtype("--dtype"),
    help="The draft's compute dtype while drafting and scoring: bfloat16 or float32 (its "
         "weights are read as saved and cast).")]
TargetDtype = Annotated[str, typer.Option(
    callback=_dtype("--target-dtype"), help="Target weights: bfloat16 or float32.")]
Attention = Annotated[str, typer.Option(
    callback=_one_of(ATTENTION),
    help="Attention kernels: auto (on GPUs in bf16: pallas), xla, cudnn (the target and TTT "
         "step 0 through cuDNN flash attention), or pallas (the target through cuDNN, the TTT "
         "attention through a fused Pallas kernel; GPU).")]
# a JAX key takes 32 bits: a larger or negative seed would silently be another one (2**40 is 0)
SEED_MAX = 2**32 - 1


def _seed_in_range(value: int | None) -> int | None:
    # a callback, not min/max: typer would print the range in --help's type column and
    # widen it for every option, breaking the help texts beside it
    if value is not None and not 0 <= value <= SEED_MAX:
        raise typer.BadParameter(f"{value} is not in the range 0<=x<={SEED_MAX}")
    return value


Seed = Annotated[int, typer.Option(
    callback=_seed_in_range, help="Random seed (train: draft init and data order; eval and "
    "regenerate: sampling at temperature > 0; 0 to 2**32 - 1).")]
ChatTemplate = Annotated[str | None, typer.Option(
    "--chat-template",
    help="The chat template to render conversations with instead of the tokenizer's own "
         "(a base model's tokenizer has none): a Jinja file, a JSON file with a "
         "chat_template, or a known name: gemma (Gemma's <start_of_turn>user/model turns). "
         "Use the one you tokenized the training data with.")]
Coordinator = Annotated[str | None, typer.Option(help="Multi-host: coordinator HOST:PORT.")]
NumProcesses = Annotated[int | None, typer.Option(help="Multi-host: number of processes.")]
ProcessId = Annotated[int | None, typer.Option(help="Multi-host: this process's index.")]
