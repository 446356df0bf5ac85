"""Uplink/downlink codecs and bit packing (docs/algorithms.md §3).

>>> from edge_client.codecs import get_codec, encode, decode
>>> t = encode(x, codec="kmeans", bits=4)        # -> EncodedTensor  # doctest: +SKIP
>>> y = decode(t)                                 # float32, shape x.shape  # doctest: +SKIP
>>> decode(t, out=buf); decode_accumulate(t, acc, 0.1)  # server side  # doctest: +SKIP

One module per codec, one :class:`Codec` class each, which says everything about it (name,
bits range, lossiness, options, what a device encodes with it); :data:`CODECS`
(:mod:`.registry`) is the table of them that the wire, the profiles and the coordinator
read. The bit order is in :mod:`.bitpack`. Encoding raises ``CodecError``; decoding a
malformed received tensor raises ``ProtocolError`` naming the field. Empty tensors are
supported by every codec (empty payload, neutral aux).
"""

from edge_client.codecs.base import Codec
from edge_client.codecs.bitpack import pack, packed_nbytes, unpack
from edge_client.codecs.registry import (
    CODECS,
    accumulate_many,
    accumulator,
    available_codecs,
    can_accumulate,
    decode,
    decode_accumulate,
    encode,
    get_codec,
    max_abs,
)
from edge_client.codecs.uplink import DeviceUpdate

__all__ = [
    "CODECS",
    "Codec",
    "DeviceUpdate",
    "available_codecs",
    "accumulate_many",
    "accumulator",
    "can_accumulate",
    "decode",
    "decode_accumulate",
    "encode",
    "get_codec",
    "max_abs",
    "pack",
    "packed_nbytes",
    "unpack",
]
