"""Privacy at the coordinator: secure aggregation's server side (``secagg``: SecAgg+
routing, summing, unmasking; ``loopback``: a whole round in one process), differential
privacy (``dp``: central clipping and noise, adaptive clipping, the distributed
mechanism's parameters; ``accountant``: ε after every round), the ``[privacy]`` settings
(``config``) and the secure round against a fleet (``round``)."""
