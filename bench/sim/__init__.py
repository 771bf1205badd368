"""Simulation: blockd's scheduler and allocator without a network or a model.

* :mod:`bench.sim.workload` - the one workload generator (lengths, shared system
  prompts, sampling, arrivals);
* :mod:`bench.sim.backend` - blockd's engine in process, behind the SDK's calls;
* :mod:`bench.sim.model` - a model stub that makes up deterministic tokens;
* :mod:`bench.sim.meter` - pool statistics averaged over steps;
* :mod:`bench.sim.memory` - the memory simulations of ``bench/memory.py``;
* :mod:`bench.sim.demo` - ``python -m bench.sim.demo``, a serving workload on one pool.

Everything here runs :class:`client.scheduler.Scheduler`, the one scheduler.
Imports the core, the engine, the SDK's scheduler; never grpc servers, torch
or the workers.
"""
