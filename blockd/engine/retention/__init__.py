"""Retention control of the prefix cache: what the engine keeps cached on purpose.

* :mod:`blockd.engine.retention.pins` - the engine's cache calls
  (``reset_prefix_cache``, ``pin_prefix``, ``unpin_prefix``, ``list_pins``,
  ``expire_pins``, mixed into :class:`~blockd.engine.machine.Engine`), pin
  deadlines and :class:`~blockd.engine.retention.pins.PinExpiry`, the timer
  that lets expired pins go;
* :mod:`blockd.engine.retention.retain` - retention asked for per request (an
  ``Allocate``'s ``retain_ttl_s``): which sequences wait for their commit.

Like :mod:`blockd.engine`, this file re-exports nothing.
"""
