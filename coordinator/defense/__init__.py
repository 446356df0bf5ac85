"""Poisoning resistance, on by default: one enrolled device cannot drag the model where it
likes, and one that keeps trying is quarantined.

- :mod:`~coordinator.defense.normbound`: how far one update may move the model, relative
  to the round's robust statistics (k x the median update norm; or an adaptive quantile
  bound, for differential privacy's clipping);
- :mod:`~coordinator.defense.guard`: :class:`GuardedStrategy`, around any strategy that
  folds single updates: each update's norm and sample weight bounded relative to the
  round's medians before it is folded, and who was bounded reported;
- :mod:`~coordinator.defense.reputation`: per-device strikes (bounded or refused updates)
  and the quarantine an operator lifts (``fedbit release``);
- :mod:`~coordinator.defense.config`: the ``[defense]`` settings.
"""
