"""The pipeline: from a ``SampleIndex`` to framework tensors.

- ``order``: the epoch order and its sharding across ranks (``EpochPlan``, ``epoch_order``);
- ``_executor``: concurrent stages with bounded queues, threads and CUDA streams;
- ``loader``: ``Loader``, the batches of an index for a training loop;
- ``_collate``: a batch's rows stacked into arrays, and the hand-off to the consumer;
- ``_opfields``: what the ops read and make, checked when a loader is made;
- ``_frameworks``: arrays handed to torch, JAX or TensorFlow by DLPack;
- ``ray``: an index as a Ray Dataset (``gpuio.ray``; imported only when used).
"""

from gpuio.pipeline.loader import Loader

__all__ = ["Loader"]
