"""``gpuio.ray``: a gpuio index as a Ray Dataset (``read``), its consumer's position as a
Loader state (``state_dict``), and a ``collate_fn`` that runs ops on the trainer's device
(``Collate``). The pipeline's room holds it (``gpuio.pipeline.ray``, whose docstring
says how it reads, orders and resumes); ``pip install 'gpuio[ray]'``; ``import gpuio``
does not import this module or Ray."""

from gpuio.pipeline.ray import Collate, read, state_dict

__all__ = ["Collate", "read", "state_dict"]
