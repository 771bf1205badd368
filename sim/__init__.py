"""Simulation: blockd's scheduler and allocator without a network or a model.

* :mod:`sim.workload` - the one workload generator (lengths, shared system
  prompts, sampling, arrivals);
* :mod:`sim.backend` - blockd's engine in process, behind the SDK's calls;
* :mod:`sim.model` - a model stub that makes up deterministic tokens;
* :mod:`sim.meter` - pool statistics averaged over steps;
* :mod:`sim.memory` - the memory simulations of ``bench/memory.py``;
* :mod:`sim.demo` - ``python -m sim.demo``, a serving workload on one pool.

Everything here runs :class:`client.scheduler.Scheduler`, the one scheduler.
Imports the core, the engine, the SDK's scheduler; never grpc servers, torch
or the workers.
"""
