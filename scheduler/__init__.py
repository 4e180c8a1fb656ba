"""meshserve scheduler: the executor registry, the admission queue, routing and leases.

A pure core (no gRPC; unit-tested directly and run by the simulators of
``meshserve sim``) and a thin servicer over it::

    Admit / Release / Connect ─▶ server.py ─▶ admission.py: AdmissionCore (config.py: SchedulerConfig)
                                                ├ admission_queue.py  the queue: bounds, displacement, positions
                                                ├ admission_checks.py refusals no wait cures
                                                ├ lease_table.py      leases: lifetimes and quota charges
                                                ├ queue_policy.py     order: FCFS, priority, SJF with aging
                                                ├ predictor.py        output lengths, learnt from releases
                                                ├ wait_estimate.py    estimated waits and retry delays
                                                ├ quotas.py           tenant KV quotas
                                                ├ registry.py         connected executors and their leases
                                                └ placement.py        where a request goes now
                                                   ├ pools.py           instance pools and spill rules
                                                   ├ prefix_index.py    chain hash -> executors (KV events)
                                                   ├ kvstore_index.py   the kvstore's blocks
                                                   └ routing.py         each candidate's cost: prefix hits, load

``server.py`` (``SchedulerServicer``, ``start_scheduler``) is the thin gRPC
layer; it also runs ``kvstore_follower.py`` (the kvstore's placement stream into
the kvstore index). ``metrics.py`` holds the Prometheus metrics.
"""
