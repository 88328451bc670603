"""SGLang's own EAGLE3 draft model (`sglang/srt/models/llama_eagle3.py`, SGLang 0.5.23) loading
and running an export on CPU torch, in a process of its own:

    python tests/formats/sglang_runner.py REQUEST.json

REQUEST lists cases {"export": DIR, "inputs": NPZ, "outputs": NPZ}; NPZ inputs hold `embeds`
[B, T, D] (the target's embedding of the tokens), `aux` [B, T, 3H] (the captured target states,
in SGLang's capture order) and `steps`. Each case writes `logits` [steps, B, T, V] (-inf off
the draft vocabulary, as SGLang maps draft ids with d2t) and beside it a JSON report: the
parameters SGLang built, the config it read, which parameters each tensor of the export
landed in (SGLang's `load_weights` silently skips a name it has no parameter for) and which
parameters no tensor wrote.

What runs is SGLang's code: the config read by `LlamaForCausalLMEagle3.__init__`, its weight
loading (name mapping, fused qkv / gate_up shards, d2t), and the draft forward (`LlamaModel`:
fc_norm per aux chunk, fc, the decoder layer with SGLang's fused residual RMSNorms, rotary
embedding, MLP, the final norm and the `norm_output` choice of the carried state). Shimmed,
none of it EAGLE math:
- third-party packages SGLang imports but that are not installed (CUDA kernels, servers) are
  inert stand-ins, created only for imports made from SGLang's own files;
- the runtime context is a world of one: tensor/pipeline parallel size 1, rank 0, and
  unpublished server flags read as off;
- the attention backend (RadixAttention's GPU kernels over a KV cache) is causal softmax
  attention over the step's own tokens, as eagle3kit's teacher-forced steps attend;
- the LogitsProcessor is not built: logits are the normed state times `lm_head.weight`, its
  computation on one rank for a Llama head (no soft-capping or scaling).
A forward that touched a stand-in would give garbage, not eagle3kit's logits.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path

_STUBBED: list[str] = []


class _StubMeta(type):
    """An inert stand-in: any attribute is another one, calling it with a function returns the
    function (decorators), calling it otherwise returns an instance, and it is falsy."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


class _Stub(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _stub("result")()


def _stub(name: str) -> type:
    return _StubMeta(name, (_Stub,), {})


class _StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub(name)
        setattr(self, name, value)
        return value


class _MissingFromSGLang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for a package that is not installed, when SGLang's own files import it."""

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top == "sglang":
            return None
        if top not in {n.split(".")[0] for n in _STUBBED}:
            for finder in sys.meta_path:
                if finder is not self and _finds(finder, name, path, target):
                    return None
            frame = sys._getframe(1)
            while frame and ("importlib" in frame.f_code.co_filename
                             or frame.f_code.co_filename.startswith("<frozen")):
                frame = frame.f_back
            if not (frame and "/sglang/" in frame.f_code.co_filename):
                return None
        _STUBBED.append(name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


def _finds(finder, name, path, target) -> bool:
    try:
        return finder.find_spec(name, path, target) is not None
    except Exception:
        return False


def import_sglang():
    """sglang.srt.models.llama_eagle3, with torch's and transformers' optional backends
    resolved before any stand-in exists (so neither takes one for a real package)."""
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils._triton as triton_probe
    from transformers import AutoProcessor, LlamaConfig  # noqa: F401

    triton_probe.has_triton_package()
    triton_probe.has_triton()
    sys.meta_path.append(_MissingFromSGLang())
    import sglang.srt.models.llama_eagle3 as eagle3
    import sglang.srt.runtime_context as runtime

    class Flags:  # an unpublished server-args namespace: every flag off
        def __init__(self, path):
            self._path = path

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return None if name == "speculative_draft_window_size" else Flags(name)

        def __bool__(self):
            return False

        def __eq__(self, other):
            return other is None or other is False

        __hash__ = object.__hash__

    runtime.RuntimeContext.config_bag = lambda self, name: Flags(name)
    eagle3.LogitsProcessor = lambda config: None
    return eagle3, runtime.get_parallel()


class _Group:  # a process group of one
    world_size, rank_in_group, rank, is_first_rank, is_last_rank = 1, 0, 0, True, True


def _world_of_one(parallel, fn):
    """fn(), writing each parallel name SGLang reads for a world of one as it asks."""
    for _ in range(64):
        try:
            return fn()
        except (RuntimeError, ValueError) as e:
            tb, name = e.__traceback__, None
            while tb:
                if tb.tb_frame.f_code.co_name == "_read":
                    name = tb.tb_frame.f_locals.get("name")
                tb = tb.tb_next
            if not name:
                raise
            parallel._stamp[name] = (_Group() if name.endswith("group") else
                                     False if name.startswith("enable") else
                                     0 if "rank" in name else 1)
    raise RuntimeError("SGLang asked for too many parallel names")


def _causal_attention(attn):
    import torch

    def forward(q, k, v, forward_batch, **kwargs):
        t, nq, nk, hd = q.shape[0], attn.tp_q_head_num, attn.tp_k_head_num, attn.head_dim
        q, k, v = (x.reshape(t, n, hd).transpose(0, 1) for x, n in ((q, nq), (k, nk), (v, nk)))
        k, v = k.repeat_interleave(nq // nk, 0), v.repeat_interleave(nq // nk, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             scale=attn.scaling)
        return o.transpose(0, 1).reshape(t, nq * hd)

    return forward


def load(eagle3, parallel, directory: Path):
    """The model SGLang builds for `directory`, and which parameters each tensor wrote."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    model = _world_of_one(parallel, lambda: eagle3.LlamaForCausalLMEagle3(config)).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
        landed = {}
        for name, tensor in load_file(str(directory / "model.safetensors")).items():
            before = {k: int(p.isnan().sum()) for k, p in params.items()}
            model.load_weights([(name, tensor)])
            landed[name] = sorted(k for k, p in params.items() if int(p.isnan().sum()) < before[k])
    vd = config.draft_vocab_size
    unwritten = sorted(k for k, p in params.items()
                       if (p[:vd] if k == "lm_head.weight" else p).isnan().any())
    report = {
        "parameters": {k: list(p.shape) for k, p in params.items()},
        "landed": landed, "unwritten": unwritten,
        "fc_norm": model.model.fc_norm is not None,
        "norm_output": bool(model.model.norm_output),
        "num_aux_hidden_states": model.model.num_aux_hidden_states,
        "hot_token_id": None if model.hot_token_id is None else model.hot_token_id.tolist(),
    }
    for layer in model.model.layers:
        layer.self_attn.attn.forward = _causal_attention(layer.self_attn.attn)
    return model, config, report


def run(model, config, parallel, embeds, aux, steps: int):
    """`steps` draft steps per row -> logits [steps, B, T, V]: the first reads the captured
    states (fc), each later one the state the previous step carried."""
    import numpy as np
    import torch

    b, t, _ = embeds.shape
    mode = types.SimpleNamespace(is_extend=lambda: True, is_decode=lambda: False,
                                 is_draft_extend_v2=lambda: False, is_idle=lambda: False)
    lm_head = model.lm_head.weight[: config.draft_vocab_size]
    out = np.full((steps, b, t, config.vocab_size), -np.inf, np.float32)
    with torch.no_grad():
        for row in range(b):
            hidden = torch.from_numpy(aux[row])
            for k in range(steps):
                batch = types.SimpleNamespace(
                    spec_info=types.SimpleNamespace(hidden_states=hidden), forward_mode=mode,
                    mm_input_embeds=None, contains_mm_inputs=lambda: False)
                args = (torch.zeros(t, dtype=torch.long), torch.arange(t) + k, batch)
                normed, (hidden,) = _world_of_one(parallel, lambda a=args, e=embeds[row]: model.model(
                    *a, input_embeds=torch.from_numpy(e)))
                out[k, row][:, model.hot_token_id.numpy()] = (normed @ lm_head.T).numpy()
    return out


def main(request: Path) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    eagle3, parallel = import_sglang()
    for case in json.loads(request.read_text()):
        model, config, report = load(eagle3, parallel, Path(case["export"]))
        inputs = np.load(case["inputs"])
        logits = run(model, config, parallel, inputs["embeds"], inputs["aux"],
                     int(inputs["steps"]))
        np.savez(case["outputs"], logits=logits)
        Path(case["outputs"]).with_suffix(".json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
