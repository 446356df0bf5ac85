"""The wire format (docs/architecture.md#wire-protocol): message dataclasses, msgpack, validation.

Every payload is one msgpack map ``{"v": PROTOCOL_VERSION, "kind": KIND, ...fields}``.
Tensors travel per layer as ``{"name", "shape", "dtype", "codec", "bits", "data", "aux"}``
with ``len(data) == ceil(prod(shape) * bits / 8)`` exactly.

:func:`decode_message` is the only door for received bytes. It checks the payload size
before parsing, caps every msgpack container while parsing, then validates every field
(types, ranges, counts, exact byte lengths, codec/dtype whitelists, finite values) before
anything is allocated from it. Whatever is wrong, it raises :class:`ProtocolError` whose
message names the field (``tensors[2].shape``); no other exception escapes.

Topics live under ``fedbit/<job>/``: ``presence/<device>``, ``hello/<device>``, ``round``,
``model/<variant>``, ``update/<device>``, ``status``.
"""

from __future__ import annotations

from edge_client.codecs.tensor import EncodedTensor, float32_tensor, packed_length
from edge_client.protocol.messages import (
    CODEC_BITS,
    DEFAULT_LIMITS,
    DTYPES,
    FLOAT_VARIANT,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    ROUND_MODES,
    STATUS_STATES,
    TOPIC_ROOT,
    TRAINERS,
    UPDATE_CONTENTS,
    Hello,
    Limits,
    Message,
    ModelMessage,
    Presence,
    RoundAnnouncement,
    Status,
    Update,
    as_mapping,
    model_variant,
    parse_topic,
    tensors_digest,
    topic,
    valid_id,
    variant_bits,
)
from edge_client.protocol.wire import decode_message, encode_message

__all__ = [
    "CODEC_BITS", "DEFAULT_LIMITS", "DTYPES", "FLOAT_VARIANT", "MESSAGE_TYPES", "PROTOCOL_VERSION",
    "ROUND_MODES", "STATUS_STATES", "TOPIC_ROOT", "TRAINERS", "UPDATE_CONTENTS", "EncodedTensor", "Hello", "Limits",
    "Message", "ModelMessage", "Presence", "RoundAnnouncement", "Status", "Update", "as_mapping",
    "decode_message", "encode_message", "float32_tensor", "model_variant", "packed_length", "parse_topic",
    "tensors_digest", "topic", "valid_id", "variant_bits",
]
