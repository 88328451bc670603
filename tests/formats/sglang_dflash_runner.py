"""SGLang's own DFlash draft model (`sglang/srt/models/dflash.py`, SGLang 0.5.23) building
itself from an export's config and loading its tensors on CPU torch, in a process of its own:

    python tests/formats/sglang_dflash_runner.py EXPORT_DIR REPORT.json

The report: the config SGLang parsed (`parse_dflash_draft_config`: block size, target layer
ids, mask token id), the parameters `DFlashDraftModel.__init__` built, which parameters each
tensor landed in (its `load_weights` silently skips a name it has no parameter for) and which
no tensor wrote. The runtime shims are tests/formats/sglang_runner.py's (a world of one,
stand-ins for packages SGLang imports but that are not installed; here also for SGLang's
CUDA-graph runners and OpenAI request schemas); the forward is not run (its
attention is RadixAttention's kernels over SGLang's KV cache).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.formats.sglang_runner import _StubModule, _world_of_one, import_sglang  # noqa: E402


def main(directory: Path, report: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    _, parallel = import_sglang()
    # the CUDA-graph runners (only `get_is_capture_mode`, a capture flag the forward reads) and
    # the OpenAI server's request schemas (pydantic models over stand-in types): neither builds
    # nor loads a model
    for name in ("sglang.srt.model_executor.runner", "sglang.srt.entrypoints.openai.protocol"):
        sys.modules[name] = _StubModule(name)
    import sglang.srt.models.dflash as dflash
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    config = AutoConfig.from_pretrained(directory)
    parsed = parse_dflash_draft_config(draft_hf_config=config)
    model = _world_of_one(parallel, lambda: dflash.DFlashDraftModel(config)).eval()
    params = dict(model.named_parameters())
    landed = {}
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
        for name, tensor in load_file(str(directory / "model.safetensors")).items():
            before = {k: int(p.isnan().sum()) for k, p in params.items()}
            model.load_weights([(name, tensor)])
            landed[name] = sorted(k for k, p in params.items() if int(p.isnan().sum()) < before[k])
    report.write_text(json.dumps({
        "architectures": list(config.architectures),
        "block_size": parsed.block_size,
        "target_layer_ids": parsed.resolve_target_layer_ids(
            target_num_layers=parsed.num_target_layers),
        "mask_token_id": parsed.mask_token_id,
        "num_hidden_layers": parsed.num_hidden_layers,
        "parameters": {k: list(p.shape) for k, p in params.items()},
        "landed": landed,
        "unwritten": sorted(k for k, p in params.items() if p.isnan().any()),
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
