"""Discrete-event simulations of the mesh on the scheduler's own core (``meshserve sim``).

``loop`` is the event loop and its modelled executors; each other module is a
workload with its report: ``heavy_tail`` (queue policies), ``prefix_routing``
(shared system prompts over prefix caches) and ``quota_isolation`` (a tenant at
10x its KV quota beside another).
"""
