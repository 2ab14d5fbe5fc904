"""``gpuio.ray``: a gpuio index as a Ray Dataset (``read``), its consumer's position as a
Loader state (``state_dict``), a ``collate_fn`` that runs ops on the trainer's device
(``Collate``), and ``gpuio pack`` with its shards as Ray tasks (``pack``, from
``gpuio._pack``). The pipeline's room holds the rest (``gpuio.pipeline.ray``, whose docstring
says how it reads, orders and resumes); ``pip install 'gpuio[ray]'``; ``import gpuio``
does not import this module or Ray."""

from gpuio._pack import ray_pack as pack
from gpuio.pipeline.ray import Collate, read, state_dict

__all__ = ["Collate", "pack", "read", "state_dict"]
