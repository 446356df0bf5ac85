"""The dequantizer's settings, validated as a whole (:class:`DequantizerConfig`).

Defaults follow the paper (ProWD §4.2, appendix C): τ = 0.1, λ = 1, SGD with lr 0.01,
batch 16 blocks, 5 epochs; the ladder is this fleet's 6 → 8 → 12 → 16 → 32 (the paper's
Table 2 ladder 2 → 4 → 8 → 16 → 32 is ``ladder="paper"``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from edge_client.errors import ConfigError

FULL_PRECISION = 32
LADDERS: dict[str, tuple[int, ...]] = {
    "fleet": (6, 8, 12, 16, 32),   # this fleet's bitwidths (Int6 / Int8 / Int16 devices)
    "paper": (2, 4, 8, 16, 32),    # ProWD Table 2 (ternary uplinks enter at 2)
}
#: the paper's modules: a 64x64x3x3 slice of a conv layer reshaped to 64 channels of 24x24
PAPER_BLOCK = (64, 24, 24)
#: the generic block: two channels of 16x16 (a block pairs element i with element i + 256)
GENERIC_BLOCK = (2, 16, 16)
BLOCKS: dict[str, tuple[int, int, int]] = {"generic": GENERIC_BLOCK, "paper": PAPER_BLOCK}


@dataclass(frozen=True)
class DequantizerConfig:
    """ProWD progressive dequantizer settings.

    Network: ``ladder`` (bitwidths π_0 < ... < π_k, each 2..16, the last may be 32 =
    float; a block φ^{π_j → π_j+1} per step), ``tau`` (φ(w) = w + τ·ρ(ρ(w))), ``block``
    ([C, H, W] of one weight block; C even; or ``"slices"``: the slice dequantizer on conv
    slices, ``dequantizer.slices``, with ``context`` "update" (the convolutions read the
    received weights: the paper's) or "global" (they read the global model the device
    started from, and the update enters per position: compiled into a lookup table per
    round for entry rungs of at most ``table_levels`` levels)), ``modules`` (cut conv layers of shape
    [64a, 64b, 3, 3] into the paper's 64x64x3x3 modules; needs ``block == (64, 24, 24)``),
    ``kernel`` (k×k convolutions inside α, β, γ: 1 = per position, 3 = the paper's),
    ``growth`` (channels each dense layer of α, β, γ adds), ``residual`` ("deviation":
    φ(w) = w + τ·(ρ'(ρ(w)) - w), or "literal": eq. 18 as printed, w + τ·ρ'(ρ(w)); both
    start as the identity, see ``network``).

    Training: ``lam`` (λ of the distillation term), ``lr``, ``optimizer`` ("sgd" | "adam"),
    ``momentum`` (SGD), ``batch`` (blocks per step), ``epochs``, ``max_train_blocks``
    (blocks drawn per epoch, 0 = all), ``buffer_size`` / ``distill_batch`` /
    ``noise_std`` (the server's unlabeled inputs, a minibatch of them per step, the
    Gaussian noise added), ``pool_rounds`` (rounds of float32 devices' weights kept to
    train on), ``models_per_round`` (float32 devices' models kept per round, plus the
    global model), ``seed``, ``background`` (train in a thread while the next rounds run,
    applied after ``train_every`` rounds, when the next training starts; False:
    in the caller, for scripts and tests), ``threads`` (torch's intra-op threads while
    training: torch's setting is per process, so it also holds for the coordinator's
    evaluation; 1 keeps the training from crowding the round loop, 0 leaves torch's
    default).

    Application: ``gate_margin`` (a layer and entry bitwidth is dequantized only when its
    held-out L1 is below ``(1 - gate_margin)`` times plain dequantization's),
    ``table_limit`` (largest lookup table, in input pairs, of a per-position network),
    ``clip`` (the shared domain's weight clip, docs/algorithms.md §1).
    """

    ladder: tuple[int, ...] = LADDERS["fleet"]
    tau: float = 0.1
    block: tuple[int, int, int] = GENERIC_BLOCK
    slices: bool = False
    context: str = "update"
    table_levels: int = 17
    modules: bool = False
    kernel: int = 1
    growth: int = 8
    residual: str = "deviation"
    lam: float = 1.0
    lr: float = 0.01
    optimizer: str = "sgd"
    momentum: float = 0.0
    batch: int = 16
    epochs: int = 5
    max_train_blocks: int = 4096
    buffer_size: int = 64
    distill_batch: int = 32
    noise_std: float = 0.1
    pool_rounds: int = 3
    models_per_round: int = 4
    gate_margin: float = 0.0
    table_limit: int = 1 << 20
    clip: float = 0.5
    seed: int = 0
    background: bool = True
    train_every: int = 1
    threads: int = 1

    @classmethod
    def from_params(cls, **params: Any) -> DequantizerConfig:
        """From keyword parameters (strings accepted where a command line gives them:
        ``ladder="paper"`` or ``"2,4,8,16,32"``, ``block="generic"|"paper"|"2x16x16"``);
        ConfigError naming the parameter otherwise."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"dequantizer 'prowd': unknown parameters {unknown}; valid: {sorted(known)}")
        p = dict(params)
        if "ladder" in p:
            p["ladder"] = _ladder(p["ladder"])
        if p.get("block") == "slices":
            p["slices"] = True
            p["block"] = GENERIC_BLOCK
        if "block" in p:
            block = _block(p["block"])
            if p["block"] == "paper" and "modules" not in p:
                p["modules"] = True
            p["block"] = block
        cfg = cls(**p)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ConfigError naming the first bad setting."""
        lad = self.ladder
        if len(lad) < 2 or any(not isinstance(b, int) or isinstance(b, bool) for b in lad):
            raise ConfigError(f"dequantizer: ladder must hold at least 2 integer bitwidths, got {lad!r}")
        if any(b2 <= b1 for b1, b2 in zip(lad, lad[1:], strict=False)):
            raise ConfigError(f"dequantizer: ladder must increase, got {list(lad)}")
        if any(not 2 <= b <= 16 for b in lad[:-1]) or not (2 <= lad[-1] <= 16 or lad[-1] == FULL_PRECISION):
            raise ConfigError(f"dequantizer: ladder bitwidths must be in 2..16 (the last may be 32), got {list(lad)}")
        c, h, w = self.block
        if c < 2 or c % 2 or h < 1 or w < 1:
            raise ConfigError(f"dequantizer: block must be [C, H, W] with an even C >= 2, got {list(self.block)}")
        if self.modules and tuple(self.block) != PAPER_BLOCK:
            raise ConfigError(f"dequantizer: modules need block {list(PAPER_BLOCK)}, got {list(self.block)}")
        if self.kernel not in (1, 3, 5):
            raise ConfigError(f"dequantizer: kernel must be 1, 3 or 5, got {self.kernel}")
        checks = [("tau", self.tau > 0), ("growth", self.growth >= 1), ("lam", self.lam >= 0),
                  ("lr", self.lr > 0), ("momentum", 0 <= self.momentum < 1), ("batch", self.batch >= 1),
                  ("epochs", self.epochs >= 0), ("max_train_blocks", self.max_train_blocks >= 0),
                  ("buffer_size", self.buffer_size >= 1), ("distill_batch", self.distill_batch >= 1),
                  ("noise_std", self.noise_std >= 0), ("pool_rounds", self.pool_rounds >= 1),
                  ("models_per_round", self.models_per_round >= 1),
                  ("gate_margin", 0 <= self.gate_margin < 1), ("table_limit", self.table_limit >= 0),
                  ("clip", 0 < self.clip < 1), ("threads", self.threads >= 0),
                  ("train_every", self.train_every >= 1)]
        for name, ok in checks:
            if not ok:
                raise ConfigError(f"dequantizer: {name} out of range: {getattr(self, name)!r}")
        if self.context not in ("update", "global"):
            raise ConfigError(f"dequantizer: context must be 'update' or 'global', got {self.context!r}")
        if self.context == "global" and not self.slices:
            raise ConfigError("dequantizer: context 'global' needs block = 'slices'")
        if self.slices and (self.modules or self.residual != "deviation"):
            raise ConfigError("dequantizer: block 'slices' takes neither modules nor residual 'literal'")
        if not 3 <= self.table_levels <= 1025:
            raise ConfigError(f"dequantizer: table_levels out of range: {self.table_levels!r}")
        if self.residual not in ("deviation", "literal"):
            raise ConfigError(f"dequantizer: residual must be 'deviation' or 'literal', got {self.residual!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ConfigError(f"dequantizer: optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")

    def network_key(self) -> dict[str, Any]:
        """What a trained network's parameters and meaning depend on: a checkpoint is
        restored only into a dequantizer with the same key."""
        keys = ("ladder", "tau", "block", "slices", "context", "modules", "kernel", "growth", "residual", "clip")
        d = asdict(self)
        return {k: list(d[k]) if isinstance(d[k], tuple) else d[k] for k in keys}


def _ladder(v: Any) -> tuple[int, ...]:
    if isinstance(v, str):
        if v in LADDERS:
            return LADDERS[v]
        try:
            return tuple(int(x) for x in v.replace("->", ",").split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"dequantizer: ladder {v!r} is not {sorted(LADDERS)} or 'b0,b1,...'") from None
    try:
        return tuple(int(x) for x in v)
    except (TypeError, ValueError):
        raise ConfigError(f"dequantizer: ladder {v!r} is not a list of bitwidths") from None


def _block(v: Any) -> tuple[int, int, int]:
    if isinstance(v, str):
        if v in BLOCKS:
            return BLOCKS[v]
        parts = v.lower().split("x")
    else:
        parts = list(v) if isinstance(v, list | tuple) else []
    try:
        c, h, w = (int(x) for x in parts)
    except (TypeError, ValueError):
        raise ConfigError(f"dequantizer: block {v!r} is not {sorted(BLOCKS)} or 'CxHxW'") from None
    return (c, h, w)
