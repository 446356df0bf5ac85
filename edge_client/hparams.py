"""The hyper-parameters a round announcement may carry: one table, read by both sides.

The coordinator validates what it will announce (:func:`validate_hparams`: an unknown key
or a value out of range is a :class:`ConfigError` naming the key). A device reads an
announcement with :func:`read_hparams`, which never raises: what it cannot use is returned
as ``{key: why}`` and reported in its update's ``not_applied``, never ignored silently.
The wire itself only requires scalar values, so a device of an older SDK still accepts
announcements with keys it does not know. ``lr_scale.<variant>`` (``lr_scale.int8``)
overrides ``lr_scale`` for one model variant (FedGroupedAvg's per-group scaling, ProWD
appendix A).

Float devices take ``lr * lr_scale`` and ``momentum`` for SGD; integer devices (and float
devices on an integer forward) step ``2^(lr_shift + round(log2 lr_scale))`` LSBs, and ``lr``
and ``momentum`` set only their FedProx / FedFOR step (docs/operations.md#what-devices-are-told-to-train).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edge_client.codecs import CODECS
from edge_client.errors import ConfigError, ProtocolError
from edge_client.protocol import FLOAT_VARIANT, model_variant, variant_bits


@dataclass(frozen=True)
class HParam:
    """One announced hyper-parameter: its type, its range (``lo``/``hi``, ``lo_open``
    excludes ``lo``) or ``choices``, and what it does."""

    name: str
    kind: type
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable, or None."""
        if self.kind is bool:
            return None if isinstance(value, bool) else f"expected a boolean, got {value!r}"
        if self.kind is str:
            if not isinstance(value, str):
                return f"expected a string, got {value!r}"
            return None if value in self.choices else f"{value!r} is not one of {list(self.choices)}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {value!r}"
        if self.kind is int and not (isinstance(value, int) or float(value).is_integer()):
            return f"expected an integer, got {value!r}"
        if not math.isfinite(value):
            return f"not finite ({value!r})"
        below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        if below or (self.hi is not None and value > self.hi):
            left = "(" if self.lo_open else "["
            return f"{value!r} out of range {left}{self.lo:g}, {self.hi:g}]"
        return None


_TABLE = (
    HParam("epochs", int, "local epochs per round", 0, 10_000),
    HParam("steps", int, "local steps per round; overrides epochs when > 0", 0, 10_000_000),
    HParam("batch", int, "local batch size", 1, 65_536),
    HParam("lr", float, "float devices' SGD learning rate (integer devices: the step of the "
           "FedProx/FedFOR terms)", 0, 10, lo_open=True),
    HParam("momentum", float, "float devices' SGD momentum (integer devices: see lr)", 0, 0.99),
    HParam("grad_clip", float, "float devices' gradient-norm clip (0: off)", 0, 1e6),
    HParam("lr_shift", int, "integer devices' step eta = 2^lr_shift LSBs of the 8-bit grid (and float "
           "devices' on an integer float_forward)", -8, 8),
    HParam("lr_scale", float, "multiplies the learning rate (lr_scale.<variant>: one group's)",
           0, 16, lo_open=True),
    HParam("prox_mu", float, "FedProx mu: + mu/2 ||w - w_global||^2", 0, 10),
    HParam("fedfor_alpha", float, "FedFOR alpha (with the last global step the model carries)",
           0, 100),
    HParam("content", str, "what updates hold: the local weights or the update W - W_global",
           choices=("weights", "delta")),
    HParam("ws", bool, "weight standardization in the forward pass (FedWSQ; float devices)"),
    HParam("wn", bool, "weight normalization in the float forward (ProWD appendix B; float devices): "
           "each output channel's weights used as sqrt(2) W_c / ||W_c||"),
    HParam("codec", str, "uplink codec, overriding the device profile's", choices=tuple(CODECS)),
    HParam("codec_bits", int, "uplink codec bits, overriding the device profile's", 1, 32),
    HParam("kmeans_method", str, "K-means uplink: 'fast' (optimal 1-D) or 'authors' (FedShift's "
           "code: random init, Lloyd)", choices=("fast", "authors")),
    HParam("float_forward", str, "the network float devices train (and the coordinator evaluates "
           "as float32): 'float32', their float forward W/alpha, or 'int<s>', the s-bit integer "
           "devices' forward (0.5 ternary(W) straight-through to W, s-bit activations), so that "
           "one global model is one function for every group",
           choices=(FLOAT_VARIANT, *(model_variant(b, "int") for b in range(2, 17)))),
    HParam("float_step", str, "float devices' data step on the float forward: 'sgd' (lr, momentum, "
           "grad_clip) or 'integer' (the integer devices' normalized step, lr_shift: a control that "
           "changes the optimizer and not the forward)", choices=("sgd", "integer")),
)
#: every hyper-parameter an announcement may carry, by name
HPARAMS: dict[str, HParam] = {h.name: h for h in _TABLE}
#: keys that may also be given per model variant, ``<key>.<variant>``
PER_VARIANT = frozenset({"lr_scale"})
#: keys the coordinator adds itself (``run``: the coordinator run's token; ``secagg``: a secure
#: round's session, hex, and ``secagg_degree`` its graph's k: edge_client.secagg)
RESERVED = frozenset({"run", "secagg", "secagg_degree"})


def _spec_of(key: str) -> tuple[HParam | None, str | None]:
    """(the entry of ``key``, the variant of a ``<key>.<variant>`` key or None)."""
    base, dot, variant = key.partition(".")
    if not dot:
        return HPARAMS.get(key), None
    if base in PER_VARIANT and _valid_variant(variant):
        return HPARAMS[base], variant
    return None, None


def _valid_variant(v: str) -> bool:
    try:
        variant_bits(v)
    except ProtocolError:
        return False
    return True


def validate_hparams(hparams: Mapping[str, Any], where: str = "hparams") -> None:
    """The coordinator's check of what it will announce: :class:`ConfigError` naming the
    first unknown key (or a reserved one) or bad value."""
    for key, value in hparams.items():
        if key in RESERVED:
            raise ConfigError(f"{where}.{key}: reserved (the coordinator sets it)")
        spec, _ = _spec_of(str(key))
        if spec is None:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(HPARAMS)}; "
                              f"per variant: {', '.join(f'{k}.<variant>' for k in sorted(PER_VARIANT))})")
        why = spec.problem(value)
        if why:
            raise ConfigError(f"{where}.{key}: {why}")


def read_hparams(hparams: Mapping[str, Any], variant: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A device's reading of an announcement: ``(values, not_applied)``.

    ``values`` holds the announced, valid values by name (absent: not announced), with the
    ``<key>.<variant>`` entry of ``variant`` in place of ``<key>``; ``not_applied`` maps every
    key the device cannot use (unknown, or a bad value) to the reason. Reserved keys and
    other variants' entries are neither."""
    values: dict[str, Any] = {}
    own: dict[str, Any] = {}
    not_applied: dict[str, str] = {}
    for key, value in hparams.items():
        if key in RESERVED:
            continue
        spec, v = _spec_of(str(key))
        if spec is None:
            not_applied[str(key)] = "unknown hyper-parameter"
            continue
        if v is not None and v != variant:
            continue
        why = spec.problem(value)
        if why:
            not_applied[str(key)] = why
            continue
        value = spec.kind(value)
        (own if v is not None else values)[spec.name] = value
    values.update(own)
    return values, not_applied


# --------------------------------------------------------------------------- a device's round

#: what a device trains with when an announcement leaves a key out
DEVICE_DEFAULTS: dict[str, Any] = {"epochs": 1, "steps": 0, "batch": 32, "prox_mu": 0.0,
                                   "fedfor_alpha": 0.0, "lr_scale": 1.0}


@dataclass
class RoundSettings:
    """What one device does in one round, from the announcement and its own profile.

    ``lr``/``momentum``/``grad_clip``/``lr_shift``/``ws``/``float_forward``: None when not
    announced or not this device's to apply (the trainer's own value);
    ``codec``/``codec_bits``/``kmeans_method``: the profile's unless
    announced; ``content``: announced, else ``delta`` for DANUQ (it quantizes the update by
    definition, docs/algorithms.md §3) and ``weights`` for every other codec. ``not_applied``:
    announced keys this device does not use, with the reason (reported in its update).
    """

    epochs: int
    steps: int
    batch: int
    prox_mu: float
    fedfor_alpha: float
    lr_scale: float
    content: str
    codec: str
    codec_bits: int
    kmeans_method: str
    lr: float | None = None
    momentum: float | None = None
    grad_clip: float | None = None
    lr_shift: int | None = None
    ws: bool | None = None
    wn: bool | None = None
    float_forward: str | None = None
    float_step: str | None = None
    not_applied: dict[str, str] = field(default_factory=dict)


#: settings a device is expected not to apply in a mixed fleet: an Int6 or Int16 device
#: under the fleet's ``float_forward = "int8"`` trains its own forward, the closest it
#: has. Reported and counted like any other, but logged at INFO, not WARNING: the default
#: demo's fleet has such devices, and a newcomer's first run should not read as broken.
EXPECTED_NOT_APPLIED = frozenset({"float_forward"})


def not_applied_level(keys: Iterable[str]) -> int:
    """The level at which the first report of the not-applied settings ``keys`` is logged:
    INFO when every one is expected in a mixed fleet (:data:`EXPECTED_NOT_APPLIED`), else
    WARNING (later reports of the same go to DEBUG)."""
    return logging.INFO if set(keys) <= EXPECTED_NOT_APPLIED else logging.WARNING


def round_settings(hparams: Mapping[str, Any], *, variant: str, codec: str, codec_bits: int,
                   kmeans_method: str = "fast") -> RoundSettings:
    """A device's settings for a round (``variant``: its model variant, ``float32`` or
    ``int<s>``; ``codec``/``codec_bits``/``kmeans_method``: its profile's). Never raises:
    what it cannot honour lands in ``not_applied``.

    Device rules: ``ws`` needs a float device (the integer forward is ternary) that trains
    the float forward (``float_forward`` ``float32``); so does ``wn``, which is the float
    devices' own setting (an integer device does not report it) and gives way to ``ws``;
    ``float_forward`` is the float
    devices' network: an integer device always trains its own forward and reports an
    announced ``int<s'>`` of another bitwidth (the fleet's function is not its own; the
    default ``float32`` concerns float devices only and is not reported); an
    integer-only codec (``int``) needs an integer device; an announced codec without
    ``codec_bits`` keeps the profile's bits, clamped to the codec's range; ``content``
    defaults to the codec's (``delta`` for DANUQ); settings meant for the other kind of
    device (``lr_shift`` on a float device that trains the float forward, ``grad_clip`` on
    an integer one or on a float device that trains an integer forward, whose step is the
    integer devices') and
    ``kmeans_method`` on a device whose uplink is not K-means are not theirs to apply and
    are not reported; nor is ``float_step`` on a device that does not train the float
    forward (its step is the integer one anyway)."""
    values, not_applied = read_hparams(hparams, variant)
    integer = variant != "float32"
    if values.get("ws") and integer:
        not_applied["ws"] = "integer device: its forward pass is ternary, no weight standardization"
        values.pop("ws")
    if integer:
        values.pop("wn", None)  # the float devices' setting (ProWD's float clients): not reported
    if values.get("wn") and values.get("ws"):
        not_applied["wn"] = "weight standardization (ws) is on; the two exclude each other"
        values.pop("wn")
    forward = values.pop("float_forward", None)
    step = values.pop("float_step", None) if not integer and forward in (None, FLOAT_VARIANT) else None
    int_step = integer or forward not in (None, FLOAT_VARIANT) or step == "integer"
    if integer:
        if forward not in (None, FLOAT_VARIANT, variant):
            not_applied["float_forward"] = f"an {variant} device trains its own forward ({variant}), not {forward}"
        forward = None
    elif forward not in (None, FLOAT_VARIANT):
        for key, what in (("ws", "standardization"), ("wn", "normalization")):
            if values.get(key):
                not_applied[key] = f"no weight {what} in the integer forward ({forward})"
                values.pop(key)
    new_codec = values.get("codec", codec)
    if CODECS[new_codec].integer_only and not integer:
        not_applied["codec"] = f"codec {new_codec!r} needs an integer device"
        new_codec = codec
    lo, hi = CODECS[new_codec].bits_range
    bits = codec_bits if new_codec == codec else min(max(codec_bits, lo), hi)
    if "codec_bits" in values:
        want = values["codec_bits"]
        if lo <= want <= hi:
            bits = want
        else:
            not_applied["codec_bits"] = f"{want} is outside {new_codec}'s range {lo}..{hi}"
    content = values.get("content", CODECS[new_codec].default_content)
    return RoundSettings(
        epochs=values.get("epochs", DEVICE_DEFAULTS["epochs"]),
        steps=values.get("steps", DEVICE_DEFAULTS["steps"]),
        batch=values.get("batch", DEVICE_DEFAULTS["batch"]),
        prox_mu=values.get("prox_mu", DEVICE_DEFAULTS["prox_mu"]),
        fedfor_alpha=values.get("fedfor_alpha", DEVICE_DEFAULTS["fedfor_alpha"]),
        lr_scale=values.get("lr_scale", DEVICE_DEFAULTS["lr_scale"]),
        content=content, codec=new_codec, codec_bits=bits,
        kmeans_method=values.get("kmeans_method", kmeans_method),
        lr=values.get("lr"), momentum=values.get("momentum"),
        grad_clip=None if int_step else values.get("grad_clip"),
        lr_shift=values.get("lr_shift") if int_step else None,
        ws=values.get("ws"), wn=values.get("wn"), float_forward=forward, float_step=step, not_applied=not_applied,
    )
