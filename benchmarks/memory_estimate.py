"""Memory of one TTT training step for a target config, without allocating it (`jax.eval_shape`).

    python benchmarks/memory_estimate.py benchmarks/configs/qwen3-30b-a3b.json \
        benchmarks/configs/gpt-oss-20b.json benchmarks/configs/gemma-3-27b-it.json
    python benchmarks/memory_estimate.py benchmarks/configs/gpt-oss-20b.json --compile

Counts, per device of the mesh, the frozen target's bf16 weights, the draft's fp32 training
state (weights + AdamW moments) and the batch, all from abstract shapes. `--compile` also
lowers and compiles the whole step for the local backend (no weights allocated) and adds
XLA's temporary buffers: the activations of the target forward and the K-step rollout
(on CPU an upper bound of what the GPU compiler keeps live).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from eagle3kit.core import ttt
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.optim import OptimConfig
from eagle3kit.core.sharding import make_mesh, shape_dtypes, use_mesh
from eagle3kit.core.target import LayerList, TargetWeights, layer_list
from eagle3kit.core.trainer import Trainer
from eagle3kit.core.vocab import VocabMap
from eagle3kit.core.vocab_arrays import VocabArrays

GiB = 2**30


def tree_bytes(tree, mesh=None) -> float:
    """Bytes per device of a pytree of ShapeDtypeStructs (sharded ones divided up)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        n = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        sh = getattr(x, "sharding", None)
        if sh is not None and mesh is not None:
            n = math.prod(sh.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
        total += n
    return total


def per_layer(w: TargetWeights, tcfg: TargetConfig) -> LayerList:
    """Abstract `target.unstack_in_place`: each layer's slice keeps its stack's sharding."""
    def drop(a):
        spec = NamedSharding(a.sharding.mesh, PartitionSpec(*a.sharding.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=spec)

    def split(stack) -> list:
        return [jax.tree.map(drop, stack)] * jax.tree.leaves(stack)[0].shape[0]

    return layer_list(w, tcfg, split)


def estimate(config_path: str, batch: int, seq_len: int, steps: int, draft_vocab: int,
             mesh_spec: str | None, compile_step: bool) -> dict:
    tcfg = TargetConfig.from_hf_config(json.loads(Path(config_path).read_text()),
                                       source=config_path)
    mesh = make_mesh(mesh_spec)
    dcfg = DraftConfig.for_target(tcfg, draft_vocab)
    trainer = Trainer(tcfg, dcfg, ttt.TTTConfig(steps, 0.8, jnp.bfloat16, "xla"),
                      OptimConfig(total_steps=100), mesh)
    target_w = shape_dtypes(TargetWeights.abstract(tcfg, jnp.bfloat16), mesh)
    state = trainer.abstract_state()
    batch_shapes = ttt.Batch(**{k: jax.ShapeDtypeStruct((1, batch, seq_len), jnp.int32,
                                                        sharding=trainer.batch_sharding)
                                for k in ("tokens", "loss_mask", "segment_ids", "positions")})
    out = {
        "target": Path(config_path).name, "params_B": tcfg.num_params / 1e9,
        "active_params_B": tcfg.active_params / 1e9, "devices": mesh.size,
        "target_weights_GiB": tree_bytes(target_w, mesh) / GiB,
        "draft_state_GiB": tree_bytes(state) / GiB,
        "batch_GiB": tree_bytes(batch_shapes, mesh) / GiB,
    }
    if compile_step:
        target_w = per_layer(target_w, tcfg)  # the layout `eagle3kit train` steps with
        vocab = VocabArrays.from_map(VocabMap.from_ids(np.arange(draft_vocab),
                                                            tcfg.vocab_size))
        vocab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), vocab)
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             state, trainer.state_shardings)
        with use_mesh(mesh):
            compiled = jax.jit(trainer._train_step).lower(
                state, target_w, vocab, batch_shapes,
                jax.ShapeDtypeStruct((), jnp.float32)).compile()  # the update's LR
        mem = compiled.memory_analysis()
        out["xla_temp_GiB"] = mem.temp_size_in_bytes / GiB
    out["total_GiB"] = sum(v for k, v in out.items() if k.endswith("_GiB"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="HF config.json files")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--ttt-length", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--mesh", default="data=1,tensor=1")
    p.add_argument("--compile", action="store_true", help="add XLA's temporaries (slow)")
    args = p.parse_args()
    for path in args.configs:
        r = estimate(path, args.batch_size, args.seq_len, args.ttt_length, args.draft_vocab,
                     args.mesh, args.compile)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
