"""Dataset formats. Each turns a dataset into a ``gpuio.SampleIndex``; reading the
bytes is the storage core's job (``gpuio.read``).

Every format function is named after its module (``formats.lmdb`` is the function in
``formats/lmdb.py``)."""

from gpuio.formats.arrow import arrow
from gpuio.formats.array_record import ArrayRecordParser, array_record
from gpuio.formats.coco import coco
from gpuio.formats.filetree import filetree
from gpuio.formats.litdata import LitDataParser, litdata
from gpuio.formats.lmdb import lmdb
from gpuio.formats.manifest import manifest
from gpuio.formats.mds import MDSParser, mds
from gpuio.formats.numpy import numpy
from gpuio.formats.parquet import PageParser, parquet
from gpuio.formats.packed import packed
from gpuio.formats.recordio import recordio
from gpuio.formats.tfrecord import tfrecord
from gpuio.formats.video import video
from gpuio.formats.webdataset import webdataset
from gpuio.formats.recordio import RecordIOParser
from gpuio.formats.tfrecord import ExampleParser
from gpuio.index import concat

# The record parsers a saved index may name, by the name it stores (``import gpuio``
# registers them with ``gpuio.index.register_parser``).
PARSERS = {"tfrecord.example": ExampleParser, "recordio": RecordIOParser, "mds": MDSParser, "litdata": LitDataParser, "array_record": ArrayRecordParser, "parquet.page": PageParser}

__all__ = ["filetree", "numpy", "coco", "webdataset", "lmdb", "tfrecord", "recordio", "video", "manifest", "packed", "mds", "litdata", "array_record", "parquet", "arrow", "concat"]
