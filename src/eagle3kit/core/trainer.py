"""The sharded TTT trainer: state, one jitted step, evaluation.

The state is initialised through `jax.eval_shape` and a jitted `init` with `out_shardings`,
so nothing is materialised on one device first. The step takes a global batch of shape
[A, B, T] (A gradient-accumulation micro-batches of B packed rows), runs the frozen target
and the draft rollout per micro-batch under `lax.scan`, and applies one AdamW update. State
and batch are donated. Layout on the (data, tensor) mesh:

- target weights: tensor-parallel (see core/sharding.RULES), replicated over `data`;
- draft weights and optimizer state: replicated (about 0.3B parameters for an 8B target:
  replication keeps the K-step rollout free of collectives; XLA all-reduces the gradient
  over `data`);
- batch rows: split over `data`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle3kit.core import arches, draft, ttt
from eagle3kit.core.config import DraftConfig, TargetConfig
from eagle3kit.core.metrics import StepCounts
from eagle3kit.core.optim import OptimConfig, make_optimizer, program_key, step_lrs
from eagle3kit.core.sharding import init_weights, shardings, spec_for, use_mesh
from eagle3kit.core.vocab_arrays import VocabArrays
from eagle3kit.named import imported


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: draft.DraftWeights  # fp32 master weights
    opt_state: Any
    step: Any  # int32 scalar


@dataclasses.dataclass
class StepMetrics:
    """Device values of one step; fetched by the host one step later."""

    loss: jax.Array
    grad_norm: jax.Array
    lr: jax.Array
    tokens: jax.Array  # non-padding tokens in the global batch
    counts: StepCounts


jax.tree_util.register_dataclass(StepMetrics, data_fields=[
    "loss", "grad_norm", "lr", "tokens", "counts"], meta_fields=[])


@functools.lru_cache(maxsize=8)
def _programs(tcfg: TargetConfig, dcfg: DraftConfig, ttt_cfg: ttt.TTTConfig, optim: OptimConfig,
              mesh: Mesh) -> dict[str, Any]:
    """The jitted init, step and eval of one combination of everything that decides them,
    filled in by the first Trainer that needs each and shared by the Trainers after it in this
    process (a sweep's runs, a run resumed in-process, an eval's batch sizes, tests): JAX's own
    cache, keyed on the function, then reuses the traced and compiled programs instead of
    tracing, lowering and compiling them again."""
    return {}


class Trainer:
    """Owns the jitted functions for one (target, draft, mesh) combination; Trainers of an
    equal combination share them (`_programs`)."""

    def __init__(self, tcfg: TargetConfig, dcfg: DraftConfig, ttt_cfg: ttt.TTTConfig,
                 optim: OptimConfig, mesh: Mesh):
        # a method that trains otherwise than EAGLE-3's rollout (core/ttt.py) names its own
        # loss, denominators and number of metric steps (DFlash: core/dflash.py)
        self.method = arches.method_module(dcfg.method)
        # its loss may live in a training module of its own (TRAINING, a dotted name)
        self.training = imported(getattr(self.method, "TRAINING", self.method))
        if hasattr(self.method, "metric_steps"):
            ttt_cfg = dataclasses.replace(ttt_cfg, steps=self.method.metric_steps(dcfg))
        self.tcfg, self.dcfg, self.ttt, self.optim, self.mesh = tcfg, dcfg, ttt_cfg, optim, mesh
        self._lrs = None  # the schedule's values, made by the first train step (not by eval)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # [A, B, T] batches: rows split over `data`
        # batch layouts from the rules table: [micro-batches, rows, tokens] and [rows, tokens]
        self.batch_sharding = NamedSharding(mesh, spec_for((None, "batch", None)))
        self.eval_batch_sharding = NamedSharding(mesh, spec_for(("batch", None)))
        abstract = self.method.Weights.abstract(dcfg, jnp.float32)
        self.param_shardings = shardings(abstract, mesh)
        self._abstract_params = abstract
        self.state_shardings = None
        # what the jitted functions read of `self` is decided by this key alone
        # (the schedule is an input of the step: runs with another --lr or --epochs share it)
        self._jitted = _programs(tcfg, dcfg, self.ttt, program_key(optim), mesh)

    # ---- state -----------------------------------------------------------------------------

    def init_state(self, key: jax.Array, params: draft.DraftWeights | None = None) -> TrainState:
        """Fresh state (random draft, or `params` from --init-from), placed in its shardings."""
        if params is None:
            params = init_weights(self._abstract_params, key, self.mesh)
        else:
            params = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params),
                                    self.param_shardings)

        shapes = jax.eval_shape(self._init, params)
        self.state_shardings = jax.tree.map(lambda _: self.replicated, shapes)
        self.state_shardings.params = self.param_shardings
        init = self._jit("init", lambda: jax.jit(self._init,
                                                  out_shardings=self.state_shardings))
        return init(params)

    def _init(self, params) -> TrainState:
        # the state holds no LR (each step is given its own): any will do to build it
        tx = make_optimizer(self.optim, lambda _: 0.0)
        return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))

    def _jit(self, name: str, make):
        """This combination's jitted `name`, made by `make()` the first time."""
        if name not in self._jitted:
            with use_mesh(self.mesh):
                self._jitted[name] = make()
        return self._jitted[name]

    def abstract_state(self) -> TrainState:
        """Shapes and dtypes of the state (for restoring a checkpoint)."""
        shapes = jax.eval_shape(self._init, jax.eval_shape(
            lambda: jax.tree.map(lambda i: jnp.zeros(i.shape, i.dtype), self._abstract_params,
                                 is_leaf=lambda x: hasattr(x, "axes"))))
        if self.state_shardings is None:
            self.state_shardings = jax.tree.map(lambda _: self.replicated, shapes)
            self.state_shardings.params = self.param_shardings
        return shapes

    # ---- step ------------------------------------------------------------------------------

    def _loss(self):
        # a method with its own rollout (core/arches.py) brings its loss; EAGLE-3's is TTT's
        loss_fn = getattr(self.training, "loss_fn", ttt.loss_fn)
        return functools.partial(loss_fn, tcfg=self.tcfg, dcfg=self.dcfg, ttt=self.ttt)

    def _denominators(self, batch: ttt.Batch) -> jax.Array:
        own = getattr(self.training, "loss_denominators", None)
        if own is not None:
            return own(batch, self.dcfg, self.ttt)
        return ttt.valid_counts(batch, self.ttt.steps)

    def _train_step(self, state: TrainState, target_w, vocab: VocabArrays, batch: ttt.Batch,
                    lr: jax.Array) -> tuple[TrainState, StepMetrics]:
        loss_fn = self._loss()
        # per-step masked-token counts over the whole global batch: the loss denominators
        flat = jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), batch)
        denominators = self._denominators(flat)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def micro(carry, mb):
            grads, loss, counts = carry
            (mb_loss, c), g = grad_fn(state.params, target_w, mb, vocab, denominators)
            return (jax.tree.map(jnp.add, grads, g), loss + mb_loss, counts + c), None

        if batch.tokens.shape[0] == 1:  # no accumulation: no loop, no zero gradients to add to
            (loss, counts), grads = grad_fn(state.params, target_w,
                                            jax.tree.map(lambda x: x[0], batch), vocab,
                                            denominators)
        else:
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            init = (zeros, jnp.zeros((), jnp.float32), StepCounts.zeros(self.ttt.steps))
            (grads, loss, counts), _ = jax.lax.scan(micro, init, batch)
        with jax.named_scope("optimizer"):
            # this update's LR, given: the schedule's settings are not constants of the program
            tx = make_optimizer(self.optim, lambda _: lr)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = StepMetrics(loss=loss, grad_norm=optax.tree.norm(grads),
                              lr=lr, tokens=(batch.segment_ids > 0).sum(),
                              counts=counts)
        return TrainState(params, opt_state, state.step + 1), metrics

    def lr(self, step: int) -> np.float32:
        """The LR of the update from `step` (0-based: the state's step before it)."""
        if self._lrs is None:
            self._lrs = step_lrs(self.optim)
        return self._lrs[min(step, len(self._lrs) - 1)]

    def train_step(self, state: TrainState, target_w, vocab: VocabArrays, batch: ttt.Batch,
                   step: int) -> tuple[TrainState, StepMetrics]:
        """One update of `state`, whose step (the host's count, so that nothing waits for the
        device to read it) is `step`."""
        jitted = self._jit("step", lambda: jax.jit(self._train_step, donate_argnums=(0,),
                                                    out_shardings=(self.state_shardings, None)))
        lr = self.lr(step)  # (its first call computes the values: outside the mesh)
        with use_mesh(self.mesh):
            return jitted(state, target_w, vocab, batch, lr)

    def _eval_step(self, params, target_w, vocab, batch: ttt.Batch) -> StepCounts:
        denominators = self._denominators(batch)
        _, counts = self._loss()(params, target_w, batch, vocab, denominators)
        return counts

    def eval_step(self, params, target_w, vocab: VocabArrays, batch: ttt.Batch
                  ) -> StepCounts:
        """Counts of one [B, T] batch, without gradient (teacher-forced acceptance)."""
        evaluate = self._jit("eval", lambda: jax.jit(self._eval_step))
        with use_mesh(self.mesh):
            return evaluate(params, target_w, vocab, batch)


def put_batch(trainer: Trainer, arrays: dict[str, Any], *, eval_batch: bool = False) -> ttt.Batch:
    """Numpy arrays of the whole global batch -> a data-sharded `Batch`.

    Every process passes the same arrays and places only the rows of its own devices
    (multi-host), so a step's batch is the same however many processes drive the mesh.
    """
    sharding = trainer.eval_batch_sharding if eval_batch else trainer.batch_sharding
    if jax.process_count() == 1:
        return ttt.Batch(**{k: jax.device_put(v, sharding) for k, v in arrays.items()})
    return ttt.Batch(**{k: jax.make_array_from_callback(v.shape, sharding,
                                                        lambda index, v=v: v[index])
                        for k, v in arrays.items()})
