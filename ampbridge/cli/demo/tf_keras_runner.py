"""Train the demo model in tf.keras 2 (``ampbridge.tf_keras``), as ``runners.run_keras`` does in Keras 3:
the shared batches and initial weights, SGD, the loss multiplied by inf at the steps in ``inject``;
returns a :class:`~ampbridge.cli.demo.runners.Run`. The policy is applied before the model is built
(Keras 2 fixes a layer's dtype when its variables are made)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from ...core.policy import Policy
from .model import CONFIG, batches
from .runners import Progress, Run, _tick


def run_tf_keras(policy: Policy, steps: int, inject: Iterable[int] = (), *, seed: int = 0,
                 progress: Progress | None = None) -> Run:
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import ampbridge.tf_keras as atk

    from . import tf_keras_model as km

    inject = set(inject)
    run = Run("tf_keras", None)
    active = policy.at(step=0, epoch=0) if policy.phases else policy
    model = km.build(seed, policy=active)
    opt = atk.optimizer(tf_keras.optimizers.SGD(CONFIG.lr), policy)
    run.plan = atk.plan(model, active, warn=False)

    def loss_fn(targets, logits):
        return tf_keras.losses.sparse_categorical_crossentropy(targets, tf.cast(logits, "float32"), from_logits=True)

    model.compile(optimizer=opt, loss=loss_fn)
    head = model.get_layer("head").kernel
    for i, (x, y) in enumerate(batches(steps)):
        w = np.full(x.shape, np.inf if i in inject else 1.0, np.float32)  # per token, like the loss
        used, before = float(opt.loss_scale.numpy()), head.numpy()
        t0 = time.perf_counter()
        logs = model.train_on_batch(x, y, sample_weight=w, return_dict=True)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(math.nan if i in inject else float(logs["loss"]))
        run.scales.append(used)
        run.skipped.append(bool(np.array_equal(before, head.numpy())))
        _tick(progress, i)
    return run
