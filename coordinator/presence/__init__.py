"""Who takes part in a round: :mod:`~coordinator.presence.selection` (who is present and
eligible, and who is drawn) and :mod:`~coordinator.presence.roundwatch` (which selected
devices can still answer, so that a round waits for them and for nobody else)."""
