"""meshserve: the library every service shares, and the programs that run the mesh.

The library (imports no service): the ``v1`` stubs, ``block_hash``, ``sampling``,
``errors``, ``telemetry`` and ``trace_attributes``, ``grpc_server`` (servers and
channels), ``metrics`` and ``device_metrics``, ``model_files``, ``background`` and
``timeouts``, ``cpu_affinity`` (the cores a process runs on),
the clients of services (``client``: the gateway's; ``kvstore_client`` with the
kvstore's wire format, ``kvstore_wire`` and ``kvstore_payload``) and
``gen_protos``. The programs, the only parts that import services: ``cli`` (the
``meshserve`` command, each service's process, the launcher, the demo) and
``bench`` (benchmarks and simulators).
"""

__version__ = "0.1.0"
