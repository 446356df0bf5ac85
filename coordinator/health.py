"""Training health, watched every round: live units, zero codes, activations, collapse.

After each round's aggregate is evaluated, :class:`HealthWatch` looks at every bitwidth
group's model as that group runs it (``int<s>``: the s-bit integer engine; ``float32``:
the float forward or the announced integer forward) and writes, per group and parameter
layer, the metrics record's ``health``: ``live`` / ``units`` (units that can still fire
for some input: :mod:`edge_client.intnn.liveness`), ``zero`` (the fraction of ternary
codes at 0), ``act`` and ``sat`` (mean |activation| on a fixed probe batch, never the
test split, and the fraction at the clip), ``nonfinite`` and ``update`` (relative change).

A live count that drops is a warning; a **collapse** (every group at chance after the best
round was well above it, a constant output, a layer with no live unit or all-zero
weights, non-finite weights) is an error that ``on_collapse = "rollback"`` answers by
keeping the round without the update(s) that caused it, or the last healthy model.
Definitions, thresholds and why rollback is the default: docs/training-health.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.config import ON_COLLAPSE, ServerConfig
from edge_client.intnn.liveness import FLOAT_FORWARD, forward_codes, liveness
from edge_client.protocol import FLOAT_VARIANT, variant_bits
from firmware_models import ModelSpec

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.evaluate import Evaluator
    from coordinator.strategies.round import RoundStrategy
    from edge_client.intnn import IntModel

#: held-out samples of the probe batch (the activation figures, the constant-output check)
PROBE_SAMPLES = 64
#: an accuracy within this (absolute) of chance is "at chance"
CHANCE_MARGIN = 0.05
#: the best accuracy so far was "well above chance" when it exceeded chance by this
WELL_ABOVE = 0.25

Weights = list[np.ndarray]


@dataclass
class Verdict:
    """One round's health: ``record`` (the metrics' ``health`` entry), ``collapse`` (the
    reasons, each naming the round, group and layer), ``rolled_back`` (the coordinator
    keeps the previous model), ``scores`` (the previous model's, when rolled back and
    known), ``seconds`` (the check's wall time)."""

    record: dict[str, Any]
    collapse: list[str] = field(default_factory=list)
    rolled_back: bool = False
    scores: dict[str, tuple[Any, ...]] | None = None
    seconds: float = 0.0


class HealthWatch:
    """See the module docstring.

    Args:
        spec: the model.
        on_collapse: ``"rollback"`` or ``"log"``.
        probe: float inputs [N, C, H, W] in [0, 1] (the first ``PROBE_SAMPLES`` are used);
            None: no activation figures and no constant-output check.
        float_forward: the network the float32 group runs (``float32`` or ``int<s>``).
        accuracy_key: the group figure the accuracy rule reads (``val_accuracy``, or
            ``accuracy`` of a monitoring set); None: no accuracy rule.
        log / on_event: where the warnings, errors and events go.
    """

    def __init__(self, spec: ModelSpec, on_collapse: str = ServerConfig.on_collapse, *,
                 probe: np.ndarray | None = None, float_forward: str = FLOAT_VARIANT,
                 accuracy_key: str | None = "val_accuracy", log: logging.Logger | None = None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        from edge_client.errors import ConfigError

        if on_collapse not in ON_COLLAPSE:
            raise ConfigError(f"on_collapse: {on_collapse!r} is not one of {list(ON_COLLAPSE)}")
        self.spec = spec
        self.on_collapse = on_collapse
        self.probe = None if probe is None or len(probe) == 0 else \
            np.ascontiguousarray(probe[:PROBE_SAMPLES], dtype=np.float32)
        self.float_bits = variant_bits(float_forward)
        self.accuracy_key = accuracy_key
        self.log = log or logging.getLogger("fedbit.health")
        self.on_event = on_event or (lambda _e, _f: None)
        self.names = spec.param_names()
        self._engines: dict[int, Any] = {}
        self._snapshot: dict[str, Any] | None = None
        self._strategy: RoundStrategy | None = None

    @classmethod
    def for_run(cls, spec: ModelSpec, cfg: ServerConfig, evaluator: Evaluator | None, **kw: Any
                ) -> HealthWatch:
        """The watch of a coordinator run: ``cfg.on_collapse``, the float devices' announced
        ``float_forward``, the probe batch and the accuracy figure the evaluator offers for
        decisions (``coordinator.evaluate``: never the test split; none without an evaluator)."""
        probe = evaluator.probe(PROBE_SAMPLES) if hasattr(evaluator, "probe") else None
        return cls(spec, cfg.on_collapse, probe=probe, accuracy_key=getattr(evaluator, "decision_key", None),
                   float_forward=str(cfg.hparams.get("float_forward", FLOAT_VARIANT)), **kw)

    # ------------------------------------------------------------------ rollback

    def snapshot(self, strategy: RoundStrategy) -> None:
        """Keep the strategy's state before its ``finish()`` (rollback only): a rollback gives
        it back."""
        self._strategy = strategy
        self._snapshot = strategy.state_dict() if self.on_collapse == "rollback" else None

    # ------------------------------------------------------------------ the check

    def check(self, r: int, new: tuple[Weights, Mapping[int, Weights]], old: tuple[Weights, Mapping[int, Weights]],
              scores: Mapping[str, tuple[Any, ...]], history: Sequence[Mapping[str, Any]]) -> Verdict:
        """The health of round ``r``'s models ``new`` = (global weights, group models) against
        the previous ones ``old``; ``scores`` this round's evaluation ({variant: (loss,
        accuracy, ...)}), ``history`` the earlier rounds' records. With rollback and a
        collapse, the strategy of :meth:`snapshot` gets its state from before ``finish()`` back."""
        t0 = time.perf_counter()
        groups, collapse, warnings = self.assess(r, new, old, scores, history)
        record: dict[str, Any] = {"groups": groups}
        verdict = Verdict(record, collapse)
        if collapse:
            verdict.rolled_back = self.on_collapse == "rollback"
            if verdict.rolled_back and self._strategy is not None and self._snapshot is not None:
                self._strategy.load_state_dict(self._snapshot)
            if verdict.rolled_back:
                record["rolled_back_accuracy"] = {v: sc[1] for v, sc in sorted(scores.items())}
            if verdict.rolled_back and history:
                verdict.scores = {g: (s.get("loss"), s.get("accuracy"),
                                      {k: x for k, x in s.items() if k not in ("loss", "accuracy")})
                                  for g, s in history[-1].get("groups", {}).items()}
        for text in warnings:
            self.log.warning("%s", text, extra={"event": "health_warning", "round": r})
        for text in collapse:
            then = ("; rolled back: the round without the update(s) that caused it, else the model of "
                    f"round {r - 1}" if verdict.rolled_back else "; the model is kept (on_collapse = log)")
            self.log.error("collapse: %s%s", text, then, extra={"event": "collapse", "round": r})
        record.update({"collapse": collapse, "warnings": warnings, "rolled_back": verdict.rolled_back})
        verdict.seconds = time.perf_counter() - t0
        self._snapshot = None
        self.on_event("health", {"round": r, **record})
        if collapse:
            self.on_event("collapse", {"round": r, "reasons": collapse, "rolled_back": verdict.rolled_back})
        return verdict

    def assess(self, r: int, new: tuple[Weights, Mapping[int, Weights]], old: tuple[Weights, Mapping[int, Weights]],
               scores: Mapping[str, tuple[Any, ...]], history: Sequence[Mapping[str, Any]],
               ) -> tuple[dict[str, dict[str, dict[str, Any]]], list[str], list[str]]:
        """What :meth:`check` finds, without acting on it (nothing logged, sent or restored):
        (the figures per group and layer, the collapse reasons, the warnings)."""
        groups: dict[str, dict[str, dict[str, Any]]] = {}
        found: dict[tuple[str, str], list[str]] = {}  # (kind, text after the group) -> groups
        prev = (history[-1].get("health") or {}).get("groups", {}) if history else {}
        done: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
        for v in sorted(set(scores) | {FLOAT_VARIANT}):
            bits = variant_bits(v)
            fwd = self.float_bits if bits == 32 else bits
            w, w_old = new[1].get(bits, new[0]), old[1].get(bits, old[0])
            key = (id(w), fwd)  # groups that run the same weights in the same forward
            if key not in done:
                done[key] = self._group(w, w_old, fwd)
            layers = groups[v] = {name: dict(h) for name, h in done[key].items()}
            for text in self._problems(layers):
                found.setdefault(("collapse", text), []).append(v)
            for name, h in layers.items():
                before = prev.get(v, {}).get(name, {}).get("live")
                if isinstance(before, int) and h["live"] < before:
                    found.setdefault(("warning", f"{name}: live units {before} -> {h['live']} of {h['units']}"),
                                     []).append(v)
        collapse = [f"round {r}: {', '.join(vs)}: {text}" for (kind, text), vs in found.items() if kind == "collapse"]
        warnings = [f"round {r}: {', '.join(vs)}: {text}" for (kind, text), vs in found.items() if kind == "warning"]
        collapse += self._accuracy_collapse(r, scores, history)
        return groups, collapse, warnings

    def _problems(self, layers: dict[str, dict[str, Any]]) -> list[str]:
        """The collapse reasons of one group's layers (the probe's constant-output flag is
        taken out of the record): non-finite weights; the first layer with all-zero codes or
        no live unit (the layers after it die with it: named once); a constant output."""
        out = []
        const = layers[self.names[-1]].pop("_constant", False)
        dead_at, at = None, 0
        for name, h in layers.items():
            layers[name].pop("_constant", None)
            if h["nonfinite"]:
                out.append(f"{name}: {h['nonfinite']} non-finite weight(s)")
            elif dead_at is None and (h["zero"] >= 1.0 or h["live"] == 0):
                dead_at, at = name, len(out)
                what = "non-zero" if name == self.names[-1] else "positive"
                out.append(f"{name}: " + ("every forward weight is zero" if h["zero"] >= 1.0 else
                                          f"no live unit (0 of {h['units']} can output a {what} value)"))
        later = [n for n in self.names[self.names.index(dead_at) + 1:] if layers[n]["live"] == 0] if dead_at else []
        if later:
            out[at] += f"; with it every later layer ({', '.join(later)})"
        if const and dead_at is None:
            out.append(f"{self.names[-1]}: the output is the same for every probe sample (a constant function)")
        return out

    def _accuracy_collapse(self, r: int, scores: Mapping[str, tuple[Any, ...]],
                           history: Sequence[Mapping[str, Any]]) -> list[str]:
        """Every group at chance now, after the best round was well above it (the figure
        ``accuracy_key`` of the scores and of the earlier rounds' records)."""
        key = self.accuracy_key
        if key is None:
            return []
        chance = 1.0 / self.spec.num_classes
        now = {v: a for v, s in scores.items()
               if isinstance(a := (s[1] if key == "accuracy" else (s[2] if len(s) > 2 else {}).get(key)), int | float)
               and math.isfinite(a)}
        best = max((a for h in history for g in h.get("groups", {}).values()
                    if isinstance(a := g.get(key), int | float)), default=0.0)
        if now and best >= chance + WELL_ABOVE and max(now.values()) <= chance + CHANCE_MARGIN:
            return [f"round {r}: every group's {key} at chance ({', '.join(f'{v} {a:.3f}' for v, a in sorted(now.items()))}; "
                    f"best so far {best:.3f}, chance {chance:.3f})"]
        return []

    # ------------------------------------------------------------------ one group

    def _group(self, w: Weights, w_old: Weights, bits: int) -> dict[str, dict[str, Any]]:
        """{layer: figures} of the weights ``w`` in the ``bits`` forward (32: float)."""
        codes = [forward_codes(x, bits) for x in w]
        out: dict[str, dict[str, Any]] = {}
        for i, lv in enumerate(liveness(self.spec, w, bits, codes)):
            a, b = np.asarray(w[i], np.float32), np.asarray(w_old[i], np.float32)
            base = float(np.linalg.norm(b))
            upd = float(np.linalg.norm(a - b)) / base if base > 0 else 0.0
            out[lv.name] = {"live": lv.live, "units": lv.units, "zero": round(lv.zero_frac, 4),
                            "nonfinite": lv.nonfinite, "update": round(upd, 5) if math.isfinite(upd) else None}
        if self.probe is not None and not any(h["nonfinite"] for h in out.values()):
            acts, logits = self._probe(w, bits)
            for name, (act, sat) in zip(self.names, acts, strict=True):
                out[name]["act"], out[name]["sat"] = round(act, 5), None if sat is None else round(sat, 4)
            out[self.names[-1]]["_constant"] = bool(len(logits) > 1 and np.all(np.ptp(logits, axis=0) == 0))
        return out

    def _probe(self, w: Weights, bits: int) -> tuple[list[tuple[float, float | None]], np.ndarray]:
        """Per parameter layer (mean |activation| in real units, fraction at the clip) on the
        probe batch, and the logits [N, classes], in the ``bits`` forward."""
        x = self.probe
        if bits >= FLOAT_FORWARD:
            import torch

            tr = self._engine(bits)
            tr.load_shared(w)
            taps: list[Any] = []
            with torch.no_grad():
                z = tr.forward(torch.from_numpy(x), taps=taps).numpy()
            return [(float(np.abs(t.numpy()).mean()), None) for t in taps], z
        m = self._engine(bits)
        m.load_shared(w)
        ws = m.eval_workspace(len(x))
        n = len(x)
        ws.x[:n] = self._inputs(m, bits)
        z = m.forward(ws, n)
        scale = float(1 << (bits - 1))
        acts = []
        for op in m.param_ops:
            a = ws.acts[m.ops.index(op)][:n]
            acts.append((float(np.abs(a).mean()) / scale, float(np.mean(np.abs(a) >= m.amax))))
        return acts, np.array(z, copy=True)

    def _engine(self, bits: int) -> Any:  # IntModel | TorchTrainer, as ``bits`` says
        """The forward of ``bits`` (an ``IntModel``, or a float ``TorchTrainer``), kept."""
        if bits not in self._engines:
            if bits >= FLOAT_FORWARD:
                from edge_client.trainers import TorchTrainer

                self._engines[bits] = TorchTrainer(self.spec)
            else:
                from edge_client.intnn import IntModel

                self._engines[bits] = IntModel(self.spec, bits)
        return self._engines[bits]

    def _inputs(self, m: IntModel, bits: int) -> np.ndarray:
        key = -bits
        if key not in self._engines:
            self._engines[key] = m.prepare_inputs(self.probe)
        return self._engines[key]

