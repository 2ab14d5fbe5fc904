"""The storage core: a batch's extents read with few, large, parallel reads into one
buffer.

- ``plan``: read plans (a batch's extents sorted, merged and aligned, and where each
  sample's bytes land in the destination buffer);
- ``reader``: the ``Reader`` that executes plans, ``read``/``read_fields``/``read_sample``,
  ``learn_lengths`` (the sizes of extents indexed without them);
- ``_posix`` (with its C read loop ``_readloop.c``): parallel ``preadv`` into host memory;
- ``_kvikio``: kvikio/cuFile reads into GPU memory (GPUDirect Storage where present);
- ``remote``: objects in S3 and on HTTP(S) (``s3://``, ``http(s)://``), read by ranged GETs;
- ``cache``: the node-local cache tier of remote data, read back through posix;
- ``_handles``: cached file handles; ``buffers``: the byte-budgeted buffer pool;
- ``_deferred``: GPU memory kept until the streams that read it have passed;
- ``_fielddecode``: value fields decoded as their format says (ints, JSON, ``.npy``).
"""

from gpuio.storage.reader import Reader, learn_lengths, read, read_fields, read_sample

__all__ = ["Reader", "read", "read_fields", "read_sample", "learn_lengths"]
