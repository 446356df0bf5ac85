"""The research harness: a whole fleet on one machine (real device runtimes, a simulated
clock, the real coordinator), experiments as TOML files, data sets and partitioners, the
papers' settings, and reports. See docs/experiments.md.

- :mod:`~coordinator.emulation.config`: the experiment schema, sweeps;
- :mod:`~coordinator.emulation.experiment`: runs every combination x seed, then the reports;
- :mod:`~coordinator.emulation.emulator`: one run (:class:`Emulator`);
- :mod:`~coordinator.emulation.fleet_plan`, :mod:`~coordinator.emulation.emulated_fleet`: the devices and
  the simulated clock;
- :mod:`~coordinator.emulation.worker`, :mod:`~coordinator.emulation.pool`,
  :mod:`~coordinator.emulation.ray_backend`: where the selected devices train (this
  process, worker processes, Ray actors);
- :mod:`~coordinator.emulation.datasets`, :mod:`~coordinator.emulation.papers`,
  :mod:`~coordinator.emulation.report`.
"""
