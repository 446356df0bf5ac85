"""Uplink/downlink codecs and bit packing (docs/algorithms.md §3).

>>> from edge_client.codecs import get_codec, encode, decode
>>> t = encode(x, codec="kmeans", bits=4)        # -> EncodedTensor  # doctest: +SKIP
>>> y = decode(t)                                 # float32, shape x.shape  # doctest: +SKIP
>>> decode(t, out=buf); decode_accumulate(t, acc, 0.1)  # server side  # doctest: +SKIP

Codecs: ``float32`` (32), ``float16`` (16), ``asym`` (1..16), ``kmeans`` (1..8),
``ternary`` (2), ``int`` (2..16), ``danuq`` (1..8); one module each, the registry in
:mod:`.registry`, the bit order in :mod:`.bitpack`. What is encoded (full weights, the
update, the device's integers) is the caller's choice. Encoding raises ``CodecError``;
decoding a malformed received tensor raises ``ProtocolError`` naming the field. Empty
tensors are supported by every codec (empty payload, neutral aux).
"""

from edge_client.codecs.base import Codec
from edge_client.codecs.bitpack import pack, packed_nbytes, unpack
from edge_client.codecs.registry import (
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

__all__ = [
    "Codec",
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
